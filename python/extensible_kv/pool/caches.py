"""What a pool member drives: a cache that lends and borrows whole handles (`PoolCache`), or
one that also moves its live blocks down (`MovingCache`), and what the member reads of it.

Any two caches of one device and granularity lend to each other, whatever their models: a
loan is memory, and the borrower deals the lender's whole handles to its own segments
(`PoolCache.borrow`, which returns the blocks it gained). A lender cuts where a handle starts
in every segment of every buffer (`lend_points`), and asks what a cut's handles give the
borrower in the borrower's own shape (`gains`: `extensible_kv.shape.blocks_from`'s dealing,
capped by the borrower's room), so that it lends nothing the borrower cannot use.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Protocol

from extensible_kv.flow import ExtendableCache
from extensible_kv.ipc import Loan
from extensible_kv.shape import CacheShape, deal

if TYPE_CHECKING:
    from extensible_kv.tensor import ExtensibleTensor

__all__ = [
    "MovingCache",
    "PoolCache",
    "borrowed_bytes",
    "device_free_bytes",
    "gains",
    "lend_points",
    "lent_bytes",
]


class PoolCache(ExtendableCache, Protocol):
    """What `PoolMember` drives: a cache the flow drives (`ExtendableCache`) whose buffers are
    each an `ExtensibleTensor`, of the shape `shape()` says (per buffer, its segments and
    their block bytes; `leading_blocks` blocks below block 0 in every segment: transformers'
    trash sectors, none in an `ExtensibleKVCache`). It also shrinks, lends, borrows (loans of
    any shape of its device and granularity), gives back and reclaims whole blocks as
    `ExtensibleKVCache` does, which is one; `extensible_kv.transformers` adapts
    transformers' cache to it."""

    @property
    def buffers(self) -> tuple[ExtensibleTensor, ...]: ...
    def shape(self) -> CacheShape: ...
    def lend_sizes(self, num_blocks: int) -> list[int]: ...
    def shrink_to(self, num_blocks: int, *, exact: bool = False) -> None: ...
    def wait_released(self, timeout: float | None = None) -> bool: ...
    def lend(self, num_blocks: int, *, stream: int | None = None) -> tuple[Loan, ...]: ...
    def borrow(
        self, loans: Sequence[Loan], *, zero: bool = True, stream: int | None = None
    ) -> int: ...
    def give_back(self, loans: Sequence[Loan], *, stream: int | None = None) -> None: ...
    def reclaim(
        self,
        loans: Sequence[Loan],
        *,
        zero: bool = True,
        timeout: float | None = None,
        stream: int | None = None,
    ) -> None: ...


class MovingCache(PoolCache, Protocol):
    """A `PoolCache` that moves live blocks down, for a member with `move=True`: it has the
    `free_blocks` and `move_below` hooks (`extensible_kv.pool.hooks`, where they are declared
    and recognised). `free_blocks()` counts its committed blocks no request holds, wherever
    they lie, and `move_below(num_blocks)` copies every live block at or past `num_blocks`
    into a free one below it and renames it in the engine's books (a `RuntimeError` when too
    few are free there, and nothing moved), between the engine's steps. transformers' pooled
    cache is one: its block tables are ours to rename. An `ExtensibleKVCache`'s are its
    engine's."""

    def free_blocks(self) -> int: ...
    def move_below(self, num_blocks: int) -> None: ...


def lent_bytes(cache: PoolCache) -> int:
    return sum(t.lent_bytes for t in cache.buffers)


def borrowed_bytes(cache: PoolCache) -> int:
    return sum(t.borrowed_bytes for t in cache.buffers)


def lend_points(cache: PoolCache) -> set[int]:
    """The block counts a lend may keep: those where every segment of every buffer has a
    handle starting exactly at the cut, since a loan is whole handles (a handle that straddles
    the cut stays with the lender) and must be whole blocks of every buffer. Block 0 lies
    `leading_blocks` blocks into each segment."""
    points: set[int] | None = None
    shape = cache.shape()
    for tensor, buffer in zip(cache.buffers, shape.buffers, strict=True):
        g, block_bytes = tensor.granularity, buffer.segment_block_bytes
        starts = {first * g for first, _ in tensor.handle_runs()}
        firsts = [offset + shape.leading_blocks * block_bytes for offset in tensor.segment_offsets]
        if points is None:
            points = {
                (start - firsts[0]) // block_bytes
                for start in starts
                if start >= firsts[0] and (start - firsts[0]) % block_bytes == 0
            }
        points = {k for k in points if all(first + k * block_bytes in starts for first in firsts)}
    return {k for k in points or () if k < cache.committed_blocks}


def gains(
    cache: PoolCache,
    points: Collection[int],
    borrower: CacheShape,
    top: int | None = None,
    room: int | None = None,
    *,
    most: int | None = None,
    wanted: int | None = None,
) -> dict[int, int]:
    """For each lend point of `points` (blocks kept) below `top` (the blocks the cache keeps
    once the lends planned before this one are made; default: what it has), the blocks it
    lends mapped to the blocks its handles give a borrower of shape `borrower` with `room`
    blocks left under its maximum (`extensible_kv.shape.deal`: `blocks_from`, capped). Cuts
    that give none are left out: the borrower could use nothing of them. Weighing a cut
    deals its handles (a millisecond for a thousand handles over 64 segments), so only cuts
    of at most `most` blocks are weighed, smallest first, up to the first that gives more
    than `wanted` (a larger cut gives at least as much)."""
    committed = cache.committed_blocks
    top = committed if top is None else top
    # The handles past `top` go to the loans planned first: not this one's.
    above = collections.Counter(_sizes(cache, top) if top < committed else ())
    out = {}
    for kept in sorted(points, reverse=True):
        lent = top - kept
        if kept >= top or (most is not None and lent > most):
            continue
        sizes = _without(_sizes(cache, kept), above)
        gained = deal(borrower, 0, sizes, max_blocks=room).blocks if sizes else 0
        if gained > 0:
            out[lent] = gained
            if wanted is not None and gained > wanted:
                break
    return out


def _sizes(cache: PoolCache, kept: int) -> list[int]:
    """`cache.lend_sizes(kept)`, or none where that cut cannot be lent now."""
    try:
        return cache.lend_sizes(kept)
    except ValueError:
        return []


def _without(sizes: Sequence[int], taken: collections.Counter[int]) -> list[int]:
    """`sizes` in their order, less the sizes `taken` counts (the handles lent first)."""
    left = collections.Counter(taken)
    out = []
    for size in sizes:
        if left[size] > 0:
            left[size] -= 1
        else:
            out.append(size)
    return out


def device_free_bytes(device: str) -> Callable[[], int]:
    """The device's free memory, as the member measures it by default: the host's for `cpu`,
    CUDA's for `cuda:N`."""
    if device == "cpu":
        from extensible_kv.sizing import host_free_bytes

        return host_free_bytes

    def cuda_free() -> int:
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)

    return cuda_free
