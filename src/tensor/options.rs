//! What a tensor is built with (`Options`, `HandleSizing`, `Segments`) and what each resize
//! and shrink takes (`PerSegment` sizes, `GrowOptions`, `ShrinkOptions`).

use std::borrow::Cow;

use crate::driver::{ExportTypes, Stream};
use crate::error::{Error, Result};
use crate::plan::{self, HandlePolicy};

/// The default cap on a handle's size: large enough that a bulk commit runs near memset speed,
/// small enough to avoid the outliers of giant handles (docs/design.md §2).
pub const DEFAULT_MAX_HANDLE_BYTES: u64 = 1 << 30;

/// Construction options; `Default` gives the driver's granularity and cap-aligned handles of at
/// most `DEFAULT_MAX_HANDLE_BYTES`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// The mapping granularity: a power-of-two multiple of the driver's. Default: the driver's.
    pub granularity: Option<u64>,
    /// How grows cut runs of missing granules into physical handles.
    pub handle_sizing: HandleSizing,
    /// How every physical allocation may be exported to other processes (`share`). POSIX fd
    /// must be supported by the device, and so must fabric asked alone; fabric asked with
    /// POSIX fd is dropped where it is not supported (the memory is shared through fds).
    pub export_types: ExportTypes,
}

/// How grows cut each run of missing granules into physical handles: the one handle-sizing
/// knob. A `max_bytes` given (`Some`) is taken as it is: it must be a positive multiple of the
/// granularity. `None` is the default cap, `DEFAULT_MAX_HANDLE_BYTES`, raised to the
/// granularity where that is larger; only the default rises. Maps onto `plan::HandlePolicy` of
/// the same variant name, in granules.
///
/// Each handle's create and set-access calls cost 40-60 us of host time whatever its size
/// (docs/benchmarks.md), so fewer handles make grows cheaper; a cap keeps giant handles'
/// outliers away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandleSizing {
    /// Cut at the multiples of `max_bytes` in the reservation, nowhere else (the default). On
    /// vLLM 0.34's layouts (a segment per layer, each grown from its first block, so every run
    /// starts one granule past a boundary) aligned powers of two cost 3x the handles.
    CapAligned {
        /// The largest handle, in bytes; `None`: the default cap (see the enum).
        max_bytes: Option<u64>,
    },
    /// Aligned powers of two of at most `max_bytes`: O(log n) handles for a bulk grow.
    AlignedPowersOfTwo {
        /// The largest handle, in bytes; `None`: the default cap (see the enum).
        max_bytes: Option<u64>,
    },
    /// One handle per run from its start, in pieces of `max_bytes`: SGLang's arena does this
    /// (its owner uses 8 GiB); a granule-sized cap is what per-granule peers do.
    PerRun {
        /// The largest handle, in bytes; `None`: the default cap (see the enum).
        max_bytes: Option<u64>,
    },
    /// One handle per run, however long.
    WholeRuns,
}

impl Default for HandleSizing {
    fn default() -> HandleSizing {
        HandleSizing::CapAligned { max_bytes: None }
    }
}

impl HandleSizing {
    /// The plan's policy for granules of `granularity`; an error names `max_bytes` when a cap
    /// given is not a positive multiple of it.
    pub fn policy(self, granularity: u64) -> Result<HandlePolicy> {
        let cap = |max_bytes: Option<u64>| {
            let max_bytes = max_bytes.unwrap_or_else(|| DEFAULT_MAX_HANDLE_BYTES.max(granularity));
            plan::handle_granules(max_bytes, granularity)
        };
        Ok(match self {
            HandleSizing::CapAligned { max_bytes } => HandlePolicy::CapAligned {
                max_handle_granules: cap(max_bytes)?,
            },
            HandleSizing::AlignedPowersOfTwo { max_bytes } => HandlePolicy::AlignedPowersOfTwo {
                max_handle_granules: cap(max_bytes)?,
            },
            HandleSizing::PerRun { max_bytes } => HandlePolicy::PerRun {
                max_handle_granules: cap(max_bytes)?,
            },
            HandleSizing::WholeRuns => HandlePolicy::WholeRuns,
        })
    }
}

/// Sizes for a per-segment call, as Python's `*_per_segment_` take them: one size for every
/// segment (a `u64`), or one per segment (a slice, an array or a `Vec`).
pub trait PerSegment {
    /// One size per segment of a tensor of `num_segments`. (A count other than
    /// `num_segments` is the callee's to refuse.)
    fn per_segment(&self, num_segments: usize) -> Cow<'_, [u64]>;
}

impl PerSegment for u64 {
    fn per_segment(&self, num_segments: usize) -> Cow<'_, [u64]> {
        Cow::Owned(vec![*self; num_segments])
    }
}

impl PerSegment for &[u64] {
    fn per_segment(&self, _: usize) -> Cow<'_, [u64]> {
        Cow::Borrowed(self)
    }
}

impl PerSegment for &Vec<u64> {
    fn per_segment(&self, _: usize) -> Cow<'_, [u64]> {
        Cow::Borrowed(self)
    }
}

impl<const N: usize> PerSegment for [u64; N] {
    fn per_segment(&self, _: usize) -> Cow<'_, [u64]> {
        Cow::Borrowed(self)
    }
}

impl<const N: usize> PerSegment for &[u64; N] {
    fn per_segment(&self, _: usize) -> Cow<'_, [u64]> {
        Cow::Borrowed(*self)
    }
}

/// How a tensor's capacity is cut into segments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Segments {
    /// `num_segments` equal segments of `max_bytes / num_segments` bytes.
    Equal {
        /// The total capacity in bytes.
        max_bytes: u64,
        /// How many segments share it.
        num_segments: u64,
    },
    /// Segments of these capacities, back to back.
    Capacities(Vec<u64>),
}

impl Segments {
    /// What a caller means who states the total and, optionally, the count and the capacities:
    /// without capacities, equal segments (one by default); with them, those, which must sum
    /// to `max_bytes` and, if a count is given too, be that many.
    pub fn stated(
        max_bytes: u64,
        num_segments: Option<u64>,
        capacities: Option<Vec<u64>>,
    ) -> Result<Segments> {
        let Some(capacities) = capacities else {
            return Ok(Segments::Equal {
                max_bytes,
                num_segments: num_segments.unwrap_or(1),
            });
        };
        let total: u128 = capacities.iter().map(|&c| u128::from(c)).sum();
        if total != u128::from(max_bytes) {
            return Err(Error::invalid(format!(
                "segment_capacities sum to {total} bytes, but max_bytes is {max_bytes}"
            )));
        }
        match num_segments {
            Some(n) if n != capacities.len() as u64 => Err(Error::invalid(format!(
                "num_segments is {n} but segment_capacities has {} entries",
                capacities.len()
            ))),
            _ => Ok(Segments::Capacities(capacities)),
        }
    }
}

/// How one grow runs; `Default` maps with the tensor's policy and zeroes nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GrowOptions {
    /// Zero the new logical bytes of every segment.
    pub zero_new: bool,
    /// The stream the zeroing is ordered on.
    pub stream: Stream,
    /// Back each run of missing granules by one handle, whatever the policy: after a
    /// `release_physical`, one such grow backs every granule-aligned segment by a single
    /// allocation, which RDMA registration of a segment needs (UCX cannot span handles).
    pub one_handle_per_run: bool,
}

/// How one shrink runs; `Default` keeps straddling handles whole.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShrinkOptions {
    /// Replace each handle that straddles the new frontier by handles of just the granules
    /// still needed, copying their bytes, so that no slack stays mapped. Otherwise such a
    /// handle stays whole and its slack counts in `physical_bytes`.
    pub exact: bool,
    /// The stream the copies are ordered on, and whose work queued so far the released
    /// memory waits for (an event: the call never waits for the device).
    pub stream: Stream,
}

impl GrowOptions {
    /// Zero the new bytes on the backend's default stream.
    pub fn zeroed() -> GrowOptions {
        GrowOptions {
            zero_new: true,
            ..GrowOptions::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn only_the_default_cap_rises_to_a_larger_granularity() {
        let granularity = 2 * GIB;
        assert_eq!(
            HandleSizing::default().policy(granularity).unwrap(),
            HandlePolicy::CapAligned {
                max_handle_granules: 1
            }
        );
        let explicit = |max_bytes| {
            [
                HandleSizing::CapAligned { max_bytes },
                HandleSizing::AlignedPowersOfTwo { max_bytes },
                HandleSizing::PerRun { max_bytes },
            ]
        };
        for max_bytes in [GIB / 2, GIB, 3 * GIB] {
            for sizing in explicit(Some(max_bytes)) {
                let err = sizing.policy(granularity).unwrap_err();
                assert!(
                    matches!(err, Error::InvalidArgument(_)),
                    "{sizing:?}: {err}"
                );
                assert!(err.to_string().contains(&max_bytes.to_string()), "{err}");
            }
        }
        for sizing in explicit(Some(4 * GIB)) {
            assert!(sizing.policy(granularity).is_ok(), "{sizing:?}");
        }
        assert_eq!(
            HandleSizing::PerRun { max_bytes: None }
                .policy(4096)
                .unwrap(),
            HandlePolicy::PerRun {
                max_handle_granules: GIB / 4096
            }
        );
    }
}
