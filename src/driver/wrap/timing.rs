//! A driver wrapper that counts calls and host time per operation: where a grow or teardown
//! spends its time, by call and by handle count, without an external profiler.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::{Hook, Wrap};
use crate::driver::Driver;
use crate::error::{Op, Result};

/// A driver that passes every call to `inner`, counting calls and host time per operation.
pub type TimingDriver = Wrap<Timings>;

/// The hook of `TimingDriver`: calls and host nanoseconds per operation.
pub struct Timings {
    calls: [AtomicU64; Op::ALL.len()],
    nanos: [AtomicU64; Op::ALL.len()],
}

impl TimingDriver {
    /// `inner`, timed.
    pub fn new(inner: Arc<dyn Driver>) -> TimingDriver {
        let timings = Timings {
            calls: Default::default(),
            nanos: Default::default(),
        };
        Wrap::with_hook(inner, timings)
    }

    /// `(op, calls, total host nanoseconds)` for every op called at least once.
    pub fn report(&self) -> Vec<(Op, u64, u64)> {
        let timings = self.hook();
        let counts = Op::ALL.into_iter().map(|op| {
            let i = op as usize;
            (
                op,
                timings.calls[i].load(Ordering::Relaxed),
                timings.nanos[i].load(Ordering::Relaxed),
            )
        });
        counts.filter(|&(_, calls, _)| calls > 0).collect()
    }

    /// Forgets what was counted so far.
    pub fn reset(&self) {
        let timings = self.hook();
        timings
            .calls
            .iter()
            .chain(&timings.nanos)
            .for_each(|c| c.store(0, Ordering::Relaxed));
    }
}

impl Hook for Timings {
    // Counted as a read of the free memory, which is what it costs.
    const CHECK_ROOM_AS: Option<Op> = Some(Op::MemInfo);

    fn around<T>(&self, op: Op, _num_bytes: u64, call: impl FnOnce() -> Result<T>) -> Result<T> {
        let start = Instant::now();
        let result = call();
        let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.calls[op as usize].fetch_add(1, Ordering::Relaxed);
        self.nanos[op as usize].fetch_add(nanos, Ordering::Relaxed);
        result
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
            handle_sizing: HandleSizing::CapAligned {
                max_bytes: Some(4096),
            },
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
