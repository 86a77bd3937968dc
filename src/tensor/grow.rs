//! Growing: plan the missing granules (`plan.rs`), create and map one handle per planned run
//! into locals, grant access, zero the new bytes, and only then move the new mappings into the
//! tensor. Any failure drops the locals, whose destructors unmap and release what the call
//! made: a failed grow changes nothing.

use super::{check_state, ExtensibleTensor, GrowOptions, Mapping, Mappings, PerSegment};
use crate::driver::Stream;
use crate::error::{Error, Result, SizeOp};
use crate::plan::{self, ByteRange, HandlePolicy, Run};

/// Whether a grow zeroes its new bytes, on which stream, and whether it has queued any.
struct Zeroing {
    enabled: bool,
    stream: Stream,
    queued: bool,
}

impl Zeroing {
    fn new(enabled: bool, stream: Stream) -> Zeroing {
        Zeroing {
            enabled,
            stream,
            queued: false,
        }
    }
}

impl ExtensibleTensor {
    /// Grows a one-segment tensor to `num_bytes`.
    pub fn resize(&self, num_bytes: u64, options: GrowOptions) -> Result<()> {
        self.check_one_segment(SizeOp::Resize)?;
        self.resize_per_segment([num_bytes], options)
    }

    /// `Error::NotOneSegment` unless the tensor has one segment (for `op`, a one-size call).
    pub(super) fn check_one_segment(&self, op: SizeOp) -> Result<()> {
        match self.num_segments() {
            1 => Ok(()),
            num_segments => Err(Error::NotOneSegment { op, num_segments }),
        }
    }

    /// Grows segment `i` to `bytes[i]` (or every segment to one size); zeroes the new bytes
    /// `[old_i, new_i)` of each segment on `options.stream` when `options.zero_new`. All or
    /// nothing: on error the tensor is unchanged.
    pub fn resize_per_segment(&self, bytes: impl PerSegment, options: GrowOptions) -> Result<()> {
        let segment_bytes = &*bytes.per_segment(self.num_segments());
        let mut state = self.lock_owned("grow")?;
        let geometry = &self.inner.geometry;
        geometry.check_request(segment_bytes)?;
        if let Some(segment) = state
            .segment_bytes
            .iter()
            .zip(segment_bytes)
            .position(|(o, n)| n < o)
        {
            return Err(Error::WrongDirection {
                op: SizeOp::Resize,
                segment,
                from_bytes: state.segment_bytes[segment],
                to_bytes: segment_bytes[segment],
            });
        }
        if state.segment_bytes == segment_bytes {
            return Ok(());
        }
        let new_ranges = geometry.new_ranges(&state.segment_bytes, segment_bytes);
        let new_granules = plan::granules_of(&new_ranges, geometry.granularity());
        // Mappings given back but not released yet are mapped again rather than waited for:
        // their memory is still there (and zeroed below like any mapped granule).
        // One handle per run (vLLM's RDMA registrations) cannot reuse handles cut otherwise:
        // wait for those pending release instead.
        let taken_back = match options.one_handle_per_run {
            true => {
                self.inner.releaser.settle();
                Vec::new()
            }
            false => self.inner.releaser.take_back(&new_granules),
        };
        let taken_runs: Vec<u64> = taken_back
            .iter()
            .map(|(_, m)| m.run.first_granule)
            .collect();
        let mut events = Vec::with_capacity(taken_back.len());
        for (event, mapping) in taken_back {
            events.push(event);
            state.mappings.insert(mapping);
        }
        let grown = self.grow_locked(
            &mut state,
            segment_bytes,
            new_ranges,
            &new_granules,
            options,
        );
        if grown.is_err() {
            // As it was: what was taken back waits for its release again.
            let again = taken_runs
                .iter()
                .zip(events)
                .map(|(&first_granule, event)| {
                    let mapping = state.mappings.remove(first_granule);
                    (
                        event,
                        mapping.expect("inserted above, and a failed grow adds nothing"),
                    )
                });
            self.inner.releaser.requeue(again.collect());
        }
        grown
    }

    /// The grow of `resize_per_segment` once its request is checked and what it needs of the
    /// pending releases is mapped again.
    fn grow_locked(
        &self,
        state: &mut super::Locked<'_>,
        segment_bytes: &[u64],
        new_ranges: Vec<ByteRange>,
        new_granules: &[Run],
        options: GrowOptions,
    ) -> Result<()> {
        let mapped = mapped_overlapping(&state.mappings, new_granules);
        let policy = match options.one_handle_per_run {
            true => HandlePolicy::WholeRuns,
            false => self.inner.policy,
        };
        let plan = plan::plan_grow(new_ranges, new_granules, &mapped, policy);
        self.refuse_lent(state, &plan.new_handles)?;
        if plan.new_handles.len() > 1 {
            // All the new handles at once: a grow that cannot fit fails before its first create
            // rather than after taking what it could (one handle's create checks itself).
            let ctx = &self.inner.ctx;
            let new_bytes = plan.new_handles.iter().map(|&run| ctx.span(run).1).sum();
            ctx.driver.check_room(new_bytes)?;
        }
        let mut zeroing = Zeroing::new(options.zero_new, options.stream);
        // Owned here, not in `map_and_zero`, so that on error the mappings unmap (as `fresh`
        // drops) only after the fence below.
        let mut fresh = Vec::with_capacity(plan.new_handles.len());
        if let Err(err) = self.map_and_zero(&plan, &mapped, &mut zeroing, &mut fresh) {
            if zeroing.queued {
                // Queued memsets may still write to the fresh mappings: fence first.
                let fence = self.inner.ctx.driver.fence(zeroing.stream);
                self.inner.ctx.defer(fence);
            }
            drop(fresh);
            return Err(err);
        }
        for mapping in fresh {
            state.mappings.insert(mapping);
        }
        state.segment_bytes.copy_from_slice(segment_bytes);
        debug_assert_eq!(check_state(&self.inner, state), Ok(()));
        Ok(())
    }

    /// Creates, maps and grants access to one handle per planned run, and zeroes the new
    /// logical bytes, pushing each mapping into `fresh` as soon as it exists. A handle's bytes
    /// are zeroed as soon as it is accessible, so on a device the memsets run while the host
    /// maps the next handles. On error, the caller fences, then drops `fresh` (unmapping and
    /// releasing what this call made).
    ///
    /// (A second thread creating handles ahead of the mapping one was tried on the H200: the
    /// driver serialises the calls, and creates took 1.5-1.9x longer; docs/benchmarks.md.)
    fn map_and_zero(
        &self,
        plan: &plan::GrowPlan,
        mapped: &[Run],
        zeroing: &mut Zeroing,
        fresh: &mut Vec<Mapping>,
    ) -> Result<()> {
        let inner = &*self.inner;
        let g = inner.geometry.granularity();
        let fresh_is_zero = inner.ctx.driver.fresh_memory_is_zeroed();
        // Pieces of the new bytes, each inside one new handle, in address order.
        let in_fresh = match zeroing.enabled && !fresh_is_zero {
            true => plan::intersect(&plan.new_ranges, &plan.new_handles, g),
            false => Vec::new(),
        };
        let mut pending = in_fresh.iter().peekable();
        for &run in &plan.new_handles {
            let bytes = inner.geometry.run_bytes(run);
            inner.pace.wait_turn(); // the driver rate, if set (`pace.rs`)
            fresh.push(Mapping::create(&inner.ctx, run)?);
            inner.pace.spent(bytes.num_bytes);
            inner
                .ctx
                .driver
                .set_access(inner.ctx.base + bytes.offset, bytes.num_bytes)?;
            while let Some(piece) = pending.next_if(|p| p.offset < bytes.end()) {
                self.zero(piece, zeroing)?;
            }
        }
        if zeroing.enabled {
            // New bytes in granules mapped earlier (a granule shared with a neighbour, or the
            // slack past the old prefix) are not fresh memory: zero them on every backend.
            for piece in plan::intersect(&plan.new_ranges, mapped, g) {
                self.zero(&piece, zeroing)?;
            }
        }
        Ok(())
    }

    fn zero(&self, piece: &ByteRange, zeroing: &mut Zeroing) -> Result<()> {
        let va = self.inner.ctx.base + piece.offset;
        zeroing.queued = true;
        self.inner
            .ctx
            .driver
            .memset_zero(va, piece.num_bytes, zeroing.stream)
    }
}

/// The runs of the mappings that overlap any of `spans` (sorted, disjoint), in order.
fn mapped_overlapping(mappings: &Mappings, spans: &[Run]) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for span in spans {
        let before = mappings
            .range(..span.first_granule)
            .next_back()
            .map(|(_, m)| m.run);
        let straddling = before.filter(|run| run.end_granule() > span.first_granule);
        let inside = mappings
            .range(span.first_granule..span.end_granule())
            .map(|(_, m)| m.run);
        for run in straddling.into_iter().chain(inside) {
            if runs.last() != Some(&run) {
                runs.push(run);
            }
        }
    }
    runs
}
