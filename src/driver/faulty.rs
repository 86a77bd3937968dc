//! A driver wrapper that fails the k-th call of one operation, for testing that every failure
//! leaves the owner exactly as it was.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::{DeviceKind, Driver, ExportTypes, Exported, HandleId, ImportSource, Stream};
use crate::error::{Error, Op, Result};

/// How the injected failure looks to the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// `Error::Driver` with code `INJECTED_FAULT`.
    Driver,
    /// `Error::OutOfMemory` with code `INJECTED_OOM`.
    OutOfMemory,
}

impl FaultKind {
    /// `driver` or `oom`.
    pub fn from_name(name: &str) -> Option<FaultKind> {
        match name {
            "driver" => Some(FaultKind::Driver),
            "oom" => Some(FaultKind::OutOfMemory),
            _ => None,
        }
    }
}

/// Which call fails, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The operation whose call fails.
    pub op: Op,
    /// 1-based: the `nth` call of `op` fails, every other call passes through.
    pub nth: u64,
    /// What the failure looks like.
    pub kind: FaultKind,
}

/// A driver that passes every call to `inner` except the one `fault` names.
pub struct FaultyDriver {
    inner: Arc<dyn Driver>,
    fault: Fault,
    calls: [AtomicU64; Op::ALL.len()],
    /// Every call in order, for tests of ordering (e.g. the fence before an unmap).
    log: Mutex<Vec<Op>>,
}

impl FaultyDriver {
    /// `inner`, failing as `fault` says.
    pub fn new(inner: Arc<dyn Driver>, fault: Fault) -> FaultyDriver {
        FaultyDriver {
            inner,
            fault,
            calls: Default::default(),
            log: Mutex::default(),
        }
    }

    /// How many times `op` has been called so far, the failed call included.
    pub fn calls(&self, op: Op) -> u64 {
        self.calls[op as usize].load(Ordering::Relaxed)
    }

    /// Every call so far, in order (the failed one included).
    pub fn log(&self) -> Vec<Op> {
        self.log.lock().expect("log poisoned").clone()
    }

    fn check(&self, op: Op, num_bytes: u64) -> Result<()> {
        self.log.lock().expect("log poisoned").push(op);
        let n = self.calls[op as usize].fetch_add(1, Ordering::Relaxed) + 1;
        if op != self.fault.op || n != self.fault.nth {
            return Ok(());
        }
        Err(match self.fault.kind {
            FaultKind::Driver => Error::Driver {
                op,
                code: "INJECTED_FAULT".into(),
                detail: format!("call {n} of {op}, injected"),
            },
            FaultKind::OutOfMemory => Error::OutOfMemory {
                op,
                requested_bytes: num_bytes,
                free_bytes: None,
                code: "INJECTED_OOM".into(),
            },
        })
    }
}

impl Driver for FaultyDriver {
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
        self.check(Op::Reserve, num_bytes)?;
        self.inner.reserve(num_bytes)
    }

    fn free_reservation(&self, va: u64, num_bytes: u64) -> Result<()> {
        self.check(Op::FreeReservation, num_bytes)?;
        self.inner.free_reservation(va, num_bytes)
    }

    fn supported_export_types(&self) -> ExportTypes {
        self.inner.supported_export_types()
    }

    fn create(&self, num_bytes: u64, export: ExportTypes) -> Result<HandleId> {
        self.check(Op::Create, num_bytes)?;
        self.inner.create(num_bytes, export)
    }

    fn export(&self, handle: HandleId, kind: ExportTypes) -> Result<Exported> {
        self.check(Op::Export, 0)?;
        self.inner.export(handle, kind)
    }

    fn import(&self, source: ImportSource<'_>, num_bytes: u64) -> Result<HandleId> {
        self.check(Op::Import, num_bytes)?;
        self.inner.import(source, num_bytes)
    }

    fn release(&self, handle: HandleId) -> Result<()> {
        self.check(Op::Release, 0)?;
        self.inner.release(handle)
    }

    fn map(&self, va: u64, num_bytes: u64, handle: HandleId) -> Result<()> {
        self.check(Op::Map, num_bytes)?;
        self.inner.map(va, num_bytes, handle)
    }

    fn unmap(&self, va: u64, num_bytes: u64) -> Result<()> {
        self.check(Op::Unmap, num_bytes)?;
        self.inner.unmap(va, num_bytes)
    }

    fn set_access(&self, va: u64, num_bytes: u64) -> Result<()> {
        self.check(Op::SetAccess, num_bytes)?;
        self.inner.set_access(va, num_bytes)
    }

    fn memset_zero(&self, va: u64, num_bytes: u64, stream: Stream) -> Result<()> {
        self.check(Op::Memset, num_bytes)?;
        self.inner.memset_zero(va, num_bytes, stream)
    }

    fn copy(&self, dst: u64, src: u64, num_bytes: u64, stream: Stream) -> Result<()> {
        self.check(Op::Copy, num_bytes)?;
        self.inner.copy(dst, src, num_bytes, stream)
    }

    fn synchronize(&self) -> Result<()> {
        self.check(Op::Synchronize, 0)?;
        self.inner.synchronize()
    }

    fn check_room(&self, num_bytes: u64) -> Result<()> {
        // Not a call that fault injection counts: it makes nothing to roll back.
        self.inner.check_room(num_bytes)
    }

    fn mem_info(&self) -> Result<(u64, u64)> {
        self.check(Op::MemInfo, 0)?;
        self.inner.mem_info()
    }

    fn note_layout(&self, va: u64, offsets: &[u64], capacities: &[u64], committed: &[u64]) {
        self.inner.note_layout(va, offsets, capacities, committed);
    }
}
