//! The one forwarding implementation of `Driver` that test and measurement wrappers share:
//! `Wrap<H>` passes every call to the inner driver, through its hook (`Hook::around`) for the
//! calls that do work, so each wrapper (`faulty`, `profile`) says only what it adds.

pub mod faulty;
pub mod profile;

use std::sync::Arc;

use crate::driver::{
    DeviceKind, Driver, EventId, ExportTypes, Exported, HandleId, ImportSource, Stream,
};
use crate::error::{Op, Result};

/// What a wrapper does around each call of the inner driver that does work.
pub trait Hook: Send + Sync + 'static {
    /// As which operation `check_room` goes through the hook, if at all.
    const CHECK_ROOM_AS: Option<Op>;

    /// Runs `call`, the inner driver's `op` on `num_bytes` (0 where a call has no size), or
    /// returns an error of the hook's own instead.
    fn around<T>(&self, op: Op, num_bytes: u64, call: impl FnOnce() -> Result<T>) -> Result<T>;
}

/// A driver that passes every call to `inner`, through `hook`.
pub struct Wrap<H> {
    inner: Arc<dyn Driver>,
    hook: H,
}

impl<H: Hook> Wrap<H> {
    /// `inner`, each call through `hook`.
    pub fn with_hook(inner: Arc<dyn Driver>, hook: H) -> Wrap<H> {
        Wrap { inner, hook }
    }

    /// The hook, for what it recorded.
    pub fn hook(&self) -> &H {
        &self.hook
    }
}

impl<H: Hook> Driver for Wrap<H> {
    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }

    fn device(&self) -> DeviceKind {
        self.inner.device()
    }

    fn granularity(&self) -> u64 {
        self.inner.granularity()
    }

    fn fresh_memory_is_zeroed(&self) -> bool {
        self.inner.fresh_memory_is_zeroed()
    }

    fn reserve(&self, num_bytes: u64) -> Result<u64> {
        let inner = &self.inner;
        self.hook
            .around(Op::Reserve, num_bytes, || inner.reserve(num_bytes))
    }

    fn free_reservation(&self, va: u64, num_bytes: u64) -> Result<()> {
        let inner = &self.inner;
        self.hook.around(Op::FreeReservation, num_bytes, || {
            inner.free_reservation(va, num_bytes)
        })
    }

    fn supported_export_types(&self) -> ExportTypes {
        self.inner.supported_export_types()
    }

    fn create(&self, num_bytes: u64, export: ExportTypes) -> Result<HandleId> {
        let inner = &self.inner;
        self.hook
            .around(Op::Create, num_bytes, || inner.create(num_bytes, export))
    }

    fn export(&self, handle: HandleId, kind: ExportTypes) -> Result<Exported> {
        let inner = &self.inner;
        self.hook
            .around(Op::Export, 0, || inner.export(handle, kind))
    }

    fn import(&self, source: ImportSource<'_>, num_bytes: u64) -> Result<HandleId> {
        let inner = &self.inner;
        self.hook
            .around(Op::Import, num_bytes, || inner.import(source, num_bytes))
    }

    fn release(&self, handle: HandleId) -> Result<()> {
        let inner = &self.inner;
        self.hook.around(Op::Release, 0, || inner.release(handle))
    }

    fn map(&self, va: u64, num_bytes: u64, handle: HandleId) -> Result<()> {
        let inner = &self.inner;
        self.hook
            .around(Op::Map, num_bytes, || inner.map(va, num_bytes, handle))
    }

    fn unmap(&self, va: u64, num_bytes: u64) -> Result<()> {
        let inner = &self.inner;
        self.hook
            .around(Op::Unmap, num_bytes, || inner.unmap(va, num_bytes))
    }

    fn set_access(&self, va: u64, num_bytes: u64) -> Result<()> {
        let inner = &self.inner;
        self.hook
            .around(Op::SetAccess, num_bytes, || inner.set_access(va, num_bytes))
    }

    fn memset_zero(&self, va: u64, num_bytes: u64, stream: Stream) -> Result<()> {
        let inner = &self.inner;
        self.hook.around(Op::Memset, num_bytes, || {
            inner.memset_zero(va, num_bytes, stream)
        })
    }

    fn copy(&self, dst: u64, src: u64, num_bytes: u64, stream: Stream) -> Result<()> {
        let inner = &self.inner;
        self.hook.around(Op::Copy, num_bytes, || {
            inner.copy(dst, src, num_bytes, stream)
        })
    }

    fn synchronize(&self) -> Result<()> {
        let inner = &self.inner;
        self.hook.around(Op::Synchronize, 0, || inner.synchronize())
    }

    fn fence(&self, stream: Stream) -> Result<()> {
        let inner = &self.inner;
        self.hook.around(Op::Synchronize, 0, || inner.fence(stream))
    }

    fn record_event(&self, stream: Stream) -> Result<Option<EventId>> {
        let inner = &self.inner;
        self.hook
            .around(Op::RecordEvent, 0, || inner.record_event(stream))
    }

    fn wait_event(&self, event: EventId) -> Result<()> {
        let inner = &self.inner;
        self.hook
            .around(Op::WaitEvent, 0, || inner.wait_event(event))
    }

    fn destroy_event(&self, event: EventId) -> Result<()> {
        let inner = &self.inner;
        self.hook
            .around(Op::WaitEvent, 0, || inner.destroy_event(event))
    }

    fn hold_events(&self, held: bool) -> Result<()> {
        self.inner.hold_events(held)
    }

    fn mem_info(&self) -> Result<(u64, u64)> {
        let inner = &self.inner;
        self.hook.around(Op::MemInfo, 0, || inner.mem_info())
    }

    fn check_room(&self, num_bytes: u64) -> Result<()> {
        let inner = &self.inner;
        match H::CHECK_ROOM_AS {
            Some(op) => self
                .hook
                .around(op, num_bytes, || inner.check_room(num_bytes)),
            None => inner.check_room(num_bytes),
        }
    }

    fn note_layout(&self, va: u64, offsets: &[u64], capacities: &[u64], committed: &[u64]) {
        self.inner.note_layout(va, offsets, capacities, committed);
    }
}
