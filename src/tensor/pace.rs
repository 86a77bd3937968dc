//! The tensor's driver rate: how fast its grows create and its release thread releases
//! physical memory, one handle at a time, so that the driver's work on the device (the scrub
//! of released memory, which creates wait for) is spread thin under a live decode loop.
//!
//! Invariants:
//! 1. with a rate set, after a create or release of `n` bytes the next one waits until
//!    `n / rate` seconds have passed; creates and releases share that one budget, as they
//!    share the driver;
//! 2. without a rate nothing waits, and lifting the rate ends every wait at once;
//! 3. a `Pace` holds no other lock while it is locked: the release thread and a grow read it
//!    under the release queue's lock (a grow holding the tensor's state lock as well), and
//!    both wait their turn on that queue's condvar (`Releaser::wait_turn`), which a change of
//!    the rate signals.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::mapping::relock;

#[derive(Default)]
pub(super) struct Pace {
    /// Bytes per second; 0: unpaced.
    rate: AtomicU64,
    /// When the next create or release may start (invariant 1).
    next_at: Mutex<Option<Instant>>,
}

impl Pace {
    /// The rate in bytes per second; `None`: unpaced.
    pub(super) fn rate(&self) -> Option<u64> {
        Some(self.rate.load(Ordering::Relaxed)).filter(|&r| r > 0)
    }

    /// Sets the rate (`None`: unpaced, which also clears the wait owed).
    pub(super) fn set(&self, rate: Option<u64>) {
        self.rate.store(rate.unwrap_or(0), Ordering::Relaxed);
        if rate.is_none() {
            *relock(&self.next_at) = None;
        }
    }

    /// When the next handle may go; `None`: now.
    pub(super) fn due(&self) -> Option<Instant> {
        self.rate()?;
        *relock(&self.next_at)
    }

    /// Records that `bytes` were created or released just now.
    pub(super) fn spent(&self, bytes: u64) {
        if let Some(rate) = self.rate() {
            let owed = Duration::from_secs_f64(bytes as f64 / rate as f64);
            *relock(&self.next_at) = Some(Instant::now() + owed);
        }
    }
}
