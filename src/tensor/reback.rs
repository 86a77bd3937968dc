//! Giving memory back without losing data: shrink, exact shrink and consolidate.
//!
//! A shrink releases the handles that hold no granule a committed byte still needs (after the
//! fence). An exact shrink and a consolidation re-back runs of granules by new handles: those
//! are built at a scratch reservation and filled by a device copy (`stage`), then swapped in at
//! the tensor's own addresses (`swap`), so views, CUDA graphs and registrations by address stay
//! valid. The old handles are unmapped but released only once every new one is in: a failure
//! part-way maps them back, and the tensor is as it was (`reback`).
//!
//! A consolidation goes in steps (`plan::ConsolidateStep`: one run of granules, with any run
//! that shares one of its handles, moved to one new handle), a pipeline when memory allows: the
//! next step's handles are staged and its copy queued before this step is swapped in, so the
//! device copies the next step while the host swaps this one and releases its old handles (host calls as long as the copy:
//! 0.4 ms per GiB released against 0.5 ms per GiB copied on the H200).
//!
//! Tried on the H200 and dropped (docs/benchmarks.md, "Consolidate's floor"): releasing on a
//! second thread (the driver serialises its VMM calls: the creates, reserves and unmaps beside
//! it got 2-50x slower), one unmap over each stretch of old mappings (it costs what one per
//! mapping does), and queuing the next copy after the swap (an unmap does not wait for it).

use std::sync::Arc;

use super::{
    check_state, Ctx, ExtensibleTensor, Mapping, PerSegment, PhysicalHandle, ShrinkOptions, State,
};
use crate::driver::Stream;
use crate::error::{Error, Result, SizeOp};
use crate::plan::{self, Run};

/// A second mapping, at a scratch address, of a handle owned elsewhere; unmaps on drop.
struct Alias {
    ctx: Arc<Ctx>,
    va: u64,
    num_bytes: u64,
}

impl Drop for Alias {
    fn drop(&mut self) {
        self.ctx
            .defer(self.ctx.driver.unmap(self.va, self.num_bytes));
    }
}

/// Owns a reservation other than the tensor's (where a copy is built); frees it on drop.
struct ScratchReservation {
    ctx: Arc<Ctx>,
    va: u64,
    num_bytes: u64,
}

impl Drop for ScratchReservation {
    fn drop(&mut self) {
        self.ctx
            .defer(self.ctx.driver.free_reservation(self.va, self.num_bytes));
    }
}

/// Fresh handles for some runs, each mapped at a scratch reservation and holding a copy of the
/// bytes at its run. Dropping it fences first while its copies may still run (`copying`), so
/// that no copy writes through a scratch mapping after the unmap; then its fields drop in
/// order: the scratch mappings, the handles not taken, then the scratch reservation.
struct Staging {
    ctx: Arc<Ctx>,
    /// Where the copies were queued.
    stream: Stream,
    aliases: Vec<Alias>,
    handles: Vec<(Run, PhysicalHandle)>,
    scratch: Option<ScratchReservation>,
    copying: bool,
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.copying {
            self.ctx.defer(self.ctx.driver.fence(self.stream));
        }
    }
}

impl ExtensibleTensor {
    /// Shrinks a one-segment tensor to `num_bytes`, keeping the bytes below.
    pub fn shrink(&self, num_bytes: u64, options: ShrinkOptions) -> Result<()> {
        self.check_one_segment(SizeOp::Shrink)?;
        self.shrink_per_segment([num_bytes], options)
    }

    /// Shrinks segment `i` to `bytes[i]` (or every segment to one size), keeping bytes
    /// `[0, new_i)` of every segment.
    /// Handles that hold no granule a committed byte still needs are unmapped, after a fence,
    /// and released; a granule shared with a neighbour's live prefix stays. With
    /// `options.exact`, each handle that straddles the new frontier is replaced by handles of
    /// just its needed granules (built at a scratch address, filled by a device copy, then
    /// swapped in at the same address), except a borrowed one, which stays whole (it goes
    /// back to its lender whole). All or nothing: on error the tensor is unchanged.
    pub fn shrink_per_segment(&self, bytes: impl PerSegment, options: ShrinkOptions) -> Result<()> {
        let segment_bytes = &*bytes.per_segment(self.num_segments());
        let mut state = self.lock_owned("shrink")?;
        let geometry = &self.inner.geometry;
        geometry.check_request(segment_bytes)?;
        let grows = state.segment_bytes.iter().zip(segment_bytes);
        if let Some(segment) = grows.clone().position(|(o, n)| n > o) {
            return Err(Error::WrongDirection {
                op: SizeOp::Shrink,
                segment,
                from_bytes: state.segment_bytes[segment],
                to_bytes: segment_bytes[segment],
            });
        }
        let needed = geometry.needed_runs(segment_bytes);
        let mapped: Vec<Run> = state.mappings.values().map(|m| m.run).collect();
        let plan = plan::plan_shrink(&mapped, &needed);
        let mut old = plan.dead;
        let mut new = Vec::new();
        if options.exact {
            for (handle, live) in plan.straddling {
                if is_borrowed(&state, handle) {
                    continue; // it goes back to its lender whole, never as a copy
                }
                old.push(handle);
                new.extend(live);
            }
            old.sort_unstable();
        }
        if !new.is_empty() {
            self.reback(&mut state, &old, &new, options.stream)?;
        } else if !old.is_empty() {
            self.release_runs(&mut state, &old, options.stream)?;
        }
        state.segment_bytes.copy_from_slice(segment_bytes);
        debug_assert_eq!(check_state(&self.inner, &state), Ok(()));
        Ok(())
    }

    /// Gives the mappings over `runs` back once the work queued on `stream` so far has run
    /// (`release.rs`): they leave the state now, and the call does not wait for the device.
    /// An error recording the event leaves them where they were.
    fn release_runs(&self, state: &mut State, runs: &[Run], stream: Stream) -> Result<()> {
        let taken: Vec<Mapping> = runs
            .iter()
            .map(|run| {
                let mapping = state.mappings.remove(run.first_granule);
                mapping.expect("planned from the mappings")
            })
            .collect();
        if let Err((err, taken)) = self.inner.releaser.release(taken, stream, true) {
            for mapping in taken {
                state.mappings.insert(mapping);
            }
            return Err(err);
        }
        Ok(())
    }

    /// Backs every maximal run of committed granules by one handle (each segment's prefix, for
    /// segments that share no granule), keeping every byte and every address: views and CUDA
    /// graphs stay valid, but registrations of the old pages (RDMA) must be renewed. It goes in
    /// steps (`plan::ConsolidateStep`), largest first, each built at a scratch address, filled
    /// by a copy and swapped in; each step is all or nothing, and an out-of-memory on the
    /// first (largest) leaves the tensor unchanged. Extra memory: the largest step's new
    /// handle, and the next step's too while this one is swapped in when it fits in half the
    /// free memory (the pipeline of the
    /// module docs; the other half is left to others). Handles that hold no committed byte
    /// (slack of a shrink) are released too. Borrowed handles stay as they are: they go back
    /// to their lender whole.
    pub fn consolidate(&self, stream: Stream) -> Result<()> {
        let mut state = self.lock_owned("consolidate")?;
        // Borrowed handles stay as they are: they go back to their lender whole (`give_back`),
        // never as a copy this tensor would own.
        let (own, borrowed): (Vec<&Mapping>, Vec<&Mapping>) = state
            .mappings
            .values()
            .partition(|m| m.handle().loan.is_none());
        let borrowed: Vec<Run> = borrowed.iter().map(|m| m.run).collect();
        let mapped: Vec<Run> = own.iter().map(|m| m.run).collect();
        let needed = self.inner.geometry.needed_runs(&state.segment_bytes);
        let needed = plan::subtract(&needed, &borrowed);
        let mut steps = plan::plan_consolidate(&mapped, &needed)
            .into_iter()
            .peekable();
        let mut ahead: Option<Staging> = None;
        while let Some(step) = steps.next() {
            let mut staging = match ahead.take() {
                Some(staging) => staging,
                None => self.stage(&step.new, stream)?,
            };
            // The fence: this run's copies have landed, and work queued on `stream` no longer
            // touches its old mappings. Work queued after it (the next run's copy) reads other
            // runs only.
            self.inner.ctx.driver.fence(stream)?;
            staging.copying = false;
            if let Some(next) = steps.peek() {
                ahead = self.stage_ahead(&next.new, stream);
            }
            let handles = std::mem::take(&mut staging.handles);
            // On error `ahead` drops, fencing before it unmaps what its copy writes to.
            self.swap_in(&mut state, &step.old, handles)?;
        }
        debug_assert_eq!(check_state(&self.inner, &state), Ok(()));
        Ok(())
    }

    /// The next run's staging, made before this run is swapped in, when its new bytes fit in
    /// half the free memory; `None` otherwise, or if staging fails (the run is then staged in
    /// its turn, which reports the error if it persists).
    fn stage_ahead(&self, runs: &[Run], stream: Stream) -> Option<Staging> {
        let (free_bytes, _) = self.inner.ctx.driver.mem_info().ok()?;
        if self.runs_bytes(runs) > free_bytes / 2 {
            return None;
        }
        self.stage(runs, stream).ok()
    }

    /// The bytes of granule `runs` (what staging them takes).
    fn runs_bytes(&self, runs: &[Run]) -> u64 {
        let geometry = &self.inner.geometry;
        runs.iter().map(|&r| geometry.run_bytes(r).num_bytes).sum()
    }

    /// Replaces the mappings over the `old` runs by fresh handles over the `new` runs (each
    /// inside the old ones), holding a copy of their bytes. All or nothing: the new handles are
    /// built and filled at a scratch reservation first; the swap at the tensor's addresses
    /// unmaps the old mappings but releases their handles only once every new one is in, so
    /// a failure maps the old handles back.
    fn reback(&self, state: &mut State, old: &[Run], new: &[Run], stream: Stream) -> Result<()> {
        let mut staging = self.stage(new, stream)?;
        let handles = std::mem::take(&mut staging.handles);
        let replaced = self.replace(state, old, handles, stream);
        // The fence in `replace` has let the copies land, unless it failed.
        staging.copying = replaced.is_err();
        replaced
    }

    /// Replaces the mappings over the `old` runs by `handles` over their runs, all or nothing:
    /// after the fence on `stream`, `swap_in`.
    pub(super) fn replace(
        &self,
        state: &mut State,
        old: &[Run],
        handles: Vec<(Run, PhysicalHandle)>,
        stream: Stream,
    ) -> Result<()> {
        // The fence: work queued on `stream` may still touch the old mappings, and the copies
        // must land. An event, not a context synchronize: a decode loop on another stream is
        // not waited for (the caller orders its own streams, as with any allocator).
        self.inner.ctx.driver.fence(stream)?;
        self.swap_in(state, old, handles)
    }

    /// `replace` after its fence (which the caller has made since the last work that could
    /// touch the old mappings was queued): the old mappings are unmapped and the new ones
    /// mapped; the old handles are released only once every new one is in, so a failure maps
    /// them back.
    pub(super) fn swap_in(
        &self,
        state: &mut State,
        old: &[Run],
        handles: Vec<(Run, PhysicalHandle)>,
    ) -> Result<()> {
        let mut unmapped = Vec::with_capacity(old.len());
        let mut added = Vec::with_capacity(handles.len());
        let swapped = self.swap(state, old, handles, &mut unmapped, &mut added);
        if swapped.is_ok() {
            for mapping in added {
                state.mappings.insert(mapping);
            }
            drop(unmapped); // releases the old handles
        } else {
            drop(added);
            for (run, handle) in unmapped {
                self.map_back(state, run, handle);
            }
        }
        swapped
    }

    /// `reback`'s first half: fresh handles for `runs` at a scratch reservation, accessible and
    /// holding a copy of the bytes at each run (ordered on `stream`).
    fn stage(&self, runs: &[Run], stream: Stream) -> Result<Staging> {
        let mut staging = Staging {
            ctx: Arc::clone(&self.inner.ctx),
            stream,
            aliases: Vec::with_capacity(runs.len()),
            handles: Vec::with_capacity(runs.len()),
            scratch: None,
            copying: false,
        };
        if runs.is_empty() {
            return Ok(staging);
        }
        let (ctx, geometry) = (&self.inner.ctx, &self.inner.geometry);
        let total = self.runs_bytes(runs);
        let va = ctx.driver.reserve(total)?;
        staging.scratch = Some(ScratchReservation {
            ctx: Arc::clone(ctx),
            va,
            num_bytes: total,
        });
        let mut scratch_va = va;
        for &run in runs {
            let num_bytes = geometry.run_bytes(run).num_bytes;
            let handle = PhysicalHandle::create(ctx, num_bytes)?;
            ctx.driver.map(scratch_va, num_bytes, handle.id)?;
            staging.handles.push((run, handle));
            staging.aliases.push(Alias {
                ctx: Arc::clone(ctx),
                va: scratch_va,
                num_bytes,
            });
            ctx.driver.set_access(scratch_va, num_bytes)?;
            scratch_va += num_bytes;
        }
        // The copies are queued on `stream`, after the work queued there that may still write
        // the bytes they read.
        for (alias, (run, _)) in staging.aliases.iter().zip(&staging.handles) {
            let (src, _) = ctx.span(*run);
            staging.copying = true;
            ctx.driver.copy(alias.va, src, alias.num_bytes, stream)?;
        }
        Ok(staging)
    }

    /// `reback`'s second half: unmaps the `old` mappings (keeping their handles, in
    /// `unmapped`) and maps the staged `handles` in their place (in `added`).
    fn swap(
        &self,
        state: &mut State,
        old: &[Run],
        handles: Vec<(Run, PhysicalHandle)>,
        unmapped: &mut Vec<(Run, PhysicalHandle)>,
        added: &mut Vec<Mapping>,
    ) -> Result<()> {
        for &run in old {
            let key = run.first_granule;
            let mapping = state
                .mappings
                .remove(key)
                .expect("planned from the mappings");
            match mapping.unmap() {
                Ok(handle) => unmapped.push((run, handle)),
                Err((err, mapping)) => {
                    state.mappings.insert(mapping);
                    return Err(err);
                }
            }
        }
        for (run, handle) in handles {
            added.push(Mapping::map(handle, run)?);
            let (va, num_bytes) = self.inner.ctx.span(run);
            self.inner.ctx.driver.set_access(va, num_bytes)?;
        }
        Ok(())
    }

    /// Undoes one unmap of `swap`: the handle, still holding its bytes, goes back over its
    /// run. A failure here (a second fault in one call) is recorded for
    /// `take_deferred_errors`, and the run is left unmapped.
    pub(super) fn map_back(&self, state: &mut State, run: Run, handle: PhysicalHandle) {
        if let Some(mapping) = Mapping::map_back(handle, run) {
            state.mappings.insert(mapping);
        }
    }
}

/// Whether the handle mapped over `run` is borrowed.
fn is_borrowed(state: &State, run: Run) -> bool {
    let mapping = state.mappings.get(&run.first_granule);
    mapping.is_some_and(|m| m.handle().loan.is_some())
}
