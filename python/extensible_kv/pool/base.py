"""What every side of a pool member shares (`MemberBase`): its settings and state, its
transactions (each starting by bringing the ledger in line with its notes), the numbers it
posts, and the steps both its donor side and its borrower side take.

`PoolMember` (`extensible_kv.pool.member`) is this plus its donor side
(`extensible_kv.pool.donor`: answering requests, lending, reclaiming, the fd socket) and its
borrower side (`extensible_kv.pool.borrower`: taking loans, giving them back, shrinking);
each side is a mixin over this base, so that no module imports another side's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from extensible_kv.pool import fds, rules
from extensible_kv.pool.asks import AskLog
from extensible_kv.pool.caches import PoolCache, borrowed_bytes, lend_points, lent_bytes
from extensible_kv.pool.hooks import PoolHooks
from extensible_kv.pool.ledger import Ledger, LedgerCorruptError, concerns
from extensible_kv.pool.notes import Notes
from extensible_kv.pool.policy import Decision
from extensible_kv.pool.store import Pool, PoolLockTimeout

logger = logging.getLogger("extensible_kv.pool")

__all__ = ["MemberBase", "PostFailed"]

# How long a shrink through the driver waits for its memory to be the driver's, in slices
# that a Ctrl-C ends, before it posts anyway (the release thread is late, not lost).
RELEASE_WAIT_S = 10.0
# What failing to use the ledger raises: the lock held too long, the file system (a full
# /dev/shm, a file in the wrong hands), the ledger unreadable.
STORE_FAILURES = (PoolLockTimeout, LedgerCorruptError, OSError)
# A member with nothing to do skips `serve()`'s transactions (`MemberBase._quiet`), but still
# heartbeats this often: so others' deadlines on it (an offer not taken, a request not
# answered) are acted on this late at most, and a dead engine is reaped as often.
QUIET_BEAT_S = 0.05


def _settled(seen: dict[str, Any], name: str) -> bool:
    """Whether every loan of engine `name` in `seen` (`ledger.concerns`) waits on another
    engine, so that a round of its own has nothing to do for it: borrowed and not recalled,
    or offered by it. Any other (a request to answer or one it made, an offer to take, a
    loan to give back or to take back) is work for its next round, however quiet."""
    for loan in seen["loans"]:
        state = loan.get("state")
        if state == "borrowed" and not loan.get("recall"):
            continue
        if state == "offered" and loan.get("lender") == name:
            continue
        return False
    return True


class PostFailed(Exception):
    """Inside `serve()`: the ledger could not be used; what moved is posted later."""


class MemberBase:
    """The state `PoolMember.__init__` sets, and the steps its sides share."""

    pool: Pool
    name: str
    cache: PoolCache
    via: str
    move: bool
    min_blocks: int
    max_blocks: int
    hooks: PoolHooks  # the engine's (`extensible_kv.pool.hooks`)
    zero: bool
    answer_timeout_s: float
    take_timeout_s: float
    commit_step_blocks: int | None
    stream: int | None
    busy: bool
    _notes: Notes
    _asks: AskLog
    _serving: int  # serve() calls in progress: a failed post is logged there
    _post_failure: str | None  # the last failed post's error, while failing
    _refusals: int  # socket peers refused so far
    _last_plan: list[tuple[str, str, int]]
    _refused: dict[str, float]  # donor -> when it may be asked again
    _warned: set[str]  # lenders whose loan this engine could not borrow
    _exported_at: int  # the committed blocks when every handle was last exported
    _settling: bool
    _fd_server: fds.FdServer | None  # where borrowers refused by pid ask
    _seen: dict[str, Any] | None  # what concerned it in the ledger its last transaction left
    _beat_at: float  # when that transaction ended (time.monotonic())
    _posted: dict[str, Any] | None  # the numbers it posted there
    give_back_idle_s: float | None
    _idle_since: float | None  # when it last became idle (`serve(busy=False)`); None: busy

    # ---------------------------------------------------------------------------------------
    # the ledger, in line with the cache

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[Ledger]:
        """A transaction of the pool whose recovery step also reconciles this engine's entries
        with its cache (`Notes.reconcile`). Inside `serve()`, a failure to use the ledger (not
        one of the body's) is a `PostFailed`, which `serve` logs."""
        body_failed = False
        self._seen = None  # until this one ends well
        try:
            with self.pool.transaction(repair=self._reconcile, seen=self._saw) as ledger:
                try:
                    yield ledger
                except BaseException:
                    body_failed = True
                    raise
        except STORE_FAILURES as error:
            if body_failed or not self._serving:
                raise
            raise PostFailed(str(error)) from error

    def _idle_for(self) -> float | None:
        """How long it has been idle, once that is past `give_back_idle_s` and it asks for
        nothing (None otherwise)."""
        if self._idle_since is None or self.give_back_idle_s is None or self._asks.open:
            return None
        idle = time.monotonic() - self._idle_since
        return idle if idle >= self.give_back_idle_s else None

    def _saw(self, data: bytes) -> None:
        self._seen = concerns(data, self.name)
        self._beat_at = time.monotonic()

    def _quiet(self) -> bool:
        """Whether a round of `serve()` would find nothing to do, so that an engine serving
        between every two steps costs them a file read, not a transaction (~0.1 ms against
        ~1 ms, and no lock): nothing that concerns it changed in the ledger since its last
        transaction (`ledger.concerns`: its limits, the caps, its loans; read without the
        lock), nor what it would post, no ask of its own is open, and its last heartbeat is
        under `QUIET_BEAT_S` old. A hint only: a round that does run reads the ledger in a
        transaction, as always."""
        if (
            self._seen is None
            or self._posted is None
            or self._asks.open
            or self._settling
            or self._post_failure is not None
            or time.monotonic() - self._beat_at >= QUIET_BEAT_S
        ):
            return False
        if self._numbers() != self._posted or not _settled(self._seen, self.name):
            return False
        if self._posted["borrowed_bytes"] and self._idle_for() is not None:
            return False  # what it borrowed goes back
        try:
            data = self.pool.peek()
        except STORE_FAILURES:
            return False
        return concerns(data, self.name) == self._seen

    def _reconcile(self, ledger: Ledger) -> None:
        self._notes.reconcile(
            ledger, self.name, self.pool.clock(), self.take_timeout_s, self._held()
        )

    def _held(self) -> dict[str, int]:
        cache = self.cache
        return {
            "committed_blocks": cache.committed_blocks,
            "physical_bytes": cache.physical_bytes,
            "lent_bytes": lent_bytes(cache),
            "borrowed_bytes": borrowed_bytes(cache),
        }

    def _record(self, ledger: Ledger) -> None:
        """Posts what the cache holds, what it could lend at once and its spare blocks, and the
        heartbeat."""
        numbers = self._numbers()
        rules.record(ledger, self.name, self.pool.clock(), numbers)
        self._posted = numbers

    def _numbers(self) -> dict[str, Any]:
        """What `_record` posts: what the cache holds, what it could lend at once, its spare
        blocks, and whether the engine is busy."""
        cache = self.cache
        lendable = 0
        committed, spare = cache.committed_blocks, self._spare_blocks()
        if not borrowed_bytes(cache):  # a borrower lends nothing
            fits = [committed - k for k in lend_points(cache) if committed - k <= spare]
            lendable = max(fits, default=0)
        return {
            **self._held(),
            "lendable_blocks": lendable,
            "spare_blocks": spare,
            "busy": self.busy,
        }

    # ---------------------------------------------------------------------------------------
    # the cache's free blocks, as the engine says (one name each: `extensible_kv.pool.hooks`)

    def _free_tail_blocks(self) -> int:
        """The top committed blocks no request uses now (the `free_tail_blocks` hook)."""
        return self.hooks.tail(self.cache.committed_blocks)

    def _free_blocks(self) -> int | None:
        """With `move=True`, the free blocks wherever they lie (the `free_blocks` hook);
        None without."""
        if not self.move:
            return None
        return self.hooks.anywhere(self.cache.committed_blocks)

    def _spare_blocks(self) -> int:
        """The top blocks that could go at once (the ledger's `spare_blocks`): the free tail,
        or with `move=True` as many as are free anywhere (the live ones above them move down
        first)."""
        return max(self._free_tail_blocks(), self._free_blocks() or 0)

    # ---------------------------------------------------------------------------------------
    # steps both sides take

    def _clear_past(self, keep: int) -> None:
        """With `move=True`, moves the live blocks at or past `keep` down, if any: before a
        lend or a release, and before a borrowed loan goes back (so that a recalled loan goes
        back at once, however busy the borrower is, if it has free blocks enough below)."""
        move_below = self.hooks.move_below
        if self.move and self._free_tail_blocks() < self.cache.committed_blocks - keep:
            assert move_below is not None  # move=True needs it (`PoolMember`)
            move_below(keep)

    def _released_to_driver(self) -> None:
        """Waits until what a shrink gave back is the driver's: before the ledger says so, or
        another engine could count on memory the device still holds. In slices, so that a
        Ctrl-C ends it; past `RELEASE_WAIT_S`, posted anyway (the memory is on its way)."""
        deadline = time.monotonic() + RELEASE_WAIT_S
        while not self.cache.wait_released(timeout=0.01):
            if time.monotonic() >= deadline:
                logger.warning(
                    "pool: %s: the driver has not released its shrink after %.0f s",
                    self.name,
                    RELEASE_WAIT_S,
                )
                break
        self._resized()

    def _resized(self) -> None:
        if self.hooks.on_resize is not None:
            self.hooks.on_resize(self.cache.committed_blocks)

    def _log(self, decision: Decision) -> None:
        peer = f" {decision.peer}" if decision.peer else ""
        logger.info(
            "pool: %s: %s%s %d blocks: %s",
            self.name,
            decision.action,
            peer,
            decision.blocks,
            decision.reason,
        )

    def _log_plan(self, decisions: list[Decision]) -> None:
        """Logs a plan when it differs from the last: `grow` plans again every round."""
        plan = [(str(d.action), d.peer, d.blocks) for d in decisions]
        if plan != self._last_plan:
            for decision in decisions:
                self._log(decision)
        self._last_plan = plan
