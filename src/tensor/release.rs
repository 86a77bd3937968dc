//! Giving physical memory back in the stream's order, off the caller's thread.
//!
//! A shrink or `release_physical` must not unmap memory that work queued earlier may still
//! touch. Waiting for that on the caller's thread (a context synchronize) cost ~0.42 s per call
//! on an H200 while a decode loop kept the device busy, since the context is never idle. So
//! the mappings leave the tensor's state at once, an event is recorded on the caller's stream,
//! and a thread of this tensor's own waits for the event and only then unmaps and releases
//! them. Until then they stay mapped and count in `physical_bytes`, and `pending_bytes` says
//! how much is still on its way back.
//!
//! Invariants:
//! 1. a pending mapping is unmapped only after its event completed (or after a synchronize,
//!    at teardown, or when the wait itself failed);
//! 2. pending runs are disjoint from the tensor's mappings: a grow over a pending run takes
//!    that mapping back (`take_back`) rather than mapping over it, and a borrow waits for all
//!    pending releases (`settle`) before it places anything;
//! 3. a mapping the driver would not unmap stays owned here (`stuck`, counted as pending),
//!    for a grow to take back or teardown to unmap again: never leaked, never mapped over;
//! 4. the thread holds no lock while it waits on an event or calls the driver, and it never
//!    takes the tensor's state lock: a caller holding that lock may wait on the thread;
//! 5. with a driver rate set (`pace.rs`), the thread releases one handle at a time, each
//!    when the rate allows (`Pace::wait_turn`, with no lock of this module held); the handles
//!    it has not reached stay pending, for a grow to take back. The shrink still returns at
//!    once; only the memory reaches the driver later.
//!
//! A backend whose events are complete when recorded (the host backend, unless a test holds
//! them) gets its memory released on the caller's thread, all or nothing, as before: a failed
//! unmap maps back what was unmapped and the caller keeps every mapping.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::mapping::{relock, Ctx, Mapping, PhysicalHandle};
use super::pace::Pace;
use crate::driver::{EventId, Stream};
use crate::error::Error;
use crate::plan::{self, Run};

/// What `release` hands back when it released nothing: the error and every mapping.
type Refused = (Error, Vec<Mapping>);

/// A recorded event, destroyed when the last holder lets go (a pending entry, the thread
/// while it waits on it, a mapping a grow took back).
pub(super) struct Event {
    ctx: Arc<Ctx>,
    id: EventId,
}

impl Drop for Event {
    fn drop(&mut self) {
        self.ctx.defer(self.ctx.driver.destroy_event(self.id));
    }
}

/// Mappings that leave once their event completes.
struct Pending {
    seq: u64,
    event: Arc<Event>,
    mappings: Vec<Mapping>,
}

#[derive(Default)]
struct Queue {
    pending: VecDeque<Pending>,
    /// Runs the thread is unmapping now (taken out of `pending`, not released yet).
    in_flight: Vec<Run>,
    /// Mappings the driver would not unmap (invariant 3).
    stuck: Vec<Mapping>,
    /// Bytes and handles of `pending`, `in_flight` and `stuck`: still mapped.
    bytes: u64,
    handles: usize,
    next_seq: u64,
    /// Set at teardown: the thread exits once `pending` is empty.
    closing: bool,
}

impl Queue {
    fn add(&mut self, mappings: &[Mapping]) {
        self.bytes += mappings.iter().map(Mapping::num_bytes).sum::<u64>();
        self.handles += mappings.len();
    }

    fn remove<'a>(&mut self, mappings: impl IntoIterator<Item = &'a Mapping>) {
        for mapping in mappings {
            self.bytes -= mapping.num_bytes();
            self.handles -= 1;
        }
    }

    /// Whether every release given to the thread has happened or got stuck.
    fn settled(&self) -> bool {
        self.pending.is_empty() && self.in_flight.is_empty()
    }
}

/// A mapping a grow took back, with the event it was waiting for (none if it was stuck).
pub(super) type TakenBack = (Option<Arc<Event>>, Mapping);

/// The deferred release of one tensor's mappings.
pub(super) struct Releaser {
    ctx: Arc<Ctx>,
    queue: Mutex<Queue>,
    /// Signalled when an entry is queued, released or taken back, and at teardown.
    changed: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The tensor's driver rate, which its grows share (invariant 5).
    pace: Arc<Pace>,
}

impl Releaser {
    pub(super) fn new(ctx: Arc<Ctx>, pace: Arc<Pace>) -> Arc<Releaser> {
        Arc::new(Releaser {
            ctx,
            queue: Mutex::default(),
            changed: Condvar::new(),
            thread: Mutex::new(None),
            pace,
        })
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        relock(&self.queue)
    }

    fn wait<'a>(&self, queue: MutexGuard<'a, Queue>) -> MutexGuard<'a, Queue> {
        self.changed
            .wait(queue)
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Gives `mappings` back once the work queued on `stream` so far has run: at once when
    /// the backend says that work is done, else from this tensor's release thread. When
    /// nothing was released (the event could not be recorded, or, `all_or_nothing`, an unmap
    /// done at once failed), every mapping comes back with the error, for the caller to keep.
    /// Otherwise an unmap that fails at once is deferred, and its mapping unmapped on drop
    /// (`release_physical`: the tensor holds nothing afterwards).
    pub(super) fn release(
        self: &Arc<Self>,
        mappings: Vec<Mapping>,
        stream: Stream,
        all_or_nothing: bool,
    ) -> Result<(), Refused> {
        if mappings.is_empty() {
            return Ok(());
        }
        match self.ctx.driver.record_event(stream) {
            Ok(Some(id)) => {
                let event = Arc::new(Event {
                    ctx: Arc::clone(&self.ctx),
                    id,
                });
                self.enqueue(event, mappings);
                Ok(())
            }
            Ok(None) if all_or_nothing => self.release_now(mappings),
            Ok(None) => {
                drop(mappings); // each unmaps, then releases; errors are deferred
                Ok(())
            }
            Err(err) => Err((err, mappings)),
        }
    }

    /// Unmaps every mapping, then releases their handles; a failed unmap maps back what was
    /// unmapped and hands every mapping back with the error. (A failed release is deferred:
    /// the handle is gone from the tensor either way.)
    fn release_now(&self, mappings: Vec<Mapping>) -> Result<(), Refused> {
        let mut unmapped: Vec<(Run, PhysicalHandle)> = Vec::with_capacity(mappings.len());
        let mut left = mappings.into_iter();
        for mapping in left.by_ref() {
            let run = mapping.run;
            match mapping.unmap() {
                Ok(handle) => unmapped.push((run, handle)),
                Err((err, mapping)) => {
                    let mut back = vec![mapping];
                    back.extend(
                        unmapped
                            .into_iter()
                            .filter_map(|(r, h)| Mapping::map_back(h, r)),
                    );
                    back.extend(left);
                    return Err((err, back));
                }
            }
        }
        drop(unmapped); // releases the handles
        Ok(())
    }

    fn enqueue(self: &Arc<Self>, event: Arc<Event>, mappings: Vec<Mapping>) {
        let mut queue = self.queue();
        queue.add(&mappings);
        queue.next_seq += 1;
        let seq = queue.next_seq;
        queue.pending.push_back(Pending {
            seq,
            event,
            mappings,
        });
        drop(queue);
        self.changed.notify_all();
        self.start_thread();
    }

    /// Starts the release thread unless it runs. Should the OS refuse a thread, the caller's
    /// thread waits and releases instead.
    fn start_thread(self: &Arc<Self>) {
        let mut thread = relock(&self.thread);
        if thread.is_some() {
            return;
        }
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("extensible-kv-release".into())
            .spawn(move || me.run());
        match spawned {
            Ok(handle) => *thread = Some(handle),
            Err(_) => {
                drop(thread);
                while self.release_front() {}
            }
        }
    }

    fn run(&self) {
        loop {
            let mut queue = self.queue();
            while queue.pending.is_empty() {
                if queue.closing {
                    return;
                }
                queue = self.wait(queue);
            }
            drop(queue);
            self.release_front();
        }
    }

    /// Waits for the first pending entry's event, then unmaps and releases what is left of
    /// it (a grow may take mappings back meanwhile): all at once, or one handle at a time at
    /// the driver rate. False when nothing was pending.
    fn release_front(&self) -> bool {
        let front = self
            .queue()
            .pending
            .front()
            .map(|p| (p.seq, Arc::clone(&p.event)));
        let Some((seq, event)) = front else {
            return false;
        };
        let mut waited = Some(self.ctx.driver.wait_event(event.id));
        loop {
            self.pace.wait_turn(); // the driver rate, if set
            let mut queue = self.queue();
            let Some(entry) = queue.pending.front_mut().filter(|p| p.seq == seq) else {
                break; // taken back whole, or released at teardown
            };
            let mappings = match self.pace.rate() {
                None => std::mem::take(&mut entry.mappings),
                Some(_) => entry.mappings.pop().into_iter().collect(),
            };
            if entry.mappings.is_empty() {
                queue.pending.pop_front();
            }
            queue.in_flight = mappings.iter().map(|m| m.run).collect();
            drop(queue);
            if let Some(Err(err)) = waited.take() {
                // The event cannot tell any more (the context failed): wait for everything
                // rather than unmap under work that may still run.
                self.ctx.defer(Err(err));
                self.ctx.defer(self.ctx.driver.synchronize());
            }
            self.unmap_and_release(mappings);
        }
        drop(event);
        true
    }

    /// Unmaps and releases `mappings` (the thread's `in_flight`), keeping the ones the driver
    /// would not unmap (invariant 3), and sets when the next handle may go at the rate.
    fn unmap_and_release(&self, mappings: Vec<Mapping>) {
        let mut released = Vec::with_capacity(mappings.len());
        let mut stuck = Vec::new();
        for mapping in mappings {
            let num_bytes = mapping.num_bytes();
            match mapping.unmap() {
                Ok(handle) => released.push((num_bytes, handle)),
                Err((err, mapping)) => {
                    self.ctx.defer(Err(err));
                    stuck.push(mapping);
                }
            }
        }
        let bytes: u64 = released.iter().map(|(num_bytes, _)| num_bytes).sum();
        let handles = released.len();
        drop(released); // each handle's release; its errors are deferred
        let mut queue = self.queue();
        queue.in_flight.clear();
        queue.bytes -= bytes;
        queue.handles -= handles;
        queue.stuck.extend(stuck);
        drop(queue);
        self.pace.spent(bytes);
        self.changed.notify_all();
    }

    /// Takes back the pending (or stuck) mappings that overlap any of `granules` (sorted,
    /// disjoint), once the thread is not unmapping any of them: a grow maps them again
    /// instead of waiting for their release.
    pub(super) fn take_back(&self, granules: &[Run]) -> Vec<TakenBack> {
        let overlaps = |run: Run| !plan::intersect_run(run, granules).is_empty();
        let mut queue = self.queue();
        while queue.in_flight.iter().any(|&run| overlaps(run)) {
            queue = self.wait(queue);
        }
        let mut taken: Vec<TakenBack> = Vec::new();
        for entry in queue.pending.iter_mut() {
            let (hit, kept): (Vec<Mapping>, Vec<Mapping>) = std::mem::take(&mut entry.mappings)
                .into_iter()
                .partition(|m| overlaps(m.run));
            entry.mappings = kept;
            taken.extend(hit.into_iter().map(|m| (Some(Arc::clone(&entry.event)), m)));
        }
        let (hit, kept): (Vec<Mapping>, Vec<Mapping>) = std::mem::take(&mut queue.stuck)
            .into_iter()
            .partition(|m| overlaps(m.run));
        queue.stuck = kept;
        taken.extend(hit.into_iter().map(|m| (None, m)));
        queue.remove(taken.iter().map(|(_, m)| m));
        queue.pending.retain(|p| !p.mappings.is_empty());
        drop(queue);
        self.changed.notify_all();
        taken
    }

    /// Gives back what `take_back` took and the caller could not use (a failed grow).
    pub(super) fn requeue(self: &Arc<Self>, taken: Vec<TakenBack>) {
        for (event, mapping) in taken {
            match event {
                Some(event) => self.enqueue(event, vec![mapping]),
                None => {
                    let mut queue = self.queue();
                    queue.add(std::slice::from_ref(&mapping));
                    queue.stuck.push(mapping);
                }
            }
        }
    }

    /// Waits until every release given to the thread has happened (or got stuck), or for
    /// `timeout`: whether it has.
    pub(super) fn wait_released(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut queue = self.queue();
        while !queue.settled() {
            queue = match deadline {
                None => self.wait(queue),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return false;
                    }
                    let waited = self.changed.wait_timeout(queue, left);
                    waited.unwrap_or_else(PoisonError::into_inner).0
                }
            };
        }
        true
    }

    /// Waits for every pending release (a borrow places handles where pending ones may lie).
    pub(super) fn settle(&self) {
        self.wait_released(None);
    }

    /// At teardown, after the caller's synchronize (which completed every event): lets the
    /// release thread end, then unmaps and releases what is left on the caller's thread.
    pub(super) fn shut_down(&self) {
        let mut queue = self.queue();
        queue.closing = true;
        let pending: Vec<Pending> = queue.pending.drain(..).collect();
        let stuck = std::mem::take(&mut queue.stuck);
        queue.remove(pending.iter().flat_map(|p| &p.mappings).chain(&stuck));
        drop(queue);
        self.pace.close(); // a thread waiting its turn stops waiting
        self.changed.notify_all();
        let thread = relock(&self.thread).take();
        if let Some(thread) = thread {
            let _ = thread.join(); // it ends once it has released its entry, if it had one
        }
        drop(pending); // each unmaps (again, for `stuck`), then releases; errors deferred
        drop(stuck);
    }

    /// Bytes still on their way back (mapped, counted in `physical_bytes`).
    pub(super) fn pending_bytes(&self) -> u64 {
        self.queue().bytes
    }

    /// Handles still on their way back.
    pub(super) fn pending_handles(&self) -> usize {
        self.queue().handles
    }

    /// The runs of the mappings held here, for the invariant checks.
    pub(super) fn pending_runs(&self) -> Vec<Run> {
        let queue = self.queue();
        let pending = queue.pending.iter().flat_map(|p| &p.mappings);
        let held = pending.chain(&queue.stuck).map(|m| m.run);
        let mut runs: Vec<Run> = held.chain(queue.in_flight.iter().copied()).collect();
        runs.sort_unstable();
        runs
    }
}
