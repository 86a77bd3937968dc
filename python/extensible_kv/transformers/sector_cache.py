"""transformers' cache as the node pool drives it (`SectorCache`, a `PoolCache` and a
`MovingCache`): transformers' one flat `ExtensibleTensor`, whose blocks are its data sectors.

The two trash sectors lie below block 0 (`footprint().leading_blocks`), so a loan, a cut and a
borrow fall on sector boundaries past them. Every change keeps transformers' `CachePool` true:
sectors leave its free list before they are unmapped (lent, given back, shrunk: all must be
free, blocks cached only for prefix sharing are evicted), and join it once they are mapped
(committed, borrowed, reclaimed), as the run-time resize does (`sectors.take_out_of_pool`,
`sectors.set_pool_size`). Call it only on the generation loop's thread, between steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from extensible_kv import flow
from extensible_kv.ipc import Loan
from extensible_kv.shape import BufferShape, CacheShape
from extensible_kv.tensor import ExtensibleTensor, borrow_dealt, give_back_dealt
from extensible_kv.transformers import sectors
from extensible_kv.transformers.resizing import grow_live
from extensible_kv.transformers.state import TRASH_SECTORS, SectorView

__all__ = ["SectorCache"]


class SectorCache(SectorView):
    """transformers' cache as `PoolMember` drives it (a `PoolCache`): the flow's view of its
    data sectors (one buffer, one segment, a block per data sector, the trash sectors below
    block 0), which also lends and borrows. Call it only on the generation loop's thread,
    between steps."""

    def __init__(self, cache: Any) -> None:
        super().__init__(cache._ekv)
        self._cache = cache
        # Set by `Joined.tick` while it serves: live blocks may move then, and only then.
        self.between_steps = False
        # Where each loan this cache borrowed begins, in its blocks: a give-back cuts there.
        self._borrowed_at: dict[tuple[int, int, int], int] = {}

    @property
    def buffers(self) -> tuple[ExtensibleTensor, ...]:
        return (self._state.tensor,)

    @property
    def num_segments(self) -> tuple[int, ...]:
        return (1,)

    @property
    def segment_block_bytes(self) -> tuple[int, ...]:
        return (self._state.bytes_per_sector,)

    # -- what transformers' pool does not use ------------------------------------------------

    def free_tail_blocks(self) -> int:
        """The top data sectors no request holds: free, or holding only blocks kept for
        prefix sharing (evicted when they go)."""
        state, cache = self._state, self._cache
        top = TRASH_SECTORS - 1
        for allocator in cache.cache_allocators.values():
            per_sector = allocator.blocks_per_sector
            for blocks in allocator.block_table.values():
                if blocks:
                    top = max(top, max(blocks) // per_sector)
        return max(0, TRASH_SECTORS + state.committed_sectors - 1 - top)

    def free_blocks(self) -> int:
        """The data sectors no allocator holds (none of their blocks is in a request's block
        table, the prefix cache, or an allocator's own free blocks): what `move_below` can
        move live sectors into. Only the free top ones while not `between_steps`."""
        state = self._state
        if not self.between_steps:
            return self.free_tail_blocks()
        return state.committed_sectors - len(sectors.sector_owners(self._cache, TRASH_SECTORS))

    def move_below(self, num_blocks: int) -> None:
        """Moves the held sectors at and past `num_blocks` into free ones below it (the
        resize's move), between the loop's steps only: the member also serves from inside
        transformers' scheduler (`grow_on_demand`), where a batch is half planned."""
        if not self.between_steps:
            raise RuntimeError("live KV blocks move only between the generation loop's steps")
        flow.refuse_while_capturing(self._state.device, "moving KV blocks")
        sectors.move_below(self._cache, self._state, TRASH_SECTORS + num_blocks)

    def on_resize(self, committed_blocks: int) -> None:
        """transformers' pool holds every committed sector (each change below keeps it so;
        this is the member's check that it does)."""
        if self._state.final_sectors != committed_blocks:
            sectors.set_pool_size(self._cache, self._state, committed_blocks)

    # -- changes ------------------------------------------------------------------------------

    def commit(self, num_blocks: int) -> None:
        """Commits up to `num_blocks` sectors, rounded down to a granule boundary (a borrow
        maps there later): never more than the pool counted."""
        num_blocks = self._state.aligned_down(num_blocks)
        if num_blocks > self._state.committed_sectors:
            grow_live(self._cache, self._state, num_blocks)

    def shrink_to(self, num_blocks: int, *, exact: bool = False) -> None:
        """Unmaps the sectors at and past `num_blocks` (whole handles past them; `exact` is
        always so: the cut copies a straddling handle's live part). A `ValueError` if one of
        them is not free, and nothing changes."""
        if num_blocks >= self._state.committed_sectors:
            return
        self._take_out(num_blocks, "shrink")
        try:
            sectors.unmap_past(self._cache, self._state, num_blocks)
        except BaseException:
            sectors.put_back_in_pool(self._cache, self._state, num_blocks)
            raise

    def wait_released(self, timeout: float | None = None) -> bool:
        return self._state.tensor.wait_released(timeout)

    def lend(self, num_blocks: int, *, stream: int | None = None) -> tuple[Loan, ...]:
        """Keeps `num_blocks` sectors and lends the handles past them (all free: a
        `ValueError` otherwise, nothing lent)."""
        state = self._state
        if not 0 <= num_blocks < state.committed_sectors:
            raise ValueError(
                f"cannot keep {num_blocks} sectors and lend the rest: "
                f"{state.committed_sectors} are committed"
            )
        self._take_out(num_blocks, "lend")
        try:
            state.synchronize()  # the last steps' kernels may still read them
            loan = state.tensor.lend(self._bytes(num_blocks), stream=stream)
        except BaseException:
            sectors.put_back_in_pool(self._cache, state, num_blocks)
            raise
        self._resized()
        return (loan,)

    def lend_sizes(self, num_blocks: int) -> list[int]:
        """The sizes, in granules, of the handles `lend(num_blocks)` would lend now (changes
        nothing; raises what the lend would, but for the sectors' being free)."""
        state = self._state
        if not 0 <= num_blocks < state.committed_sectors:
            raise ValueError(
                f"cannot keep {num_blocks} sectors and lend the rest: "
                f"{state.committed_sectors} are committed"
            )
        return [granules for _, granules in state.tensor._lend_runs(self._bytes(num_blocks))]

    def shape(self) -> CacheShape:
        """The cache as a borrower: one buffer of one segment, a block per data sector, the
        trash sectors below block 0."""
        tensor = self._state.tensor
        return CacheShape(
            tensor.device,
            tensor.granularity,
            (BufferShape(1, self._state.bytes_per_sector),),
            TRASH_SECTORS,
        )

    def borrow(self, loans: Sequence[Loan], *, zero: bool = True, stream: int | None = None) -> int:
        """Maps loans of a cache of any model (same device and granularity) past the
        committed sectors, which grow by the sectors that memory holds (what the tensor maps
        past them already counts), and hands them to transformers' pool. Handles it cannot
        use go back to their lender at once."""
        loans = tuple(loans)
        state = self._state
        start = state.committed_sectors
        blocks = borrow_dealt(
            (state.tensor,),
            (state.bytes_per_sector,),
            loans,
            zero=zero,
            stream=stream,
            max_blocks=state.capacity_sectors - start,
        )
        state.synchronize()  # zeroed before transformers' own stream uses it
        for loan in loans:
            self._borrowed_at[loan.key] = start
        self._resized()
        return blocks

    def give_back(self, loans: Sequence[Loan], *, stream: int | None = None) -> None:
        """Returns borrowed loans: the sectors from where the first of them began must be
        free. The tensor shrinks to where their memory begins; the sectors below it stay
        transformers'."""
        loans = tuple(loans)
        if len({loan.key for loan in loans}) != len(loans):
            raise ValueError(f"{len(loans)} loans, one of them listed twice")
        starts = [self._borrowed_at.get(loan.key) for loan in loans]
        if not loans or None in starts:
            raise ValueError("this cache did not borrow that loan")
        start = min(s for s in starts if s is not None)
        self._take_out(start, "give back")
        state = self._state
        try:
            state.synchronize()
            _, held = give_back_dealt(
                (state.tensor,),
                (state.bytes_per_sector,),
                loans,
                stream=stream,
                leading_blocks=TRASH_SECTORS,
            )
        except BaseException:
            sectors.put_back_in_pool(self._cache, state, start)
            raise
        for loan in loans:
            del self._borrowed_at[loan.key]
        # The pool holds the sectors below `start` (the rest left it above); those the
        # tensor still holds past `start` (slack the loans' memory began after) go back in.
        state.final_sectors = start
        state.committed_sectors = held
        sectors.set_pool_size(self._cache, state, held)

    def reclaim(
        self,
        loans: Sequence[Loan],
        *,
        zero: bool = True,
        timeout: float | None = None,
        stream: int | None = None,
    ) -> None:
        (loan,) = self._one(loans)
        self._state.tensor.reclaim(loan, zero=zero, timeout=timeout, stream=stream)
        self._state.synchronize()
        self._resized()

    # -----------------------------------------------------------------------------------------

    def _take_out(self, num_blocks: int, what: str) -> None:
        if not sectors.take_out_of_pool(self._cache, self._state, num_blocks):
            raise ValueError(
                f"cannot {what} past sector {num_blocks}: requests hold sectors past it, or "
                "they are not free yet"
            )

    def _bytes(self, num_blocks: int) -> int:
        return (TRASH_SECTORS + num_blocks) * self._state.bytes_per_sector

    def _resized(self) -> None:
        """The committed sectors are the tensor's now; transformers' pool follows."""
        state = self._state
        count = state.tensor.bytes_per_segment // state.bytes_per_sector - TRASH_SECTORS
        state.committed_sectors = count
        sectors.set_pool_size(self._cache, state, count)

    @staticmethod
    def _one(loans: Sequence[Loan]) -> tuple[Loan]:
        loans = tuple(loans)
        if len(loans) != 1:
            raise ValueError(f"{len(loans)} loans for a cache of one buffer")
        return (loans[0],)
