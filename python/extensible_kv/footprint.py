"""What a cache's blocks cost in physical memory: its footprint, blocks → whole granules
(docs/design.md §5). A leaf of the package: the cache tier (`kv_cache`, which describes its
own footprint) and sizing (`sizing`, which sizes caches by it) both read it, and it reads
neither.

A buffer commits whole granules, so committing `n` blocks costs the distinct granules that the
first `n * segment_block_bytes` bytes of each segment touch — rounded up per segment, a
granule that two segments share counted once (the planner's own rounding,
`plan::footprint_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from extensible_kv import _native

__all__ = ["BufferFootprint", "CacheFootprint", "FootprintSource"]


@dataclass(frozen=True)
class BufferFootprint:
    """One buffer as its reservation sees it: where each segment starts (bytes from the
    granule-aligned base), the bytes a block adds to every segment, the granule size."""

    segment_offsets: tuple[int, ...]
    segment_block_bytes: int
    granularity: int

    def footprint_bytes(self, num_blocks: int) -> int:
        """Physical bytes with `num_blocks` blocks committed: the distinct granules touched by
        the first `num_blocks * segment_block_bytes` bytes of every segment (the planner's own
        rounding, `plan::footprint_bytes`)."""
        prefix_bytes = num_blocks * self.segment_block_bytes
        if prefix_bytes <= 0:
            return 0
        return _native.footprint_bytes(self.segment_offsets, prefix_bytes, self.granularity)


class _Buffer(Protocol):
    @property
    def segment_offsets(self) -> Sequence[int]: ...
    @property
    def granularity(self) -> int: ...


class FootprintSource(Protocol):
    """What `CacheFootprint.of` reads of a cache (an `ExtensibleKVCache` is one)."""

    @property
    def legacy(self) -> bool: ...
    @property
    def buffers(self) -> Sequence[_Buffer]: ...
    @property
    def segment_block_bytes(self) -> Sequence[int]: ...
    @property
    def capacity_blocks(self) -> int: ...
    @property
    def committed_blocks(self) -> int: ...


@dataclass(frozen=True)
class CacheFootprint:
    """Every buffer of a cache, its capacity and its committed block count: all that sizing
    reads. A legacy cache has no buffers here: it committed everything up front, so no block
    costs extra bytes. `leading_blocks` sit below the cache's first block in every buffer,
    always committed and never counted in its blocks (transformers' trash sectors)."""

    buffers: tuple[BufferFootprint, ...]
    capacity_blocks: int
    committed_blocks: int
    leading_blocks: int = 0

    @classmethod
    def of(cls, cache: FootprintSource) -> CacheFootprint:
        buffers: tuple[BufferFootprint, ...] = ()
        if not cache.legacy:
            pairs = zip(cache.buffers, cache.segment_block_bytes, strict=True)
            buffers = tuple(
                BufferFootprint(tuple(t.segment_offsets), block_bytes, t.granularity)
                for t, block_bytes in pairs
            )
        return cls(buffers, cache.capacity_blocks, cache.committed_blocks)

    def footprint_bytes(self, num_blocks: int) -> int:
        """Physical bytes with `num_blocks` of the cache's blocks committed (and the leading
        ones)."""
        return sum(b.footprint_bytes(self.leading_blocks + num_blocks) for b in self.buffers)

    def extra_bytes(self, num_blocks: int) -> int:
        """Bytes to commit to go from `committed_blocks` to `num_blocks` (0 below it)."""
        if num_blocks <= self.committed_blocks:
            return 0
        return self.footprint_bytes(num_blocks) - self.footprint_bytes(self.committed_blocks)
