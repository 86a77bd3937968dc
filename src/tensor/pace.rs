//! The tensor's driver rate: how fast its grows create and its release thread releases
//! physical memory, one handle at a time, so that the driver's work on the device (the scrub
//! of released memory, which creates wait for) is spread thin under a live decode loop.
//!
//! `Pace` is the whole knob: it holds the rate, the time the next handle may go, and the wait
//! for that time (`wait_turn`), which both a grow (before each create) and the release thread
//! (before each release) call. A change of the rate wakes the waiters itself.
//!
//! Invariants:
//! 1. with a rate set, after a create or release of `n` bytes the next one waits until
//!    `n / rate` seconds have passed; creates and releases share that one budget, as they
//!    share the driver;
//! 2. without a rate nothing waits; lifting the rate, or closing the pace at teardown
//!    (`close`), ends every wait at once, and after `close` nothing waits again;
//! 3. the pace's lock is a leaf: no other lock is taken while it is held, and `wait_turn`
//!    lets it go while it sleeps. So a grow may wait its turn holding the tensor's state
//!    lock, and the release thread holding none.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::mapping::relock;

/// The driver rate and the wait it imposes (the module's docs).
#[derive(Default)]
pub(super) struct Pace {
    turns: Mutex<Turns>,
    /// Signalled when the rate changes or the pace closes (invariant 2).
    changed: Condvar,
}

#[derive(Default)]
struct Turns {
    /// Bytes per second; `None`: unpaced.
    rate: Option<u64>,
    /// When the next create or release may start (invariant 1).
    next_at: Option<Instant>,
    /// Set at teardown: nothing waits any more.
    closed: bool,
}

impl Turns {
    /// When the next handle may go, if it must wait at all.
    fn due(&self) -> Option<Instant> {
        self.rate?;
        self.next_at.filter(|_| !self.closed)
    }
}

impl Pace {
    fn turns(&self) -> MutexGuard<'_, Turns> {
        relock(&self.turns)
    }

    /// The rate in bytes per second; `None`: unpaced.
    pub(super) fn rate(&self) -> Option<u64> {
        self.turns().rate
    }

    /// Sets the rate from the next handle on (`None`: unpaced, which also clears the wait
    /// owed); a wait under the old rate wakes and waits by the new one.
    pub(super) fn set(&self, rate: Option<u64>) {
        let mut turns = self.turns();
        turns.rate = rate.filter(|&r| r > 0);
        if turns.rate.is_none() {
            turns.next_at = None;
        }
        drop(turns);
        self.changed.notify_all();
    }

    /// Waits until the rate allows the next handle (at once when unpaced), the pace's lock
    /// let go while it sleeps (invariant 3).
    pub(super) fn wait_turn(&self) {
        let mut turns = self.turns();
        while let Some(at) = turns.due() {
            let left = at.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let waited = self.changed.wait_timeout(turns, left);
            turns = waited.unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// Records that `bytes` were created or released just now: the next handle waits for
    /// them at the rate.
    pub(super) fn spent(&self, bytes: u64) {
        let mut turns = self.turns();
        if let Some(rate) = turns.rate {
            let owed = Duration::from_secs_f64(bytes as f64 / rate as f64);
            turns.next_at = Some(Instant::now() + owed);
        }
    }

    /// Ends every wait, now and later (teardown: what is left goes at once).
    pub(super) fn close(&self) {
        self.turns().closed = true;
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn unpaced_never_waits_and_a_rate_spaces_the_turns() {
        let pace = Pace::default();
        pace.spent(1 << 30);
        let start = Instant::now();
        pace.wait_turn();
        assert!(
            start.elapsed() < Duration::from_millis(50),
            "unpaced: no wait"
        );
        pace.set(Some(1000)); // 1,000 bytes a second: 20 bytes owe 20 ms
        pace.spent(20);
        pace.wait_turn();
        assert!(start.elapsed() >= Duration::from_millis(20));
        assert_eq!(pace.rate(), Some(1000));
    }

    #[test]
    fn lifting_the_rate_or_closing_ends_a_wait_at_once() {
        for close in [false, true] {
            let pace = Arc::new(Pace::default());
            pace.set(Some(1)); // a byte a second: 3,600 bytes owe an hour
            pace.spent(3600);
            let waiter = {
                let pace = Arc::clone(&pace);
                std::thread::spawn(move || pace.wait_turn())
            };
            std::thread::sleep(Duration::from_millis(20));
            let start = Instant::now();
            match close {
                true => pace.close(),
                false => pace.set(None),
            }
            waiter.join().unwrap();
            assert!(start.elapsed() < Duration::from_secs(5));
            if close {
                pace.set(Some(1));
                pace.spent(3600);
                pace.wait_turn(); // closed: never waits again
            }
        }
    }
}
