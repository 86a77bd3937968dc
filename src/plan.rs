//! Planning: which granules a request needs, which of them are missing, and how the missing
//! ones are cut into physical handles. Pure integer arithmetic — no pointers, no FFI — so all
//! of it is property-tested without a device.
//!
//! The reservation is an array of granules. Segment `i` occupies bytes
//! `[offset_i, offset_i + capacity_i)`; segments are laid back to back, so when a capacity is
//! not a granule multiple two segments share a granule. Committing `b_i` bytes of segment `i`
//! needs granules `[floor(offset_i / g), ceil((offset_i + b_i) / g))`; the union over segments,
//! minus what is mapped, is what to map. Taking the union is the dedup: a shared granule is
//! mapped once. Everything here is O(segments + handles), never O(granules).

use crate::error::{Error, Result};

/// A half-open range of granules `[first_granule, first_granule + num_granules)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Run {
    /// The first granule, counted from the reservation's start.
    pub first_granule: u64,
    /// How many granules.
    pub num_granules: u64,
}

impl Run {
    /// `num_granules` granules from `first_granule`.
    pub fn new(first_granule: u64, num_granules: u64) -> Run {
        Run {
            first_granule,
            num_granules,
        }
    }

    /// One past the last granule.
    ///
    /// Cannot overflow for the runs this module makes and takes: those come from a
    /// `Geometry` (`needed_runs`, `granules_of` its bytes, cuts of those), whose granules end
    /// at `num_granules() <= u64::MAX`, or passed `check_runs` (a description's), which
    /// refuses a run whose end does not fit.
    pub fn end_granule(self) -> u64 {
        self.first_granule + self.num_granules
    }

    /// `end_granule`, or `None` where it does not fit in 64 bits: for runs not yet checked.
    pub fn checked_end_granule(self) -> Option<u64> {
        self.first_granule.checked_add(self.num_granules)
    }

    /// The bytes of these granules, relative to the reservation's start.
    ///
    /// Cannot overflow for a run inside a `Geometry` of this `granularity` (see `end_granule`):
    /// its bytes end at most at `reserved_bytes()`, which `Geometry::new` checked fits.
    pub fn bytes(self, granularity: u64) -> ByteRange {
        ByteRange {
            offset: self.first_granule * granularity,
            num_bytes: self.num_granules * granularity,
        }
    }
}

/// A half-open byte range `[offset, offset + num_bytes)` relative to the reservation's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteRange {
    /// The first byte, counted from the reservation's start.
    pub offset: u64,
    /// How many bytes.
    pub num_bytes: u64,
}

impl ByteRange {
    /// One past the last byte.
    ///
    /// Cannot overflow for the ranges this module makes: a `Geometry`'s (`needed_runs`,
    /// `new_ranges`, `run_bytes`, after `check_request`) end at most at `reserved_bytes()`;
    /// `footprint_bytes` checks its own before making them.
    pub fn end(self) -> u64 {
        self.offset + self.num_bytes
    }
}

/// More segments than any layout needs (the largest, L·H, is a few thousand): a bound that
/// keeps absurd requests from allocating per-segment books.
pub const MAX_SEGMENTS: u64 = 1 << 20;

/// The reservation's shape: granularity and the segments' capacities and offsets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    granularity: u64,
    segment_capacities: Vec<u64>,
    segment_offsets: Vec<u64>,
    reserved_bytes: u64,
}

impl Geometry {
    /// `num_segments` equal segments of `max_bytes / num_segments` bytes each.
    pub fn equal(max_bytes: u64, num_segments: u64, granularity: u64) -> Result<Geometry> {
        if num_segments == 0 {
            return Err(Error::invalid("num_segments must be at least 1"));
        }
        if max_bytes % num_segments != 0 {
            return Err(Error::invalid(format!(
                "max_bytes ({max_bytes}) must be divisible by num_segments ({num_segments}); \
                 pass segment_capacities for unequal segments"
            )));
        }
        if num_segments > MAX_SEGMENTS {
            return Err(Error::invalid(format!(
                "{num_segments} segments: at most {MAX_SEGMENTS} are supported"
            )));
        }
        // Divisible and positive, max_bytes is at least num_segments: no segment is empty.
        if max_bytes == 0 {
            return Err(Error::invalid("max_bytes must be at least 1, got 0"));
        }
        let count = usize::try_from(num_segments).expect("bounded by MAX_SEGMENTS");
        Geometry::new(vec![max_bytes / num_segments; count], granularity)
    }

    /// Segments of the given capacities, laid back to back.
    pub fn new(segment_capacities: Vec<u64>, granularity: u64) -> Result<Geometry> {
        if granularity == 0 || !granularity.is_power_of_two() {
            return Err(Error::invalid(format!(
                "granularity must be a power of two; got {granularity}"
            )));
        }
        if segment_capacities.is_empty() {
            return Err(Error::invalid("at least one segment is needed"));
        }
        if segment_capacities.len() as u64 > MAX_SEGMENTS {
            return Err(Error::invalid(format!(
                "{} segments: at most {MAX_SEGMENTS} are supported",
                segment_capacities.len()
            )));
        }
        if let Some(i) = segment_capacities.iter().position(|&c| c == 0) {
            return Err(Error::invalid(format!("segment {i} has capacity 0 bytes")));
        }
        let mut segment_offsets = Vec::with_capacity(segment_capacities.len());
        let mut total: u64 = 0;
        for &capacity in &segment_capacities {
            segment_offsets.push(total);
            total = total
                .checked_add(capacity)
                .ok_or_else(|| Error::invalid("the segment capacities overflow 64 bits"))?;
        }
        let reserved_bytes = total
            .checked_next_multiple_of(granularity)
            .ok_or_else(|| Error::invalid(format!("{total} bytes cannot be reserved")))?;
        Ok(Geometry {
            granularity,
            segment_capacities,
            segment_offsets,
            reserved_bytes,
        })
    }

    /// The mapping granularity in bytes.
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// How many segments.
    pub fn num_segments(&self) -> usize {
        self.segment_capacities.len()
    }

    /// Each segment's capacity in bytes.
    pub fn segment_capacities(&self) -> &[u64] {
        &self.segment_capacities
    }

    /// Each segment's first byte, from the reservation's start.
    pub fn segment_offsets(&self) -> &[u64] {
        &self.segment_offsets
    }

    /// The bytes the segments can hold: where the last one ends, which is the sum of their
    /// capacities (they lie back to back from 0; `Geometry::new` checked it fits in 64 bits).
    /// Not granule-aligned: `reserved_bytes` is this rounded up to whole granules.
    pub fn capacity_bytes(&self) -> u64 {
        self.segment_offsets.last().copied().unwrap_or(0)
            + self.segment_capacities.last().copied().unwrap_or(0)
    }

    /// The capacity rounded up to whole granules: the size of the address reservation.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved_bytes
    }

    /// Granules in the reservation.
    pub fn num_granules(&self) -> u64 {
        self.reserved_bytes / self.granularity
    }

    /// Checks a per-segment request: one entry per segment, none above its capacity.
    pub fn check_request(&self, segment_bytes: &[u64]) -> Result<()> {
        if segment_bytes.len() != self.num_segments() {
            return Err(Error::invalid(format!(
                "expected {} per-segment sizes, got {}",
                self.num_segments(),
                segment_bytes.len()
            )));
        }
        let over = segment_bytes
            .iter()
            .zip(&self.segment_capacities)
            .position(|(b, c)| b > c);
        if let Some(i) = over {
            return Err(Error::invalid(format!(
                "{} bytes exceeds the capacity of segment {i} ({} bytes)",
                segment_bytes[i], self.segment_capacities[i]
            )));
        }
        Ok(())
    }

    /// The granules that hold the first `segment_bytes[i]` bytes of every segment, merged into
    /// sorted, disjoint, non-adjacent runs. `segment_bytes` must pass `check_request`: then
    /// `offset_i + segment_bytes[i] <= capacity_bytes()`, and no sum here overflows.
    pub fn needed_runs(&self, segment_bytes: &[u64]) -> Vec<Run> {
        debug_assert!(self.check_request(segment_bytes).is_ok());
        let prefixes: Vec<ByteRange> = self
            .segment_offsets
            .iter()
            .zip(segment_bytes)
            .map(|(&offset, &num_bytes)| ByteRange { offset, num_bytes })
            .collect();
        granules_of(&prefixes, self.granularity)
    }

    /// The logical bytes a grow from `old` to `new` adds: `[old_i, new_i)` of every segment.
    /// Both must pass `check_request`, so `offset_i + old_i` cannot overflow (as in
    /// `needed_runs`).
    pub fn new_ranges(&self, old: &[u64], new: &[u64]) -> Vec<ByteRange> {
        debug_assert!(self.check_request(old).is_ok());
        debug_assert!(self.check_request(new).is_ok());
        let triples = self.segment_offsets.iter().zip(old).zip(new);
        triples
            .filter(|((_, o), n)| n > o)
            .map(|((&offset, &o), &n)| ByteRange {
                offset: offset + o,
                num_bytes: n - o,
            })
            .collect()
    }

    /// The bytes of granule `run`.
    pub fn run_bytes(&self, run: Run) -> ByteRange {
        run.bytes(self.granularity)
    }
}

/// The physical bytes that committing the first `prefix_bytes` of every segment maps, the
/// segments starting at `segment_offsets` (in any order): whole granules, a granule that two
/// segments share counted once. What sizing converts a budget into blocks with.
pub fn footprint_bytes(
    segment_offsets: &[u64],
    prefix_bytes: u64,
    granularity: u64,
) -> Result<u64> {
    if granularity == 0 {
        return Err(Error::invalid("granularity must be positive"));
    }
    let mut offsets = segment_offsets.to_vec();
    offsets.sort_unstable();
    let prefixes = offsets
        .into_iter()
        .map(|offset| match offset.checked_add(prefix_bytes) {
            Some(_) => Ok(ByteRange {
                offset,
                num_bytes: prefix_bytes,
            }),
            None => Err(Error::invalid(format!(
                "{prefix_bytes} bytes at offset {offset} overflow 64 bits"
            ))),
        })
        .collect::<Result<Vec<ByteRange>>>()?;
    let too_large = || {
        Error::invalid(format!(
            "{prefix_bytes} bytes of {} segments in granules of {granularity} bytes map more \
             than 2^64 bytes",
            segment_offsets.len()
        ))
    };
    // The runs are disjoint and inside `[0, ceil(u64::MAX / granularity)]`, so their sum fits;
    // checked all the same, as the product is.
    granules_of(&prefixes, granularity)
        .iter()
        .try_fold(0u64, |sum, run| sum.checked_add(run.num_granules))
        .and_then(|num_granules| num_granules.checked_mul(granularity))
        .ok_or_else(too_large)
}

/// `needed` minus `mapped`; both sorted and disjoint. The result is sorted and disjoint.
pub fn subtract(needed: &[Run], mapped: &[Run]) -> Vec<Run> {
    let mut missing = Vec::new();
    let mut m = 0;
    for run in needed {
        let mut cursor = run.first_granule;
        m += mapped[m..].partition_point(|r| r.end_granule() <= cursor);
        let mut k = m;
        while k < mapped.len() && mapped[k].first_granule < run.end_granule() {
            if mapped[k].first_granule > cursor {
                missing.push(Run::new(cursor, mapped[k].first_granule - cursor));
            }
            cursor = cursor.max(mapped[k].end_granule());
            k += 1;
        }
        if cursor < run.end_granule() {
            missing.push(Run::new(cursor, run.end_granule() - cursor));
        }
    }
    missing
}

/// The parts of `ranges` (sorted, disjoint) that fall inside granule `runs` (sorted, disjoint).
/// Both lie inside one `Geometry` of this `granularity`, so no product or sum here passes its
/// `reserved_bytes()` (see `Run::bytes`).
pub fn intersect(ranges: &[ByteRange], runs: &[Run], granularity: u64) -> Vec<ByteRange> {
    let mut out = Vec::new();
    let mut r = 0;
    for range in ranges {
        r += runs[r..].partition_point(|run| run.end_granule() * granularity <= range.offset);
        let mut k = r;
        while k < runs.len() && runs[k].first_granule * granularity < range.end() {
            let start = range.offset.max(runs[k].first_granule * granularity);
            let end = range.end().min(runs[k].end_granule() * granularity);
            if start < end {
                out.push(ByteRange {
                    offset: start,
                    num_bytes: end - start,
                });
            }
            k += 1;
        }
    }
    out
}

/// How a run of missing granules is cut into physical handles: `tensor::HandleSizing` in
/// granules (each variant there names the one here it maps onto).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandlePolicy {
    /// Cut at the multiples of `max_handle_granules` in the reservation's granule index, and
    /// nowhere else: a run costs at most `len / max + 2` handles, whatever granule it starts
    /// at, while interior handles stay aligned to the cap.
    CapAligned {
        /// The cap, in granules.
        max_handle_granules: u64,
    },
    /// Greedy from the left: the largest power-of-two block of granules that is aligned (in
    /// the reservation's granule index) at the current granule, fits in the run, and is at
    /// most `max_handle_granules`. A bulk grow costs O(log n) handles; a one-granule grow one.
    AlignedPowersOfTwo {
        /// The cap, in granules (rounded down to a power of two).
        max_handle_granules: u64,
    },
    /// From each run's start, pieces of `max_handle_granules` (the last one of a run may be
    /// shorter): one handle per run up to the cap, wherever the run starts. With a cap of one
    /// granule, what per-granule peers do.
    PerRun {
        /// Every handle's size but a run's last, in granules.
        max_handle_granules: u64,
    },
    /// One handle per run, however long: what a segment registered for RDMA needs.
    WholeRuns,
}

/// `max_handle_bytes` in granules of `granularity`: it must be a positive multiple of it.
pub fn handle_granules(max_handle_bytes: u64, granularity: u64) -> Result<u64> {
    if granularity == 0 {
        return Err(Error::invalid("granularity must be positive"));
    }
    if max_handle_bytes < granularity || max_handle_bytes % granularity != 0 {
        return Err(Error::invalid(format!(
            "handle_sizing max_bytes ({max_handle_bytes}) must be a positive multiple of the \
             granularity ({granularity})"
        )));
    }
    Ok(max_handle_bytes / granularity)
}

impl HandlePolicy {
    /// Appends the handles for `run` to `out`. Nothing here overflows given `end_granule`
    /// does: every size is at most `end - cursor`, and a shift is by at most 63.
    pub fn cut(self, run: Run, out: &mut Vec<Run>) {
        let mut cursor = run.first_granule;
        let end = run.end_granule();
        while cursor < end {
            let size = match self {
                HandlePolicy::AlignedPowersOfTwo {
                    max_handle_granules,
                } => {
                    let cap = prev_power_of_two(max_handle_granules.max(1));
                    let fits = prev_power_of_two(end - cursor);
                    let aligned = if cursor == 0 {
                        u64::MAX
                    } else {
                        1 << cursor.trailing_zeros()
                    };
                    cap.min(fits).min(aligned)
                }
                HandlePolicy::PerRun {
                    max_handle_granules,
                } => max_handle_granules.max(1).min(end - cursor),
                HandlePolicy::CapAligned {
                    max_handle_granules,
                } => {
                    let cap = max_handle_granules.max(1);
                    (cap - cursor % cap).min(end - cursor)
                }
                HandlePolicy::WholeRuns => end - cursor,
            };
            out.push(Run::new(cursor, size));
            cursor += size;
        }
    }
}

fn prev_power_of_two(n: u64) -> u64 {
    debug_assert!(n > 0);
    1 << (63 - n.leading_zeros())
}

/// What one grow does: the handles to create and map, and the bytes to zero.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrowPlan {
    /// Sorted, disjoint, none overlapping what was mapped.
    pub new_handles: Vec<Run>,
    /// The new logical bytes of every segment, sorted.
    pub new_ranges: Vec<ByteRange>,
}

/// Plans a grow that adds the bytes `new_ranges` (`Geometry::new_ranges` of the old and new
/// sizes), whose granules are `new_granules` (`granules_of(&new_ranges)`), given the `mapped`
/// runs that overlap them (sorted, disjoint): the missing granules, cut by `policy`.
///
/// Only the granules of the new bytes can be missing, so the work is O(segments × log
/// handles) however much is already mapped.
pub fn plan_grow(
    new_ranges: Vec<ByteRange>,
    new_granules: &[Run],
    mapped: &[Run],
    policy: HandlePolicy,
) -> GrowPlan {
    let mut new_handles = Vec::new();
    for run in subtract(new_granules, mapped) {
        policy.cut(run, &mut new_handles);
    }
    GrowPlan {
        new_handles,
        new_ranges,
    }
}

/// The parts of `run` inside `runs` (sorted, disjoint), in order.
pub fn intersect_run(run: Run, runs: &[Run]) -> Vec<Run> {
    let first = runs.partition_point(|r| r.end_granule() <= run.first_granule);
    runs[first..]
        .iter()
        .take_while(|r| r.first_granule < run.end_granule())
        .map(|r| {
            let start = r.first_granule.max(run.first_granule);
            Run::new(start, r.end_granule().min(run.end_granule()) - start)
        })
        .collect()
}

/// What a shrink does to the mapped handles, given the granules the new sizes still need.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShrinkPlan {
    /// Handles holding no needed granule: unmapped and released.
    pub dead: Vec<Run>,
    /// Handles holding needed and unneeded granules, each with the runs of needed granules it
    /// holds: an exact shrink replaces it by one handle per such run.
    pub straddling: Vec<(Run, Vec<Run>)>,
}

/// Sorts the `mapped` handles (sorted, disjoint) against the `needed` granules (sorted,
/// disjoint runs): dead, straddling, or (not listed) wholly needed.
pub fn plan_shrink(mapped: &[Run], needed: &[Run]) -> ShrinkPlan {
    let mut plan = ShrinkPlan::default();
    for &handle in mapped {
        let live = intersect_run(handle, needed);
        if live.is_empty() {
            plan.dead.push(handle);
        } else if live != [handle] {
            plan.straddling.push((handle, live));
        }
    }
    plan
}

/// One all-or-nothing step of a consolidation: the handles over the `old` runs give way to one
/// new handle per `new` run, holding the same bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsolidateStep {
    /// The mapped runs to replace.
    pub old: Vec<Run>,
    /// The runs that replace them (each inside an old one), to be backed by new handles.
    pub new: Vec<Run>,
}

/// The steps that back every maximal run of `needed` granules by one handle, given the
/// `mapped` handles (sorted, disjoint, covering `needed`). Needed runs that share a handle are
/// one step (the shared handle goes as a whole). Steps come largest first, so that when the
/// first one fits in memory the rest do too (each step gives back what it takes); handles that
/// hold no needed granule go in a last step with nothing new. Runs already backed by exactly
/// one handle are left alone.
pub fn plan_consolidate(mapped: &[Run], needed: &[Run]) -> Vec<ConsolidateStep> {
    // Per step: the old handles (a range of `mapped`) and the needed runs they hold.
    let mut joined: Vec<(std::ops::Range<usize>, Vec<Run>)> = Vec::new();
    for &run in needed {
        let lo = mapped.partition_point(|m| m.end_granule() <= run.first_granule);
        let hi = mapped.partition_point(|m| m.first_granule < run.end_granule());
        match joined.last_mut() {
            // The previous run's last handle also holds this run's first granules.
            Some((handles, runs)) if handles.end > lo => {
                handles.end = hi;
                runs.push(run);
            }
            _ => joined.push((lo..hi, vec![run])),
        }
    }
    let mut used = vec![false; mapped.len()];
    let mut steps: Vec<ConsolidateStep> = Vec::new();
    for (handles, runs) in joined {
        used[handles.clone()].fill(true);
        let old = mapped[handles].to_vec();
        if old != runs {
            steps.push(ConsolidateStep { old, new: runs });
        }
    }
    steps.sort_by_key(|s| std::cmp::Reverse(s.new.iter().map(|r| r.num_granules).sum::<u64>()));
    let dead: Vec<Run> = mapped
        .iter()
        .zip(&used)
        .filter(|(_, &used)| !used)
        .map(|(&run, _)| run)
        .collect();
    if !dead.is_empty() {
        steps.push(ConsolidateStep {
            old: dead,
            new: Vec::new(),
        });
    }
    steps
}

/// The granules holding sorted, disjoint byte `ranges`, merged into sorted, disjoint runs.
/// `granularity` is positive and each range's `end()` fits (see `ByteRange::end`).
pub fn granules_of(ranges: &[ByteRange], granularity: u64) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for range in ranges.iter().filter(|r| r.num_bytes > 0) {
        let (first, end) = (
            range.offset / granularity,
            range.end().div_ceil(granularity),
        );
        match runs.last_mut() {
            Some(last) if first <= last.end_granule() => {
                last.num_granules = last.num_granules.max(end - last.first_granule);
            }
            _ => runs.push(Run::new(first, end - first)),
        }
    }
    runs
}

/// Why runs fail `check_runs`: the first bad run, by its index, and what is wrong with it.
/// Callers word it for what their runs are (a description's handles, a loan's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadRun {
    /// `runs[index]` is empty, or ends past granule `num_granules` (or past 2^64).
    Outside {
        /// The run's index.
        index: usize,
        /// The run.
        run: Run,
        /// The granules the runs must lie in.
        num_granules: u64,
    },
    /// `runs[index]` starts before the run before it ends: out of order or overlapping.
    Overlapping {
        /// The run's index.
        index: usize,
        /// The run.
        run: Run,
        /// Where the run before it ends.
        end_of_previous: u64,
    },
}

impl std::fmt::Display for BadRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            BadRun::Outside {
                run, num_granules, ..
            } => write!(f, "run {run:?} is empty or past granule {num_granules}"),
            BadRun::Overlapping {
                run,
                end_of_previous,
                ..
            } => write!(
                f,
                "runs out of order or overlapping: {run:?} starts before granule \
                 {end_of_previous}, where the run before it ends"
            ),
        }
    }
}

/// The message, for the invariant checks whose errors are strings (`?` converts).
impl From<BadRun> for String {
    fn from(bad: BadRun) -> String {
        bad.to_string()
    }
}

/// Checks that `runs` are sorted, disjoint, non-empty and inside `num_granules`.
pub fn check_runs(runs: &[Run], num_granules: u64) -> Result<(), BadRun> {
    // Bounds first, in 64 bits checked: a description's runs may be anything, and a wrapped
    // end would pass both tests below. After it, `end_granule` fits for every run.
    let outside = |r: &Run| {
        r.num_granules == 0 || r.checked_end_granule().is_none_or(|end| end > num_granules)
    };
    if let Some(index) = runs.iter().position(outside) {
        return Err(BadRun::Outside {
            index,
            run: runs[index],
            num_granules,
        });
    }
    for (index, pair) in runs.windows(2).enumerate() {
        if pair[0].end_granule() > pair[1].first_granule {
            return Err(BadRun::Overlapping {
                index: index + 1,
                run: pair[1],
                end_of_previous: pair[0].end_granule(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Plans growing every segment from `old` to `new` bytes given all the `mapped` runs, as
    /// `ExtensibleTensor::resize_per_segment` does (which passes only the overlapping ones).
    fn grow(
        geometry: &Geometry,
        mapped: &[Run],
        policy: HandlePolicy,
        old: &[u64],
        new: &[u64],
    ) -> GrowPlan {
        let new_ranges = geometry.new_ranges(old, new);
        let new_granules = granules_of(&new_ranges, geometry.granularity());
        plan_grow(new_ranges, &new_granules, mapped, policy)
    }

    const G: u64 = 4096;

    fn granule_set(runs: &[Run]) -> std::collections::BTreeSet<u64> {
        runs.iter()
            .flat_map(|r| r.first_granule..r.end_granule())
            .collect()
    }

    #[test]
    fn straddling_granule_is_needed_once() {
        // 3 granules, 2 segments of 1.5 granules: granule 1 holds the end of segment 0 and
        // the start of segment 1.
        let geometry = Geometry::equal(3 * G, 2, G).unwrap();
        assert_eq!(geometry.needed_runs(&[G / 2, G / 2]), vec![Run::new(0, 2)]);
        let full = geometry.needed_runs(&[3 * G / 2, 3 * G / 2]);
        assert_eq!(full, vec![Run::new(0, 3)]);
        let plan = grow(
            &geometry,
            &[Run::new(0, 2)],
            HandlePolicy::AlignedPowersOfTwo {
                max_handle_granules: 8,
            },
            &[G / 2, G / 2],
            &[3 * G / 2, 3 * G / 2],
        );
        assert_eq!(plan.new_handles, vec![Run::new(2, 1)]);
    }

    #[test]
    fn footprint_counts_shared_granules_once() {
        // Segments at 0 and 300 (granule 512): 100 bytes each lie in granule 0 alone.
        assert_eq!(footprint_bytes(&[0, 300], 100, 512).unwrap(), 512);
        assert_eq!(footprint_bytes(&[300, 0], 300, 512).unwrap(), 1024);
        assert_eq!(footprint_bytes(&[0, 300], 0, 512).unwrap(), 0);
        assert!(footprint_bytes(&[0], 1, 0).is_err());
        assert!(footprint_bytes(&[u64::MAX], 1, 512).is_err());
        let geometry = Geometry::equal(3 * G, 2, G).unwrap();
        let needed = geometry.needed_runs(&[G, G]);
        let mapped: u64 = needed.iter().map(|r| r.num_granules * G).sum();
        assert_eq!(
            footprint_bytes(geometry.segment_offsets(), G, G).unwrap(),
            mapped
        );
    }

    #[test]
    fn equal_segments_must_divide() {
        let err = Geometry::equal(10, 3, G).unwrap_err();
        assert!(err.to_string().contains("divisible"), "{err}");
    }

    #[test]
    fn aligned_powers_of_two_cut_at_their_alignment() {
        let mut out = Vec::new();
        HandlePolicy::AlignedPowersOfTwo {
            max_handle_granules: 1 << 20,
        }
        .cut(Run::new(3, 13), &mut out);
        assert_eq!(out, vec![Run::new(3, 1), Run::new(4, 4), Run::new(8, 8)]);
        out.clear();
        HandlePolicy::AlignedPowersOfTwo {
            max_handle_granules: 4,
        }
        .cut(Run::new(0, 11), &mut out);
        assert_eq!(
            out,
            vec![
                Run::new(0, 4),
                Run::new(4, 4),
                Run::new(8, 2),
                Run::new(10, 1)
            ]
        );
    }

    #[test]
    fn cap_aligned_cuts_only_at_cap_multiples() {
        let mut out = Vec::new();
        let policy = HandlePolicy::CapAligned {
            max_handle_granules: 8,
        };
        // From one granule past a segment start to past two cap boundaries: 3 handles, where
        // aligned powers of two take 1 + 2 + 4 + 8 + 2.
        policy.cut(Run::new(3, 16), &mut out);
        assert_eq!(out, vec![Run::new(3, 5), Run::new(8, 8), Run::new(16, 3)]);
        out.clear();
        policy.cut(Run::new(5, 1), &mut out);
        assert_eq!(out, vec![Run::new(5, 1)]);
        out.clear();
        HandlePolicy::WholeRuns.cut(Run::new(3, 1 << 40), &mut out);
        assert_eq!(out, vec![Run::new(3, 1 << 40)]);
    }

    /// The bound: growing 2 segments from one block to 64 GiB each.
    #[test]
    fn bulk_grow_handle_counts_are_logarithmic() {
        let g = 2 << 20;
        let per_segment = 64u64 << 30;
        let geometry = Geometry::equal(2 * per_segment, 2, g).unwrap();
        let block = 16 * 8 * 128 * 2; // a 16-token bf16 block of 8 heads of 128
        let initial = geometry.needed_runs(&[block, block]);
        let granules = per_segment / g;
        let log2 = u64::from(63 - granules.leading_zeros());
        let cap_granules = (1u64 << 30) / g;
        for (cap, bound) in [
            (u64::MAX, 2 * log2 + 2),
            (
                cap_granules,
                per_segment.div_ceil(1 << 30) + 2 * u64::from(cap_granules.ilog2()) + 2,
            ),
        ] {
            let policy = HandlePolicy::AlignedPowersOfTwo {
                max_handle_granules: cap,
            };
            let plan = grow(&geometry, &initial, policy, &[block; 2], &[per_segment; 2]);
            for segment in 0..2u64 {
                let (lo, hi) = (segment * granules, (segment + 1) * granules);
                let count = plan
                    .new_handles
                    .iter()
                    .filter(|r| r.first_granule >= lo && r.end_granule() <= hi)
                    .count();
                assert!(
                    count as u64 <= bound,
                    "segment {segment}: {count} handles > {bound}"
                );
            }
        }
    }

    #[test]
    fn planning_64_tib_allocates_per_handle_not_per_granule() {
        let geometry = Geometry::equal(64 << 40, 2, 2 << 20).unwrap();
        let policy = HandlePolicy::AlignedPowersOfTwo {
            max_handle_granules: 1 << 20,
        };
        let full = [32u64 << 40; 2];
        let plan = grow(&geometry, &[], policy, &[0, 0], &full);
        // One merged run of 32 Mi granules, cut at the 2 TiB cap.
        assert_eq!(plan.new_handles.len(), 32);
        assert!(plan.new_handles.iter().all(|r| r.num_granules == 1 << 20));
    }

    fn geometry_strategy() -> impl Strategy<Value = Geometry> {
        (prop::collection::vec(1u64..5 * G, 1..6), prop::bool::ANY).prop_map(|(caps, equal)| {
            if equal {
                Geometry::equal(caps[0] * caps.len() as u64, caps.len() as u64, G).unwrap()
            } else {
                Geometry::new(caps, G).unwrap()
            }
        })
    }

    #[test]
    fn footprint_past_64_bits_is_an_error_not_a_wrapped_value() {
        // 2^63 granules of 2 bytes: 2^64 bytes, which an unchecked multiply wraps to 0.
        let err = footprint_bytes(&[0], u64::MAX, 2).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("18446744073709551615"), "{err}");
        assert_eq!(footprint_bytes(&[0], u64::MAX, 1).unwrap(), u64::MAX);
        assert_eq!(footprint_bytes(&[0], 1 << 63, 1 << 63).unwrap(), 1 << 63);
    }

    #[test]
    fn runs_past_64_bits_are_refused_not_wrapped() {
        // first + num wraps to 1, inside a 4-granule reservation.
        let err = check_runs(&[Run::new(u64::MAX, 2)], 4).unwrap_err();
        assert!(err.to_string().contains("past granule 4"), "{err}");
        assert!(check_runs(&[Run::new(0, 1), Run::new(u64::MAX, 2)], 4).is_err());
        assert!(check_runs(&[Run::new(0, u64::MAX)], u64::MAX).is_ok());
        assert!(handle_granules(4096, 0).is_err());
    }

    /// Values at the edges of `u64`: near 0, near `u64::MAX`, near every power of two.
    fn edge() -> impl Strategy<Value = u64> {
        prop_oneof![
            0u64..4,
            (0u64..4).prop_map(|d| u64::MAX - d),
            (0u32..64, -2i64..=2).prop_map(|(k, d)| (1u64 << k).saturating_add_signed(d)),
            any::<u64>(),
        ]
    }

    /// Granularities up to 2^63.
    fn power_of_two() -> impl Strategy<Value = u64> {
        (0u32..64).prop_map(|k| 1u64 << k)
    }

    /// The granules holding `[offset, offset + len)` of each range, merged, computed in 128
    /// bits: the model the 64-bit code must match or refuse.
    fn wide_runs(ranges: &[(u64, u64)], g: u64) -> Vec<(u128, u128)> {
        let (g, mut runs) = (u128::from(g), Vec::<(u128, u128)>::new());
        let mut ranges: Vec<(u128, u128)> = ranges
            .iter()
            .filter(|r| r.1 > 0)
            .map(|&(o, n)| (u128::from(o), u128::from(o) + u128::from(n)))
            .collect();
        ranges.sort_unstable();
        for (start, end) in ranges {
            let (first, end) = (start / g, end.div_ceil(g));
            match runs.last_mut() {
                Some(last) if first <= last.1 => last.1 = last.1.max(end),
                _ => runs.push((first, end)),
            }
        }
        runs
    }

    fn is_invalid<T: std::fmt::Debug>(result: &Result<T>) -> bool {
        matches!(result, Err(Error::InvalidArgument(_)))
    }

    proptest! {
        #[test]
        fn needed_runs_match_a_per_granule_model(
            geometry in geometry_strategy(),
            fractions in prop::collection::vec(0.0f64..=1.0, 6),
        ) {
            let bytes: Vec<u64> = geometry.segment_capacities().iter().zip(&fractions)
                .map(|(&c, f)| (c as f64 * f) as u64).collect();
            let runs = geometry.needed_runs(&bytes);
            check_runs(&runs, geometry.num_granules()).unwrap();
            for pair in runs.windows(2) {
                prop_assert!(pair[0].end_granule() < pair[1].first_granule, "adjacent runs not merged");
            }
            let mut model = std::collections::BTreeSet::new();
            for (&offset, &b) in geometry.segment_offsets().iter().zip(&bytes) {
                for byte in (offset..offset + b).step_by(64) {
                    model.insert(byte / G);
                }
                if b > 0 { model.insert((offset + b - 1) / G); }
            }
            prop_assert_eq!(granule_set(&runs), model);
        }

        #[test]
        fn subtract_and_cut_tile_exactly_the_missing_granules(
            needed in prop::collection::vec((0u64..64, 1u64..16), 0..6),
            mapped in prop::collection::vec((0u64..64, 1u64..16), 0..6),
            cap in 1u64..20,
        ) {
            let normalise = |spans: Vec<(u64, u64)>| {
                let set: std::collections::BTreeSet<u64> =
                    spans.iter().flat_map(|&(s, n)| s..s + n).collect();
                let mut runs: Vec<Run> = Vec::new();
                for g in set {
                    match runs.last_mut() {
                        Some(last) if last.end_granule() == g => last.num_granules += 1,
                        _ => runs.push(Run::new(g, 1)),
                    }
                }
                runs
            };
            let (needed, mapped) = (normalise(needed), normalise(mapped));
            let missing = subtract(&needed, &mapped);
            check_runs(&missing, 1 << 20).unwrap();
            let expect: std::collections::BTreeSet<u64> =
                granule_set(&needed).difference(&granule_set(&mapped)).copied().collect();
            prop_assert_eq!(granule_set(&missing), expect.clone());
            let mut handles = Vec::new();
            for run in &missing {
                HandlePolicy::AlignedPowersOfTwo { max_handle_granules: cap }.cut(*run, &mut handles);
            }
            check_runs(&handles, 1 << 20).unwrap();
            prop_assert_eq!(granule_set(&handles), expect);
            for h in &handles {
                prop_assert!(h.num_granules.is_power_of_two() && h.num_granules <= cap);
                prop_assert_eq!(h.first_granule % h.num_granules, 0);
            }
        }

        #[test]
        fn intersect_matches_a_per_byte_model(
            ranges in prop::collection::vec((0u64..40, 1u64..10), 0..5),
            runs in prop::collection::vec((0u64..10, 1u64..3), 0..4),
        ) {
            let g = 4;
            let mut ranges: Vec<ByteRange> = ranges.into_iter().scan(0, |cursor, (gap, n)| {
                let r = ByteRange { offset: *cursor + gap, num_bytes: n };
                *cursor = r.end();
                Some(r)
            }).collect();
            ranges.dedup();
            let runs: Vec<Run> = runs.into_iter().scan(0, |cursor, (gap, n)| {
                let r = Run::new(*cursor + gap, n);
                *cursor = r.end_granule() + 1;
                Some(r)
            }).collect();
            let got: Vec<u64> = intersect(&ranges, &runs, g).iter()
                .flat_map(|r| r.offset..r.end()).collect();
            let granules = granule_set(&runs);
            let expect: Vec<u64> = ranges.iter().flat_map(|r| r.offset..r.end())
                .filter(|b| granules.contains(&(b / g))).collect();
            prop_assert_eq!(got, expect);
        }

        /// Caller-provided sizes at the edges of `u64`: a correct footprint or InvalidArgument,
        /// never a panic or a wrapped value.
        #[test]
        fn footprint_at_the_edges_of_u64_is_exact_or_refused(
            offsets in prop::collection::vec(edge(), 1..64),
            prefix in edge(),
            granularity in prop_oneof![edge(), power_of_two()],
        ) {
            let got = footprint_bytes(&offsets, prefix, granularity);
            let fits = offsets.iter().all(|&o| o.checked_add(prefix).is_some());
            if granularity == 0 || !fits {
                prop_assert!(is_invalid(&got), "{:?}", got);
            } else {
                let ranges: Vec<(u64, u64)> = offsets.iter().map(|&o| (o, prefix)).collect();
                let granules: u128 = wide_runs(&ranges, granularity).iter().map(|r| r.1 - r.0).sum();
                match u64::try_from(granules * u128::from(granularity)) {
                    Ok(bytes) => prop_assert_eq!(got.unwrap(), bytes),
                    Err(_) => prop_assert!(is_invalid(&got), "{:?}", got),
                }
            }
        }

        /// A geometry of many segments and capacities at the edges of `u64`, granules up to
        /// 2^63: made exactly or refused; then every plan over it (needed runs, their bytes, new
        /// ranges, their intersection with the granules, every cutting policy) is exact.
        #[test]
        fn plans_at_the_edges_of_u64_are_exact_or_refused(
            capacities in prop::collection::vec(edge(), 1..300),
            split in any::<bool>(),
            granularity in power_of_two(),
            picks in prop::collection::vec((0u8..4, any::<u64>()), 300),
            cap in edge(),
        ) {
            // Split, the capacities sum to at most u64::MAX: many segments that fit, some
            // only until rounded up to whole granules.
            let n = capacities.len() as u64;
            let capacities: Vec<u64> = match split {
                true => capacities.iter().map(|&c| (c / n).max(1)).collect(),
                false => capacities,
            };
            let geometry = Geometry::new(capacities.clone(), granularity);
            let total: u128 = capacities.iter().map(|&c| u128::from(c)).sum();
            let reserved = total.next_multiple_of(u128::from(granularity));
            if capacities.contains(&0) || reserved > u128::from(u64::MAX) {
                prop_assert!(is_invalid(&geometry), "{:?}", geometry.map(|g| g.reserved_bytes()));
                return Ok(());
            }
            let geometry = geometry.unwrap();
            prop_assert_eq!(u128::from(geometry.reserved_bytes()), reserved);
            prop_assert_eq!(u128::from(geometry.capacity_bytes()), total);
            let bytes: Vec<u64> = geometry.segment_capacities().iter().zip(&picks)
                .map(|(&c, &(kind, r))| match kind { 0 => 0, 1 => c, 2 => c - 1, _ => c.checked_add(1).map_or(r, |m| r % m) })
                .collect();
            geometry.check_request(&bytes).unwrap();
            let needed = geometry.needed_runs(&bytes);
            check_runs(&needed, geometry.num_granules()).unwrap();
            let ranges: Vec<(u64, u64)> = geometry.segment_offsets().iter().copied().zip(bytes.iter().copied()).collect();
            let model = wide_runs(&ranges, granularity);
            let got: Vec<(u128, u128)> = needed.iter()
                .map(|r| (u128::from(r.first_granule), u128::from(r.end_granule()))).collect();
            prop_assert_eq!(&got, &model);
            for run in &needed {
                let span = geometry.run_bytes(*run);
                prop_assert_eq!(u128::from(span.offset), u128::from(run.first_granule) * u128::from(granularity));
                prop_assert_eq!(u128::from(span.end()), u128::from(run.end_granule()) * u128::from(granularity));
            }
            let new_ranges = geometry.new_ranges(&vec![0; bytes.len()], &bytes);
            prop_assert!(new_ranges.iter().all(|r| r.end() <= geometry.reserved_bytes()));
            prop_assert_eq!(granules_of(&new_ranges, granularity), needed.clone());
            // Every new byte lies in a needed granule; intersecting gives the ranges back,
            // split only where a granule boundary falls between two runs (never here).
            let nonempty: Vec<ByteRange> = new_ranges.iter().copied().filter(|r| r.num_bytes > 0).collect();
            prop_assert_eq!(intersect(&new_ranges, &needed, granularity), nonempty);
            let longest = needed.iter().map(|r| r.num_granules).max().unwrap_or(1);
            // At least longest / 1024 granules per handle, so cutting stays fast.
            let cap = cap.max(longest / 1024 + 1);
            for policy in [
                HandlePolicy::AlignedPowersOfTwo { max_handle_granules: cap },
                HandlePolicy::PerRun { max_handle_granules: cap },
                HandlePolicy::CapAligned { max_handle_granules: cap },
                HandlePolicy::WholeRuns,
            ] {
                let mut handles = Vec::new();
                for &run in &needed {
                    policy.cut(run, &mut handles);
                }
                check_runs(&handles, geometry.num_granules()).unwrap();
                prop_assert_eq!(granules_of(
                    &handles.iter().map(|&h| geometry.run_bytes(h)).collect::<Vec<_>>(),
                    granularity,
                ), needed.clone());
            }
        }

        /// `Geometry::equal` at the edges of `u64`: made exactly or refused, never a panic.
        #[test]
        fn equal_segments_at_the_edges_of_u64_are_exact_or_refused(
            max_bytes in edge(),
            num_segments in prop_oneof![0u64..300, edge()],
            granularity in prop_oneof![edge(), power_of_two()],
        ) {
            match Geometry::equal(max_bytes, num_segments, granularity) {
                Ok(geometry) => {
                    prop_assert_eq!(geometry.num_segments() as u64, num_segments);
                    prop_assert_eq!(geometry.capacity_bytes(), max_bytes);
                    prop_assert_eq!(geometry.reserved_bytes() % granularity, 0);
                    prop_assert!(geometry.reserved_bytes() >= max_bytes);
                }
                Err(err) => prop_assert!(matches!(err, Error::InvalidArgument(_)), "{}", err),
            }
        }

        /// Runs at the edges of `u64`: accepted exactly when they lie, sorted and disjoint,
        /// inside the granules, computed in 128 bits.
        #[test]
        fn check_runs_at_the_edges_of_u64_matches_a_wide_model(
            runs in prop::collection::vec((edge(), edge()), 0..4),
            num_granules in edge(),
        ) {
            let runs: Vec<Run> = runs.into_iter().map(|(s, n)| Run::new(s, n)).collect();
            let wide: Vec<(u128, u128)> = runs.iter()
                .map(|r| (u128::from(r.first_granule), u128::from(r.first_granule) + u128::from(r.num_granules)))
                .collect();
            let ok = wide.iter().all(|&(s, e)| e > s && e <= u128::from(num_granules))
                && wide.windows(2).all(|w| w[0].1 <= w[1].0);
            prop_assert_eq!(check_runs(&runs, num_granules).is_ok(), ok);
            if ok {
                let mut cut = Vec::new();
                for &run in &runs {
                    HandlePolicy::CapAligned { max_handle_granules: 1 << 62 }.cut(run, &mut cut);
                }
                check_runs(&cut, num_granules).unwrap();
            }
        }

        /// Random handles (adjacent or not) and a random subset of their granules as needed:
        /// shrink and consolidate plans against a per-granule model.
        #[test]
        fn shrink_and_consolidate_plans_match_a_per_granule_model(
            handles in prop::collection::vec((0u64..3, 1u64..5), 1..8),
            keep in prop::collection::vec(any::<bool>(), 40),
        ) {
            let mapped: Vec<Run> = handles.into_iter().scan(0, |cursor, (gap, n)| {
                let r = Run::new(*cursor + gap, n);
                *cursor = r.end_granule();
                Some(r)
            }).collect();
            let needed_set: Vec<u64> = granule_set(&mapped).into_iter()
                .filter(|&g| keep[g as usize % keep.len()]).collect();
            let needed: Vec<Run> = needed_set.iter().fold(Vec::<Run>::new(), |mut runs, &g| {
                match runs.last_mut() {
                    Some(last) if last.end_granule() == g => last.num_granules += 1,
                    _ => runs.push(Run::new(g, 1)),
                }
                runs
            });
            let is_needed = |g: u64| needed_set.contains(&g);
            let plan = plan_shrink(&mapped, &needed);
            for handle in &mapped {
                let live: Vec<u64> = (handle.first_granule..handle.end_granule())
                    .filter(|&g| is_needed(g)).collect();
                let straddling = plan.straddling.iter().find(|(h, _)| h == handle);
                prop_assert_eq!(plan.dead.contains(handle), live.is_empty());
                let whole = live.len() as u64 == handle.num_granules;
                prop_assert_eq!(straddling.is_some(), !live.is_empty() && !whole);
                if let Some((_, runs)) = straddling {
                    prop_assert_eq!(granule_set(runs).into_iter().collect::<Vec<_>>(), live);
                }
            }
            // Consolidating: every needed granule ends in exactly one new handle, which is a
            // maximal needed run; every old handle goes at most once; nothing else changes.
            let steps = plan_consolidate(&mapped, &needed);
            let new: Vec<Run> = steps.iter().flat_map(|s| s.new.clone()).collect();
            let old: Vec<Run> = steps.iter().flat_map(|s| s.old.clone()).collect();
            let mut kept: Vec<Run> = mapped.iter().filter(|h| !old.contains(h)).copied().collect();
            prop_assert_eq!(old.len(), granule_set(&old).len().min(old.len()));
            let mut after = new.clone();
            after.append(&mut kept);
            after.sort();
            prop_assert_eq!(after, needed.clone());
            for step in &steps {
                let old_granules = granule_set(&step.old);
                prop_assert!(step.new.iter().all(|r| (r.first_granule..r.end_granule())
                    .all(|g| old_granules.contains(&g))));
            }
            let sizes: Vec<u64> = steps.iter().filter(|s| !s.new.is_empty())
                .map(|s| s.new.iter().map(|r| r.num_granules).sum()).collect();
            prop_assert!(sizes.windows(2).all(|w| w[0] >= w[1]), "largest first: {:?}", sizes);
        }
    }
}
