//! The host backend's stand-in for stream events. Host work runs before its call returns, so
//! an event is complete when recorded (`record` says `None`). Tests of what waits for an event
//! (the deferred release of `tensor/release.rs`) hold events instead: each recorded while held
//! stays pending until let go, as on a stream a decode loop keeps busy, or until `synchronize`,
//! which waits for everything as a device synchronize does.
//!
//! `EXTENSIBLE_KV_HOST_EVENT_DELAY_US=N` makes every event complete N microseconds after it is
//! recorded, as a device's do a little after the call that queued them: the release then
//! happens on the tensor's thread, as on CUDA. The CPU test suite runs once so
//! (`scripts/test`), which keeps the tests that run on both backends honest about it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crate::driver::EventId;
use crate::error::{Error, Op, Result};

/// The variable that delays every event's completion (microseconds), as a device's.
pub const DELAY_ENV_VAR: &str = "EXTENSIBLE_KV_HOST_EVENT_DELAY_US";

/// The delay `DELAY_ENV_VAR` asks for, read once; none when unset, 0 or not a number.
fn delay() -> Option<Duration> {
    static DELAY: OnceLock<Option<Duration>> = OnceLock::new();
    *DELAY.get_or_init(|| {
        let micros: u64 = std::env::var(DELAY_ENV_VAR).ok()?.trim().parse().ok()?;
        (micros > 0).then(|| Duration::from_micros(micros))
    })
}

#[derive(Default)]
struct State {
    held: bool,
    /// Events recorded while held and not let go yet.
    pending: BTreeSet<u64>,
    /// Every event recorded and not destroyed, to refuse a wait on one that is not.
    live: BTreeSet<u64>,
    /// When each delayed event (`DELAY_ENV_VAR`) completes on its own.
    due: BTreeMap<u64, Instant>,
    next: u64,
}

#[derive(Default)]
pub(super) struct Events {
    state: Mutex<State>,
    completed: Condvar,
}

impl Events {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn record(&self) -> Option<EventId> {
        let mut state = self.lock();
        let delay = delay();
        if !state.held && delay.is_none() {
            return None;
        }
        state.next += 1;
        let id = state.next;
        state.pending.insert(id);
        state.live.insert(id);
        if let (false, Some(delay)) = (state.held, delay) {
            state.due.insert(id, Instant::now() + delay);
        }
        Some(EventId(id))
    }

    pub(super) fn wait(&self, event: EventId) -> Result<()> {
        let mut state = self.lock();
        if !state.live.contains(&event.0) {
            return Err(unknown(event));
        }
        while state.pending.contains(&event.0) {
            let due = state.due.get(&event.0).copied();
            state = match due {
                None => self
                    .completed
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner),
                Some(due) if Instant::now() >= due => {
                    state.pending.remove(&event.0);
                    state.due.remove(&event.0);
                    break;
                }
                Some(due) => {
                    let left = due.saturating_duration_since(Instant::now());
                    let waited = self.completed.wait_timeout(state, left);
                    waited.unwrap_or_else(PoisonError::into_inner).0
                }
            };
        }
        Ok(())
    }

    pub(super) fn destroy(&self, event: EventId) -> Result<()> {
        let mut state = self.lock();
        if !state.live.remove(&event.0) {
            return Err(unknown(event));
        }
        state.pending.remove(&event.0);
        state.due.remove(&event.0);
        Ok(())
    }

    /// Holds the events recorded from now on (`held`), or lets every pending one complete.
    pub(super) fn hold(&self, held: bool) {
        let mut state = self.lock();
        state.held = held;
        if !held {
            self.complete_all(&mut state);
        }
    }

    /// Completes every pending event (what a synchronize waits for).
    pub(super) fn synchronize(&self) {
        self.complete_all(&mut self.lock());
    }

    fn complete_all(&self, state: &mut State) {
        state.pending.clear();
        state.due.clear();
        self.completed.notify_all();
    }
}

fn unknown(event: EventId) -> Error {
    Error::Driver {
        op: Op::WaitEvent,
        code: "EINVAL".into(),
        detail: format!("no live event {}", event.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_events_wait_until_let_go_and_unknown_ones_are_refused() {
        let events = std::sync::Arc::new(Events::default());
        assert_eq!(events.record(), None, "not held: complete at once");
        events.hold(true);
        let event = events.record().expect("held");
        let waiter = {
            let events = std::sync::Arc::clone(&events);
            std::thread::spawn(move || events.wait(event))
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(
            !waiter.is_finished(),
            "a held event keeps its waiter waiting"
        );
        events.synchronize();
        waiter.join().unwrap().unwrap();
        let second = events.record().expect("still held");
        events.hold(false);
        events.wait(second).unwrap();
        events.destroy(event).unwrap();
        events.destroy(second).unwrap();
        assert!(events.wait(event).is_err() && events.destroy(event).is_err());
    }
}
