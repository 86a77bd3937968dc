//! A driver wrapper that counts calls and host time per operation: where a grow or teardown
//! spends its time, by call and by handle count, without an external profiler.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::{DeviceKind, Driver, ExportTypes, Exported, HandleId, ImportSource, Stream};
use crate::error::{Op, Result};

/// A driver that passes every call to `inner`, counting calls and host time per operation.
pub struct TimingDriver {
    inner: Arc<dyn Driver>,
    calls: [AtomicU64; Op::ALL.len()],
    nanos: [AtomicU64; Op::ALL.len()],
}

impl TimingDriver {
    /// `inner`, timed.
    pub fn new(inner: Arc<dyn Driver>) -> TimingDriver {
        TimingDriver {
            inner,
            calls: Default::default(),
            nanos: Default::default(),
        }
    }

    /// `(op, calls, total host nanoseconds)` for every op called at least once.
    pub fn report(&self) -> Vec<(Op, u64, u64)> {
        let counts = Op::ALL.into_iter().map(|op| {
            let i = op as usize;
            (
                op,
                self.calls[i].load(Ordering::Relaxed),
                self.nanos[i].load(Ordering::Relaxed),
            )
        });
        counts.filter(|&(_, calls, _)| calls > 0).collect()
    }

    /// Forgets what was counted so far.
    pub fn reset(&self) {
        self.calls
            .iter()
            .chain(&self.nanos)
            .for_each(|c| c.store(0, Ordering::Relaxed));
    }

    fn time<T>(&self, op: Op, call: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let result = call();
        let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.calls[op as usize].fetch_add(1, Ordering::Relaxed);
        self.nanos[op as usize].fetch_add(nanos, Ordering::Relaxed);
        result
    }
}

impl Driver for TimingDriver {
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
        self.time(Op::Reserve, || self.inner.reserve(num_bytes))
    }

    fn free_reservation(&self, va: u64, num_bytes: u64) -> Result<()> {
        self.time(Op::FreeReservation, || {
            self.inner.free_reservation(va, num_bytes)
        })
    }

    fn supported_export_types(&self) -> ExportTypes {
        self.inner.supported_export_types()
    }

    fn create(&self, num_bytes: u64, export: ExportTypes) -> Result<HandleId> {
        self.time(Op::Create, || self.inner.create(num_bytes, export))
    }

    fn export(&self, handle: HandleId, kind: ExportTypes) -> Result<Exported> {
        self.time(Op::Export, || self.inner.export(handle, kind))
    }

    fn import(&self, source: ImportSource<'_>, num_bytes: u64) -> Result<HandleId> {
        self.time(Op::Import, || self.inner.import(source, num_bytes))
    }

    fn release(&self, handle: HandleId) -> Result<()> {
        self.time(Op::Release, || self.inner.release(handle))
    }

    fn map(&self, va: u64, num_bytes: u64, handle: HandleId) -> Result<()> {
        self.time(Op::Map, || self.inner.map(va, num_bytes, handle))
    }

    fn unmap(&self, va: u64, num_bytes: u64) -> Result<()> {
        self.time(Op::Unmap, || self.inner.unmap(va, num_bytes))
    }

    fn set_access(&self, va: u64, num_bytes: u64) -> Result<()> {
        self.time(Op::SetAccess, || self.inner.set_access(va, num_bytes))
    }

    fn memset_zero(&self, va: u64, num_bytes: u64, stream: Stream) -> Result<()> {
        self.time(Op::Memset, || self.inner.memset_zero(va, num_bytes, stream))
    }

    fn copy(&self, dst: u64, src: u64, num_bytes: u64, stream: Stream) -> Result<()> {
        self.time(Op::Copy, || self.inner.copy(dst, src, num_bytes, stream))
    }

    fn synchronize(&self) -> Result<()> {
        self.time(Op::Synchronize, || self.inner.synchronize())
    }

    fn mem_info(&self) -> Result<(u64, u64)> {
        self.time(Op::MemInfo, || self.inner.mem_info())
    }

    fn check_room(&self, num_bytes: u64) -> Result<()> {
        // Counted as a read of the free memory, which is what it costs.
        self.time(Op::MemInfo, || self.inner.check_room(num_bytes))
    }

    fn note_layout(&self, va: u64, offsets: &[u64], capacities: &[u64], committed: &[u64]) {
        self.inner.note_layout(va, offsets, capacities, committed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::host::HostDriver;
    use crate::tensor::{ExtensibleTensor, GrowOptions, HandleSizing, Options};

    #[test]
    fn counts_every_call_of_a_grow() {
        let timing = Arc::new(TimingDriver::new(Arc::new(HostDriver::new(4096).unwrap())));
        let options = Options {
            handle_sizing: HandleSizing::CapAligned { max_bytes: 4096 },
            ..Options::default()
        };
        let t =
            ExtensibleTensor::with_equal_segments(timing.clone(), 8 * 4096, 2, options).unwrap();
        t.resize_per_segment(3 * 4096, GrowOptions::zeroed())
            .unwrap();
        let calls: Vec<(Op, u64)> = timing.report().iter().map(|&(op, n, _)| (op, n)).collect();
        assert_eq!(
            calls,
            vec![
                (Op::Reserve, 1),
                (Op::Create, 6),
                (Op::Map, 6),
                (Op::SetAccess, 6),
                (Op::MemInfo, 1), // the grow's one room check (`check_room`)
            ]
        );
        timing.reset();
        assert!(timing.report().is_empty());
    }
}
