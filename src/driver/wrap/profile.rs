//! The profile of a driver's calls: a wrapper that counts calls and host time per operation,
//! where a grow or teardown spends its time, by call and by handle count, without an external
//! profiler (Python's `_profile=True` and `_profile_report()`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::{Hook, Wrap};
use crate::driver::Driver;
use crate::error::{Op, Result};

/// A driver that passes every call to `inner`, counting calls and host time per operation.
pub type ProfilingDriver = Wrap<Profile>;

/// The hook of `ProfilingDriver`: calls and host nanoseconds per operation.
pub struct Profile {
    calls: [AtomicU64; Op::ALL.len()],
    nanos: [AtomicU64; Op::ALL.len()],
}

impl ProfilingDriver {
    /// `inner`, profiled.
    pub fn new(inner: Arc<dyn Driver>) -> ProfilingDriver {
        let profile = Profile {
            calls: Default::default(),
            nanos: Default::default(),
        };
        Wrap::with_hook(inner, profile)
    }

    /// `(op, calls, total host nanoseconds)` for every op called at least once.
    pub fn report(&self) -> Vec<(Op, u64, u64)> {
        let profile = self.hook();
        let counts = Op::ALL.into_iter().map(|op| {
            let i = op as usize;
            (
                op,
                profile.calls[i].load(Ordering::Relaxed),
                profile.nanos[i].load(Ordering::Relaxed),
            )
        });
        counts.filter(|&(_, calls, _)| calls > 0).collect()
    }

    /// Forgets what was counted so far.
    pub fn reset(&self) {
        let profile = self.hook();
        profile
            .calls
            .iter()
            .chain(&profile.nanos)
            .for_each(|c| c.store(0, Ordering::Relaxed));
    }
}

impl Hook for Profile {
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
        let profiled = Arc::new(ProfilingDriver::new(Arc::new(
            HostDriver::new(4096).unwrap(),
        )));
        let options = Options {
            handle_sizing: HandleSizing::CapAligned {
                max_bytes: Some(4096),
            },
            ..Options::default()
        };
        let t =
            ExtensibleTensor::with_equal_segments(profiled.clone(), 8 * 4096, 2, options).unwrap();
        t.resize_per_segment(3 * 4096, GrowOptions::zeroed())
            .unwrap();
        let calls: Vec<(Op, u64)> = profiled
            .report()
            .iter()
            .map(|&(op, n, _)| (op, n))
            .collect();
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
        profiled.reset();
        assert!(profiled.report().is_empty());
    }
}
