"""transformers' continuous-batching engines in a node pool (`enable(pool=...)`,
docs/design.md §11).

A manager's cache joins the pool as its generation loop starts, and leaves when the loop ends,
both on the loop's thread. In between:

- **The cache as the pool sees it** (`SectorCache`, a `PoolCache`): transformers' one flat
  `ExtensibleTensor`, whose blocks are its data sectors. The two trash sectors lie below block
  0 (`footprint().leading_blocks`), so a loan, a cut and a borrow fall on sector boundaries past
  them. Every change keeps transformers' `CachePool` true: sectors leave its free list before
  they are unmapped (lent, given back, shrunk: all must be free, blocks cached only for prefix
  sharing are evicted), and join it once they are mapped (committed, borrowed, reclaimed), as
  the run-time resize does (`take_out_of_pool`, `set_pool_size`).
- **Serving** (`Joined.tick`): `PoolMember.serve` runs between the loop's steps, at most once
  a millisecond, and at least every `IDLE_SERVE_S` while the loop waits for requests (the
  manager's wake-up event is given a shorter wait), so an idle donor answers within the
  pool's bound. Busy is whether any request holds blocks.
- **Growing** (`Joined.grow_on_demand`): where transformers' scheduler finds too few free
  sectors for a request, the member asks the pool. With other requests holding blocks the loop
  does not wait: the free memory is committed at once, a loan is taken at a later step, and the
  request is scheduled then. With none, transformers would fail the request (nothing to
  offload), so the loop waits for the pool, up to `IDLE_GROW_S`. The scheduler's margin check
  asks too (`cache.grow_to_margin`): under its margin it would admit no new request.

The hooks are the manager's instance attributes (`_generation_loop_body`, `_wake_up_loop`),
put there when its cache joins and removed when it leaves, so `disable()` never strands a
running engine and leaves nothing of them behind.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from extensible_kv import flow
from extensible_kv.ipc import Loan
from extensible_kv.pool.member import PoolMember
from extensible_kv.shape import BufferShape, CacheShape
from extensible_kv.tensor import ExtensibleTensor, borrow_dealt, give_back_dealt
from extensible_kv.transformers import cache as _cache
from extensible_kv.transformers.cache import TRASH_SECTORS

__all__ = ["IDLE_GROW_S", "IDLE_SERVE_S", "SERVE_EVERY_S", "Joined", "SectorCache"]

logger = logging.getLogger("extensible_kv")

SERVE_EVERY_S = 0.001  # between steps, at most this often
IDLE_SERVE_S = 0.02  # while the loop waits for requests, at least this often
IDLE_GROW_S = 2.0  # the most a loop with nothing else to run waits for the pool
LEAVE_S = 10.0  # for borrowers to give back what it lent, as it leaves

# The managers whose caches are in a pool now: what `leave` finds as the loop ends.
_JOINED: weakref.WeakKeyDictionary[Any, Joined] = weakref.WeakKeyDictionary()


class SectorCache(_cache._Sectors):
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
        return state.committed_sectors - len(_cache.sector_owners(self._cache, TRASH_SECTORS))

    def move_below(self, num_blocks: int) -> None:
        """Moves the held sectors at and past `num_blocks` into free ones below it (the
        resize's move), between the loop's steps only: the member also serves from inside
        transformers' scheduler (`grow_on_demand`), where a batch is half planned."""
        if not self.between_steps:
            raise RuntimeError("live KV blocks move only between the generation loop's steps")
        flow.refuse_while_capturing(self._state.device, "moving KV blocks")
        _cache.move_below(self._cache, self._state, TRASH_SECTORS + num_blocks)

    def on_resize(self, committed_blocks: int) -> None:
        """transformers' pool holds every committed sector (each change below keeps it so;
        this is the member's check that it does)."""
        if self._state.final_sectors != committed_blocks:
            _cache.set_pool_size(self._cache, self._state, committed_blocks)

    # -- changes ------------------------------------------------------------------------------

    def commit(self, num_blocks: int) -> None:
        """Commits up to `num_blocks` sectors, rounded down to a granule boundary (a borrow
        maps there later): never more than the pool counted."""
        plan = self._state.pool_plan
        if plan is not None:
            num_blocks = plan.aligned_down(num_blocks)
        if num_blocks > self._state.committed_sectors:
            _cache._grow_live(self._cache, self._state, num_blocks)

    def shrink_to(self, num_blocks: int, *, exact: bool = False) -> None:
        """Unmaps the sectors at and past `num_blocks` (whole handles past them; `exact` is
        always so: the cut copies a straddling handle's live part). A `ValueError` if one of
        them is not free, and nothing changes."""
        if num_blocks >= self._state.committed_sectors:
            return
        self._take_out(num_blocks, "shrink")
        try:
            _cache.unmap_past(self._cache, self._state, num_blocks)
        except BaseException:
            _cache.put_back_in_pool(self._cache, self._state, num_blocks)
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
            state._synchronize()  # the last steps' kernels may still read them
            loan = state.tensor.lend(self._bytes(num_blocks), stream=stream)
        except BaseException:
            _cache.put_back_in_pool(self._cache, state, num_blocks)
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
        state._synchronize()  # zeroed before transformers' own stream uses it
        for loan in loans:
            self._borrowed_at[_key(loan)] = start
        self._resized()
        return blocks

    def give_back(self, loans: Sequence[Loan], *, stream: int | None = None) -> None:
        """Returns borrowed loans: the sectors from where the first of them began must be
        free. The tensor shrinks to where their memory begins; the sectors below it stay
        transformers'."""
        loans = tuple(loans)
        if len({_key(loan) for loan in loans}) != len(loans):
            raise ValueError(f"{len(loans)} loans, one of them listed twice")
        starts = [self._borrowed_at.get(_key(loan)) for loan in loans]
        if not loans or None in starts:
            raise ValueError("this cache did not borrow that loan")
        start = min(s for s in starts if s is not None)
        self._take_out(start, "give back")
        state = self._state
        try:
            state._synchronize()
            _, held = give_back_dealt(
                (state.tensor,),
                (state.bytes_per_sector,),
                loans,
                stream=stream,
                leading_blocks=TRASH_SECTORS,
            )
        except BaseException:
            _cache.put_back_in_pool(self._cache, state, start)
            raise
        for loan in loans:
            del self._borrowed_at[_key(loan)]
        # The pool holds the sectors below `start` (the rest left it above); those the
        # tensor still holds past `start` (slack the loans' memory began after) go back in.
        state.final_sectors = start
        state.committed_sectors = held
        _cache.set_pool_size(self._cache, state, held)

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
        self._state._synchronize()
        self._resized()

    # -----------------------------------------------------------------------------------------

    def _take_out(self, num_blocks: int, what: str) -> None:
        if not _cache.take_out_of_pool(self._cache, self._state, num_blocks):
            raise ValueError(
                f"cannot {what} past sector {num_blocks}: requests hold sectors past it, or "
                "they are not free yet"
            )

    def _bytes(self, num_blocks: int) -> int:
        return (TRASH_SECTORS + num_blocks) * self._state.bytes_per_sector

    def _resized(self) -> None:
        """The committed sectors are the tensor's now; transformers' pool follows."""
        state = self._state
        sectors = state.tensor.bytes_per_segment // state.bytes_per_sector - TRASH_SECTORS
        state.committed_sectors = sectors
        _cache.set_pool_size(self._cache, state, sectors)

    @staticmethod
    def _one(loans: Sequence[Loan]) -> tuple[Loan]:
        loans = tuple(loans)
        if len(loans) != 1:
            raise ValueError(f"{len(loans)} loans for a cache of one buffer")
        return (loans[0],)


def _key(loan: Loan) -> tuple[int, int, int]:
    return (loan.tensor_id, loan.loan_id, loan.epoch)


class _PacedEvent(threading.Event):
    """The manager's wake-up event, whose waits end within `IDLE_SERVE_S`: the idle loop
    comes round to serve the pool that often."""

    def wait(self, timeout: float | None = None) -> bool:
        return super().wait(IDLE_SERVE_S if timeout is None else min(timeout, IDLE_SERVE_S))


class Joined:
    """A manager's cache in the pool, while its loop runs: its member, and the hooks."""

    def __init__(self, cache: Any, sectors: SectorCache, member: PoolMember) -> None:
        self.cache = cache
        self.sectors = sectors
        self.member = member
        self.last_serve = 0.0
        self.last_request = 0.0
        self.failures = 0
        self._body: Any = None
        self._event: threading.Event | None = None
        self._paced: _PacedEvent | None = None

    # -- serving ------------------------------------------------------------------------------

    def tick(self) -> None:
        """Serves the pool, at most every `SERVE_EVERY_S` (called before each loop step)."""
        now = time.monotonic()
        if now - self.last_serve < SERVE_EVERY_S:
            return
        self.last_serve = now
        self.sectors.between_steps = True
        try:
            self._safely(lambda: self.member.serve(busy=self.busy()))
        finally:
            self.sectors.between_steps = False

    def busy(self) -> bool:
        return bool(_cache._busy_requests(self.cache))

    def grow_on_demand(self, missing: int) -> bool:
        """transformers' scheduler found `missing` sectors too few for a request: asks the
        pool for at least a step. True when the cache grew."""
        state: _cache._State = self.cache._ekv
        plan = state.pool_plan
        if missing <= 0 or plan is None or _cache._capturing(state):
            return False
        before = state.committed_sectors
        # Whole granules past the trash: what a commit keeps and a donor lends.
        want = plan.aligned_up(before + max(missing, plan.step_sectors)) - before
        if self.busy():
            # Others run meanwhile: what is offered is taken at a later step, and this
            # request is scheduled then. Asked once a millisecond at most (every waiting
            # request checks in turn).
            now = time.monotonic()
            if now - self.last_request >= SERVE_EVERY_S:
                self.last_request = now
                self._safely(lambda: self.member.request(want))
                self._safely(lambda: self.member.serve(busy=True))
        else:
            # Nothing else would run: transformers fails a request it cannot place and
            # cannot offload anything for. Wait for the pool, within a bound.
            self._safely(lambda: self.member.request(want))
            if state.committed_sectors - before < missing:
                self._safely(lambda: self.member.grow(missing, timeout_s=IDLE_GROW_S))
        grew: bool = state.committed_sectors > before
        if grew:
            logger.info(
                "Grew KV cache through the pool from %d to %d blocks (%.2f GiB)",
                state.blocks(before),
                state.blocks(state.committed_sectors),
                state.tensor.physical_bytes / _cache.GIB,
            )
        return grew

    def _safely(self, call: Any) -> None:
        """The pool must not stop the engine: an error is logged (the first few times), and
        the next step tries again."""
        try:
            call()
        except Exception:
            self.failures += 1
            if self.failures <= 3:
                logger.exception("KV cache pool member %s failed (serving on)", self.member.name)

    # -- the manager's hooks ------------------------------------------------------------------

    def hook(self, manager: Any) -> None:
        original = manager._generation_loop_body

        def generation_loop_body(*args: Any, **kwargs: Any) -> Any:
            self.tick()
            return original(*args, **kwargs)

        self._body = generation_loop_body
        manager._generation_loop_body = generation_loop_body
        self._event, self._paced = manager._wake_up_loop, _PacedEvent()
        if self._event.is_set():
            self._paced.set()
        manager._wake_up_loop = self._paced

    def unhook(self, manager: Any) -> None:
        if vars(manager).get("_generation_loop_body") is self._body:
            del manager._generation_loop_body
        if self._event is not None and manager._wake_up_loop is self._paced:
            manager._wake_up_loop = self._event
            if self._paced is not None and self._paced.is_set():
                self._event.set()
        self._body = self._event = self._paced = None


def join(manager: Any, cache: Any) -> None:
    """`cache` joins its pool (if it was built for one) as `manager`'s loop starts, on the
    loop's thread; a manager restarted with its cache joins again."""
    state = getattr(cache, "_ekv", None)
    plan = getattr(state, "pool_plan", None)
    if plan is None or manager in _JOINED:
        return
    assert isinstance(state, _cache._State)
    sectors = SectorCache(cache)
    member = PoolMember(
        plan.pool,
        plan.engine,
        sectors,
        min_blocks=plan.min_sectors,
        max_blocks=plan.max_sectors,
        free_tail_blocks=sectors.free_tail_blocks,
        on_resize=sectors.on_resize,
        commit_step_blocks=plan.step_sectors,
        via=plan.via,
        move=plan.move,
    )
    member.join()
    joined = Joined(cache, sectors, member)
    joined.hook(manager)
    _JOINED[manager] = joined
    state.pooled = joined
    logger.info(
        "KV cache joined pool %s as %s: %d blocks now, %d to %d (%s)",
        member.pool.name,
        plan.engine,
        state.blocks(state.committed_sectors),
        state.blocks(plan.min_sectors),
        state.blocks(plan.max_sectors),
        f"{state.blocks(plan.step_sectors)} at a time, via {plan.via}",
    )


def leave(manager: Any) -> None:
    """`manager`'s cache leaves its pool as the loop ends (on the loop's thread): what it
    borrowed goes back, what it lent comes back (the borrowers give it back as they serve),
    and the hooks go."""
    joined = _JOINED.pop(manager, None)
    if joined is None:
        return
    cache = joined.cache
    state = cache._ekv
    try:
        if joined.busy():
            # A hard stop failed requests that still hold blocks: the next session frees them
            # anyway (the batch processor's reset), and borrowed sectors must be free to go.
            state._synchronize()
            cache.free_all_requests()
        joined.member.leave(timeout_s=LEAVE_S)
    except Exception:
        logger.exception(
            "KV cache pool member %s could not settle its loans as it left; the pool reaps "
            "them when this process ends",
            joined.member.name,
        )
    finally:
        joined.unhook(manager)
        state.pooled = None
    logger.info(
        "KV cache left pool %s (%s): %d blocks",
        joined.member.pool.name,
        joined.member.name,
        state.blocks(state.committed_sectors),
    )
