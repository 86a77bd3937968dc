//! The host backend's stand-in for stream events. Host work runs before its call returns, so
//! an event is complete when recorded (`record` says `None`). Tests of what waits for an event
//! (the deferred release of `tensor/release.rs`) hold events instead: each recorded while held
//! stays pending until let go, as on a stream a decode loop keeps busy, or until `synchronize`,
//! which waits for everything as a device synchronize does.

use std::collections::BTreeSet;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use crate::driver::EventId;
use crate::error::{Error, Op, Result};

#[derive(Default)]
struct State {
    held: bool,
    /// Events recorded while held and not let go yet.
    pending: BTreeSet<u64>,
    /// Every event recorded and not destroyed, to refuse a wait on one that is not.
    live: BTreeSet<u64>,
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
        if !state.held {
            return None;
        }
        state.next += 1;
        let id = state.next;
        state.pending.insert(id);
        state.live.insert(id);
        Some(EventId(id))
    }

    pub(super) fn wait(&self, event: EventId) -> Result<()> {
        let mut state = self.lock();
        if !state.live.contains(&event.0) {
            return Err(unknown(event));
        }
        while state.pending.contains(&event.0) {
            state = self
                .completed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        Ok(())
    }

    pub(super) fn destroy(&self, event: EventId) -> Result<()> {
        let mut state = self.lock();
        if !state.live.remove(&event.0) {
            return Err(unknown(event));
        }
        state.pending.remove(&event.0);
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
