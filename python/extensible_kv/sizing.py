"""Sizing the KV cache from measured memory (docs/design.md §5, steps 1 and 3).

After warm-up and graph capture, what is still free can become KV blocks, less a safety
margin for transient allocations that the warm-up did not hit at their peak (vLLM #56492:
`max(1 GiB, 0.75 * transient peak)`). `non_kv_used = free_at_init - free_now - kv_committed`
is what everything but the KV cache took since the reservation (weights, activations, graph
pools), reported so an operator sees where memory went.

Bytes become blocks granule-aware (`extensible_kv.footprint`, whose `BufferFootprint` and
`CacheFootprint` this module re-exports): a buffer commits whole granules, so committing `n`
blocks costs the distinct granules that the first `n * segment_block_bytes` bytes of each
segment touch — rounded up per segment, a granule that two segments share counted once, the
granules already mapped not counted again. `blocks_within` finds the most blocks whose extra
footprint fits a budget by binary search over an exact footprint (monotone in `n`).
`capacity_blocks_for` rounds a first estimate so that every segment ends on a granule
boundary, where no granule is shared and no block is ever cut by one.

Everything here is integer arithmetic except the three small probes at the bottom.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from extensible_kv import _native
from extensible_kv.footprint import BufferFootprint, CacheFootprint
from extensible_kv.kv_cache import ExtensibleKVCache, KVCacheTensorSpec, segment_layout
from extensible_kv.layouts import round_up

if TYPE_CHECKING:
    import torch

__all__ = [
    "MIN_MARGIN_BYTES",
    "BufferFootprint",
    "CacheFootprint",
    "MemoryBudget",
    "blocks_within",
    "capacity_blocks_for",
    "cuda_transient_peak_bytes",
    "default_margin_bytes",
    "device_granularity",
    "host_available_bytes",
    "host_free_bytes",
    "measure_budget",
]

GIB = 1 << 30
MIN_MARGIN_BYTES = GIB


def default_margin_bytes(transient_peak_bytes: int) -> int:
    """`max(1 GiB, 0.75 * transient_peak_bytes)`, rounded up (vLLM #56492)."""
    return max(MIN_MARGIN_BYTES, -(-3 * max(transient_peak_bytes, 0) // 4))


@dataclass(frozen=True)
class MemoryBudget:
    """One post-warm-up measurement and the KV budget it leaves.

    `budget_bytes` is what the KV cache may still commit: `free_now - margin`, never negative.
    `free_at_init_bytes` is `None` where nothing was measured before the reservation.
    """

    free_now_bytes: int
    margin_bytes: int
    kv_committed_bytes: int = 0
    transient_peak_bytes: int = 0
    free_at_init_bytes: int | None = None

    @property
    def budget_bytes(self) -> int:
        return max(0, self.free_now_bytes - self.margin_bytes)

    @property
    def non_kv_used_bytes(self) -> int | None:
        """`free_at_init - free_now - kv_committed`: what the rest of the process took."""
        if self.free_at_init_bytes is None:
            return None
        return self.free_at_init_bytes - self.free_now_bytes - self.kv_committed_bytes


def measure_budget(
    free_now_bytes: int,
    *,
    free_at_init_bytes: int | None = None,
    kv_committed_bytes: int = 0,
    transient_peak_bytes: int = 0,
    margin_bytes: int | None = None,
) -> MemoryBudget:
    """The budget for `free_now_bytes` free, with the default margin unless one is given."""
    if margin_bytes is None:
        margin_bytes = default_margin_bytes(transient_peak_bytes)
    if margin_bytes < 0:
        raise ValueError(f"margin_bytes {margin_bytes} must not be negative")
    return MemoryBudget(
        free_now_bytes, margin_bytes, kv_committed_bytes, transient_peak_bytes, free_at_init_bytes
    )


def blocks_within(budget_bytes: int, cache: ExtensibleKVCache | CacheFootprint) -> int:
    """The most blocks, from `committed_blocks` up to the capacity, whose extra physical
    footprint fits `budget_bytes` (never fewer than are committed: a commit never shrinks)."""
    footprint = cache if isinstance(cache, CacheFootprint) else CacheFootprint.of(cache)
    fits, too_many = footprint.committed_blocks, footprint.capacity_blocks + 1
    # The footprint only grows with n: bisect for the last n that fits.
    while too_many - fits > 1:
        mid = (fits + too_many) // 2
        if footprint.extra_bytes(mid) <= budget_bytes:
            fits = mid
        else:
            too_many = mid
    return fits


def capacity_blocks_for(
    upper_bound_bytes: int, spec: Sequence[KVCacheTensorSpec], granularity: int
) -> int:
    """A capacity for `spec` from a first estimate of KV memory (an upper bound): as many
    blocks as fit in it, rounded up to the smallest count at which every segment of every
    buffer ends on a granule boundary (at least one such step). Address space is cheap."""
    if granularity <= 0:
        raise ValueError(f"granularity {granularity} must be positive")
    layout = segment_layout(spec)
    block_bytes = sum(segments * segment_block_bytes for segments, segment_block_bytes in layout)
    step = math.lcm(*(granularity // math.gcd(granularity, b) for _, b in layout))
    estimate = max(1, upper_bound_bytes // block_bytes)
    return round_up(estimate, step)


# ---------------------------------------------------------------------------------------------
# probes


def device_granularity(device: str | torch.device, granularity: int | None = None) -> int:
    """The granule a buffer on `device` gets (`granularity` passes through, as it would to
    `ExtensibleTensor`): read from a one-byte reservation, which maps nothing."""
    from extensible_kv.tensor import ExtensibleTensor

    with ExtensibleTensor(1, 1, device, granularity=granularity) as probe:
        return probe.granularity


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """`MemAvailable` from `/proc/meminfo`, in bytes: the host's stand-in for free memory, as
    the host backend reads it (`DriverError` when the file is unreadable or lacks it)."""
    return _native.host_mem_info(meminfo)[0]


def host_free_bytes() -> int:
    """The bytes a host commit can take now: `MemAvailable`, or the room under the memory
    cgroup's limit (a container's) where that is less. The host backend refuses a commit of
    more (`OutOfMemoryError`), so a budget from it is one the backend accepts."""
    return _native.host_free_bytes()


def cuda_transient_peak_bytes(device: str | torch.device) -> int:
    """What the warm-up had reserved at its peak beyond what torch still reserves: the memory
    it needed and has given back, which the same work needs free again. Reset torch's peak
    statistics before the warm-up, and call this after `torch.cuda.empty_cache()`.

    Reserved, not allocated: a CUDA graph's private pool keeps its intermediates' memory
    reserved for the graph's lifetime, so it is already out of free memory. Counted from
    `max_memory_allocated - memory_allocated` it was counted twice: on the H200, an 8B Llama's
    transformers warm-up showed 14.2 GiB "transient" that was all graph pool (reserved peak =
    reserved after), and its 64-prompt serving then grew torch's reservation by 4 MiB."""
    import torch

    return max(0, torch.cuda.max_memory_reserved(device) - torch.cuda.memory_reserved(device))
