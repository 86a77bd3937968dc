"""transformers' continuous-batching engines in a node pool (`enable(pool=...)`,
docs/design.md §11): `PooledSizer`, the sizer of a cache the pool sizes, and the manager's
membership while its loop runs (`Joined`).

A manager's cache joins the pool as its generation loop starts, and leaves when the loop ends,
both on the loop's thread. In between:

- **The cache as the pool sees it** (`sector_cache.SectorCache`, a `PoolCache`): its data
  sectors, one block each, the trash sectors below block 0.
- **Serving** (`Joined.tick`): `PoolMember.serve` runs between the loop's steps, at most once
  a millisecond, and at least every `IDLE_SERVE_S` while the loop waits for requests (the
  manager's wake-up event is given a shorter wait), so an idle donor answers within the
  pool's bound. Busy is whether any request holds blocks.
- **Growing** (`Joined.grow`): where transformers' scheduler finds too few free sectors for a
  request, the member asks the pool for what the scheduler's requests need to finish (each
  one's prompt plus its most new tokens, less what it holds: `sectors.queue_need`), in its
  own sectors, up to its maximum, with `since` the time the first waiting one arrived: a
  burst asks once for its whole queue, not a step at a time. With other requests holding
  blocks the loop does not wait: the free memory is committed at once, a loan is taken at a
  later step, and the request is scheduled then. With none, transformers would fail the
  request (nothing to offload), so the loop waits for the pool, up to `IDLE_GROW_S`, for
  what that request lacks. The scheduler's margin check asks too while requests wait (under
  its margin the scheduler would admit none of them): for the queue, and at least what
  keeps `GROW_BELOW_FREE` of the cache free.

The hooks are the manager's instance attributes (`_generation_loop_body`, `_wake_up_loop`),
put there when its cache joins and removed when it leaves, so `disable()` never strands a
running engine and leaves nothing of them behind.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

from extensible_kv.pool.member import PoolMember
from extensible_kv.pool.store import Pool
from extensible_kv.transformers import sectors
from extensible_kv.transformers.sector_cache import SectorCache
from extensible_kv.transformers.state import GIB, CacheState, logger

__all__ = [
    "IDLE_GROW_S",
    "IDLE_SERVE_S",
    "SERVE_EVERY_S",
    "Joined",
    "PooledSizer",
    "SectorCache",
    "join",
    "leave",
    "member_of",
]

SERVE_EVERY_S = 0.001  # between steps, at most this often
# While the loop waits for requests, at least this often: an idle donor answers within it.
# A round with nothing to do reads the ledger's file, no transaction (`PoolMember.serve`).
IDLE_SERVE_S = 0.005
IDLE_GROW_S = 2.0  # the most a loop with nothing else to run waits for the pool
LEAVE_S = 10.0  # for borrowers to give back what it lent, as it leaves

# The managers whose caches are in a pool now: what `leave` finds as the loop ends.
_JOINED: weakref.WeakKeyDictionary[Any, Joined] = weakref.WeakKeyDictionary()
# Numbers the engines a process puts in pools without a name of their own.
_ENGINE_SERIAL = itertools.count()


@dataclass
class PooledSizer:
    """A cache's place in a node pool (`enable(pool=...)`), in sectors: the extension commits
    `min_sectors`, and the cache grows through the pool up to `max_sectors`, committing
    `step_sectors` at a time (the smallest unit it lends), as engine `engine`; `joined` while
    its loop runs in the pool. Counts are ones whose committed end is a granule boundary
    (`CacheState.aligned_up`): a borrow maps there, and a loan is whole granules. `resize`
    and `suspend` refuse: the pool sizes the cache."""

    kind: ClassVar[str] = "pool"

    pool: Pool | str
    engine: str
    via: str
    move: bool
    min_sectors: int
    max_sectors: int
    step_sectors: int
    joined: Joined | None = None

    @classmethod
    def within(cls, state: CacheState, fit_sectors: int) -> PooledSizer:
        """The options' limits in sectors (given in blocks or in bytes), within the
        reservation; the most is what the extension measured as fitting (`fit_sectors`)
        unless a maximum is given."""
        options = state.options
        assert options.pool is not None
        capacity, per_sector = state.capacity_sectors, state.bytes_per_sector
        if options.min_bytes is not None:
            least = -(-options.min_bytes // per_sector)
        else:
            least = state.sectors(options.min_blocks or 1)
        least = state.aligned_up(min(least, capacity))
        if options.max_bytes is not None:
            most = options.max_bytes // per_sector
        elif options.max_blocks is not None:
            most = state.sectors(options.max_blocks)
        else:
            most = fit_sectors
        most = state.aligned_down(min(most, capacity))
        if most < least and options.max_bytes is not None:
            logger.warning(
                "max_bytes=%d holds %d sectors of %d bytes, fewer than the minimum's %d: the "
                "maximum is the minimum",
                options.max_bytes,
                most,
                per_sector,
                least,
            )
        most = max(most, least)
        align = state.granule_sectors
        step = state.sectors(options.pool_step_blocks or 0) or max(1, most // 16)
        step = math.ceil(step / align) * align
        engine = options.engine or f"transformers-{os.getpid()}-{next(_ENGINE_SERIAL)}"
        return cls(options.pool, engine, options.pool_via, options.pool_move, least, most, step)

    # -- the sizer's hooks --------------------------------------------------------------------

    def grow_on_demand(self, cache: Any, request: Any, request_len: int) -> bool:
        """transformers' scheduler found too few free sectors for `request`: asks the pool
        for the queue (`Joined.grow`). Nothing outside the pool (before the loop joins)."""
        joined = self.joined
        if joined is None:
            return False
        return joined.grow(sectors.missing_sectors(cache, request, request_len), request)

    def grow_to_margin(self, cache: Any) -> bool:
        """Under the scheduler's margin, while requests wait: asks for the queue, and at least
        what brings the free share up to `GROW_BELOW_FREE`. With none waiting, nothing: the
        margin only keeps the scheduler from admitting a waiting request."""
        joined = self.joined
        if joined is None:
            return False
        need = sectors.queue_need(cache, joined.scheduler)
        if not need.waiting:
            return False
        return joined.grow(max(sectors.margin_sectors(cache), need.sectors), need=need)

    def refuse(self, what: str) -> None:
        raise RuntimeError(
            f"this manager's KV cache is sized by the node pool it joins (engine "
            f"{self.engine}): it cannot {what} on its own; change its limits with "
            f"`python -m extensible_kv pool limit {self.engine} --min N --max N`"
        )

    def watch(self, manager: Any, cache: Any) -> None:
        return None  # the cache joins the pool as the loop starts (`join`)


class _PacedEvent(threading.Event):
    """The manager's wake-up event, whose waits end within `IDLE_SERVE_S`: the idle loop
    comes round to serve the pool that often."""

    def wait(self, timeout: float | None = None) -> bool:
        return super().wait(IDLE_SERVE_S if timeout is None else min(timeout, IDLE_SERVE_S))


class Joined:
    """A manager's cache in the pool, while its loop runs: its member, the scheduler whose
    requests it asks for, and the hooks."""

    def __init__(
        self, cache: Any, sector_cache: SectorCache, member: PoolMember, scheduler: Any
    ) -> None:
        self.cache = cache
        self.sectors = sector_cache
        self.member = member
        self.scheduler = scheduler
        self.last_serve = 0.0
        self.last_request = 0.0
        self.asked_to = 0  # the sectors its last ask while busy wanted to reach
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
        return bool(sectors.busy_requests(self.cache))

    def grow(
        self, missing: int, request: Any = None, need: sectors.QueueNeed | None = None
    ) -> bool:
        """transformers' scheduler found `missing` sectors too few (for `request`, or for its
        margin): asks the pool for what its requests need to finish (`need`, counted here
        when not given; at least `missing`), in whole granules, up to the maximum, since the
        first waiting one arrived. True when the cache grew."""
        state: CacheState = self.cache._ekv
        if missing <= 0 or state.capturing():
            return False
        busy = self.busy()
        now = time.monotonic()
        if busy and now - self.last_request < SERVE_EVERY_S:
            # Once a millisecond at most: every waiting request checks in turn.
            return False
        if need is None:
            need = sectors.queue_need(self.cache, self.scheduler, request)
        before = state.committed_sectors
        # Whole granules past the trash: what a commit keeps and a donor lends.
        want = state.aligned_up(before + max(missing, need.sectors)) - before
        since = self._since(need.since)
        if busy:
            # Others run meanwhile: what is offered is taken at a later step (`tick`
            # serves), and this request is scheduled then. An ask still open takes this
            # one in unless the queue needs more than it asked for.
            if self.member.asking and before + want <= self.asked_to:
                return False
            self.last_request = now
            self.asked_to = before + want
            self._safely(lambda: self.member.request(want, since=since))
            self._safely(lambda: self.member.serve(busy=True))
        else:
            # Nothing else would run: transformers fails a request it cannot place and
            # cannot offload anything for. Wait for the pool, within a bound, for what
            # this request lacks.
            self._safely(lambda: self.member.request(want, since=since))
            lacking = state.aligned_up(before + missing) - state.committed_sectors
            if lacking > 0:
                self._safely(lambda: self.member.grow(lacking, timeout_s=IDLE_GROW_S, since=since))
        grew: bool = state.committed_sectors > before
        if grew:
            logger.info(
                "Grew KV cache through the pool from %d to %d blocks (%.2f GiB)",
                state.blocks(before),
                state.blocks(state.committed_sectors),
                state.tensor.physical_bytes / GIB,
            )
        return grew

    def _since(self, created: float | None) -> float | None:
        """transformers' `created_time` (a `time.perf_counter()` time) on the pool's clock;
        None (the ask's own time) without one."""
        if created is None:
            return None
        now = self.member.pool.clock()
        return min(now, max(0.0, now - (time.perf_counter() - created)))

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


def member_of(cache: Any) -> PoolMember | None:
    """The `PoolMember` of `cache` (a manager's `batch_processor.cache`) while its loop runs
    in a node pool, else None."""
    sizer = getattr(getattr(cache, "_ekv", None), "sizer", None)
    joined = sizer.joined if isinstance(sizer, PooledSizer) else None
    return None if joined is None else joined.member


def join(manager: Any, batch_processor: Any) -> None:
    """The batch processor's cache joins its pool (if it was built for one) as `manager`'s
    loop starts, on the loop's thread; a manager restarted with its cache joins again."""
    cache = getattr(batch_processor, "cache", None)
    state = getattr(cache, "_ekv", None)
    sizer = getattr(state, "sizer", None)
    if not isinstance(sizer, PooledSizer) or manager in _JOINED:
        return
    assert isinstance(state, CacheState)
    sector_cache = SectorCache(cache)
    member = PoolMember(
        sizer.pool,
        sizer.engine,
        sector_cache,
        min_blocks=sizer.min_sectors,
        max_blocks=sizer.max_sectors,
        free_tail_blocks=sector_cache.free_tail_blocks,
        on_resize=sector_cache.on_resize,
        commit_step_blocks=sizer.step_sectors,
        via=sizer.via,
        move=sizer.move,
    )
    member.join()
    joined = Joined(cache, sector_cache, member, batch_processor.scheduler)
    joined.hook(manager)
    _JOINED[manager] = joined
    sizer.joined = joined
    logger.info(
        "KV cache joined pool %s as %s: %d blocks now, %d to %d (%s)",
        member.pool.name,
        sizer.engine,
        state.blocks(state.committed_sectors),
        state.blocks(sizer.min_sectors),
        state.blocks(sizer.max_sectors),
        f"{state.blocks(sizer.step_sectors)} at a time, via {sizer.via}",
    )


def leave(manager: Any) -> None:
    """`manager`'s cache leaves its pool as the loop ends (on the loop's thread): what it
    borrowed goes back, what it lent comes back (the borrowers give it back as they serve),
    and the hooks go."""
    joined = _JOINED.pop(manager, None)
    if joined is None:
        return
    cache = joined.cache
    state: CacheState = cache._ekv
    try:
        if joined.busy():
            # A hard stop failed requests that still hold blocks: the next session frees them
            # anyway (the batch processor's reset), and borrowed sectors must be free to go.
            state.synchronize()
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
        if isinstance(state.sizer, PooledSizer):
            state.sizer.joined = None
    logger.info(
        "KV cache left pool %s (%s): %d blocks",
        joined.member.pool.name,
        joined.member.name,
        state.blocks(state.committed_sectors),
    )
