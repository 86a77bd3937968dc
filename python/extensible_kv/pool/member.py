"""An engine's side of the pool: `PoolMember` joins, heartbeats, asks for memory and, as a
donor, lends whole handles of its cache (a `PoolCache`: an `ExtensibleKVCache`, or
transformers' cache through `extensible_kv.transformers`), to engines of any model on its
device and granularity.

No daemon: requests and answers go through the ledger itself. A needy engine asks for what its
waiting requests need (`request`, `grow`, `request_bytes`): the device's free memory is
committed at once, and every donor the policy picks gets a request (`asked`) in the same
round, idle ones first. The donor, at its next `serve()`, lends its free top blocks
(`ExtensibleKVCache.lend`, at the cut whose handles give the borrower what it asked in the
borrower's own blocks) and posts the `Loan`s in the entry (`offered`); the borrower, at its
next `serve()`, borrows them (the fds are taken from the lender by pid, as
`extensible_kv.ipc` does) and posts `borrowed`. Giving back and reclaiming go the same way.
The memory moves outside the pool's lock; each outcome is posted in the next transaction,
together with the engine's own numbers, so the ledger is consistent between any two
transactions. Each ask and what it got, with the wait from the first waiting request to the
memory mapped, is logged and kept (`PoolMember.asks`, `extensible_kv.pool.asks`).

A post can fail after the memory moved (the lock held too long by another process, a full
`/dev/shm`, a corrupt ledger), and a Ctrl-C can fall between the two. So the member's own
cache is the truth: right after each move, before any post, the member notes what it moved,
and every transaction it runs starts by bringing the ledger's entries for this engine in line
with the notes (`extensible_kv.pool.notes`). A failed post inside `serve()` is logged and left
to the next transaction; an explicit call (`grow`, `request`, `settle`, `leave`) raises, and
its move is reconciled all the same. A Ctrl-C during a move is held until the move and its
note are done; every wait (for the lock, for memory, for borrowers) ends on it.

Call `serve()` from the engine's own thread between its steps, often (it is the heartbeat, and
a donor answers only there): a lend takes blocks away from the cache, which must not happen
while a step uses them. `free_tail_blocks()` says how many top blocks the engine does not use
now; the engine learns the cache's new size from `on_resize(committed_blocks)`. These are the
engine's hooks, declared once with the others in `extensible_kv.pool.hooks`.

`via="driver"` moves memory as kvcached does, for comparison: a donor answers a request by
giving its free top blocks back to the driver (`shrink_to`, then `wait_released`), and the
needy engine commits them from the device's free memory (a create, after the driver's scrub).
Same ledger, policy and log; only the donor's answer differs.

The member is three sides over one base (`extensible_kv.pool.base`): its own asking, serving
and leaving here, the donor's (`extensible_kv.pool.donor`) and the borrower's
(`extensible_kv.pool.borrower`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from extensible_kv import _args
from extensible_kv._native import OutOfMemoryError
from extensible_kv.pool import _proc, rules
from extensible_kv.pool.asks import Ask, AskLog
from extensible_kv.pool.base import PostFailed, logger
from extensible_kv.pool.borrower import BorrowerSide
from extensible_kv.pool.caches import MovingCache, PoolCache, device_free_bytes
from extensible_kv.pool.donor import EXPORT_AHEAD_HANDLES, DonorSide
from extensible_kv.pool.hooks import recognise
from extensible_kv.pool.ledger import (
    MAX_TIME,
    Engine,
    Ledger,
    LoanState,
    PoolLoan,
    check_device,
    check_name,
)
from extensible_kv.pool.notes import Notes
from extensible_kv.pool.policy import Action, Decision, plan_grow, plan_release
from extensible_kv.pool.store import Pool

if TYPE_CHECKING:
    from extensible_kv.shape import CacheShape

__all__ = ["EXPORT_AHEAD_HANDLES", "VIAS", "MovingCache", "PoolCache", "PoolMember"]

# How long an engine may be idle (`serve(busy=False)`) before what it borrowed goes back to its
# lenders (`give_back_idle_s`): there the next needy engine is answered in one step.
GIVE_BACK_IDLE_S = 0.25
# How often `grow` asks again while nothing is on its way for it.
ASK_AGAIN_S = 0.01
# How a donor's memory reaches a needy engine: as a loan of its handles, or through the driver
# (released, then created again by the needy engine).
VIAS = ("loan", "driver")


class PoolMember(DonorSide, BorrowerSide):
    """Engine `name` of `pool` (a `Pool`, or a pool name), over `cache` (a `PoolCache`),
    created with `export_handle_types="posix_fd"` (loans travel as POSIX fds) unless `via` is
    `"driver"`.

    Its limits, in its own blocks or in bytes (blocks differ from model to model; each limit
    one way): it never lends below `min_blocks` (or the fewest blocks that hold `min_bytes`;
    default 0) and never grows past `max_blocks` (or the most blocks that fit in
    `max_bytes`; default and at most the cache's capacity). Its hooks
    (`extensible_kv.pool.hooks`, each given here or a method of the cache of the same name):
    `free_tail_blocks()` returns how many of its top committed blocks it does not use now;
    `on_resize(committed_blocks)` is called after every change of the cache's size.
    `free_bytes()` measures the device's free memory (default: the host's for `cpu`, CUDA's
    for `cuda:N`). `zero` zeroes what it
    borrows and reclaims (across tenants). A request to a donor that does not answer within
    `answer_timeout_s` expires (the donor is then stuck, and not asked again until it
    heartbeats); a loan offered and not taken within `take_timeout_s` is taken back. Once it
    has been idle (`serve(busy=False)`) for `give_back_idle_s` (None: never), what it
    borrowed goes back to its lenders, each loan once its blocks are free. A loan
    is whole physical handles: `commit_step_blocks` commits free memory in steps of that many
    blocks, so that each step's handles can be lent on their own later (a CUDA cache's
    handles are at most 1 GiB anyway). `move=True` lends free blocks wherever they lie: the
    live blocks above the cut are moved down first (the cache must be a `MovingCache`, a
    `ValueError` otherwise), and so does a borrower before a loan goes back: a recalled loan
    goes back at once if the blocks below it can hold what is live in it. `via` is how it
    answers a request as a donor: `"loan"` lends its free top blocks' handles, `"driver"`
    gives them back to the driver for the needy engine to commit (see the module's
    docstring). Every argument is checked as it is given (a `TypeError` or `ValueError`
    naming it): the timeouts are finite seconds, more than 0 and at most
    `_args.MAX_SECONDS`, since a deadline goes into the ledger that every engine reads.

    `asks` are its latest asks and their answers (`Ask`: asked and got, in bytes and blocks,
    and the wait from the first waiting request to the memory mapped)."""

    def __init__(
        self,
        pool: Pool | str,
        name: str,
        cache: PoolCache,
        *,
        min_blocks: int | None = None,
        max_blocks: int | None = None,
        min_bytes: int | None = None,
        max_bytes: int | None = None,
        free_tail_blocks: Callable[[], int] | None = None,
        on_resize: Callable[[int], None] | None = None,
        free_bytes: Callable[[], int] | None = None,
        zero: bool = True,
        move: bool = False,
        answer_timeout_s: float = 1.0,
        take_timeout_s: float = 1.0,
        give_back_idle_s: float | None = GIVE_BACK_IDLE_S,
        commit_step_blocks: int | None = None,
        stream: int | None = None,
        via: str = "loan",
    ) -> None:
        if via not in VIAS:
            raise ValueError(f"via must be one of {', '.join(map(repr, VIAS))}, not {via!r}")
        self.via = via
        if not isinstance(pool, Pool | str):
            raise TypeError(f"pool must be a Pool or a pool's name, not {type(pool).__name__}")
        self.pool = Pool(pool) if isinstance(pool, str) else pool
        self.name = check_name(name, "engine name")
        self.cache = cache
        if cache.legacy:
            raise ValueError("a pool member's cache cannot be legacy (plain torch memory)")
        self._shape = cache.shape()
        self._limits(min_blocks, max_blocks, min_bytes, max_bytes)
        device = check_device(self._shape.device, "the cache's device")
        self.hooks = recognise(
            cache,
            device_free_bytes(device),
            free_tail_blocks=free_tail_blocks,
            on_resize=on_resize,
            free_bytes=free_bytes,
        )
        self.move = _args.flag(move, "move")
        if self.move and not self.hooks.moves:
            raise ValueError(
                "move=True needs a cache that moves live blocks down (free_blocks() and "
                "move_below(num_blocks), as transformers' pooled cache has): an "
                "ExtensibleKVCache's block tables are its engine's, so it lends free top "
                "blocks only"
            )
        if via == "loan" and not all(t.export_handle_types & 1 for t in cache.buffers):
            raise ValueError(
                "a pool member lends and borrows blocks as POSIX fds: create its cache with "
                "export_handle_types='posix_fd' (or join with via='driver')"
            )
        self.zero = _args.flag(zero, "zero")
        self.answer_timeout_s = _args.duration(answer_timeout_s, "answer_timeout_s")
        self.take_timeout_s = _args.duration(take_timeout_s, "take_timeout_s")
        self.give_back_idle_s = (
            None
            if give_back_idle_s is None
            else _args.duration(give_back_idle_s, "give_back_idle_s", zero=True)
        )
        self.commit_step_blocks = _args.optional_size(
            commit_step_blocks, "commit_step_blocks", minimum=1
        )
        self.stream = stream
        self.busy = False
        self._notes = Notes()
        self._asks = AskLog(self.name, self._shape.block_bytes())
        self._serving = 0
        self._post_failure = None
        self._refusals = 0
        self._last_plan = []
        self._refused = {}
        self._warned = set()
        self._exported_at = -1
        self._settling = False
        self._fd_server = None
        self._seen = self._posted = None
        self._beat_at = 0.0
        self._idle_since: float | None = time.monotonic()

    def _limits(
        self,
        min_blocks: int | None,
        max_blocks: int | None,
        min_bytes: int | None,
        max_bytes: int | None,
    ) -> None:
        capacity = self.cache.capacity_blocks
        probe = Engine(self.name, 1, 0, self._shape, 0, capacity, capacity)
        low, high = rules.limits_in_blocks(
            probe, min_blocks, max_blocks, min_bytes=min_bytes, max_bytes=max_bytes
        )
        self.min_blocks = 0 if low is None else low
        self.max_blocks = capacity if high is None else high
        if self.max_blocks > capacity:
            bb = self._shape.block_bytes()
            raise ValueError(
                f"max_blocks {self.max_blocks} is more than the cache's capacity "
                f"({capacity} blocks, {capacity * bb} B)"
            )

    @property
    def shape(self) -> CacheShape:
        """Its cache's shape, as the ledger records it."""
        return self._shape

    @property
    def block_bytes(self) -> int:
        return self._shape.block_bytes()

    @property
    def asking(self) -> bool:
        """Whether an ask of its own is open: memory for it is on its way (`serve` takes
        it)."""
        return self._asks.open

    @property
    def asks(self) -> list[Ask]:
        """Its latest asks (up to `extensible_kv.pool.asks.ASKS_KEPT`), oldest first."""
        return list(self._asks.closed)

    # ---------------------------------------------------------------------------------------
    # joining and leaving

    def join(self) -> None:
        """Enters the pool (a `ValueError` if a live engine has the name)."""
        engine = Engine(
            name=self.name,
            pid=os.getpid(),
            start_time=_proc.own_start_time(),
            shape=self._shape,
            min_blocks=self.min_blocks,
            max_blocks=self.max_blocks,
            capacity_blocks=self.cache.capacity_blocks,
        )
        with self._transaction() as ledger:
            rules.join(ledger, engine, self.pool.clock())
            self._record(ledger)
        if self.via == "loan":
            self._listen(engine)

    def settle(self, timeout_s: float = 10.0) -> None:
        """Ends every loan of this engine: gives back what it borrowed (the engine must not use
        those blocks any more), refuses what it was asked, withdraws its own requests, and
        recalls and reclaims what it lent, waiting up to `timeout_s` (finite, >= 0) for the
        borrowers (who must `serve`). Past the timeout, a `TimeoutError`; a Ctrl-C ends the
        wait with a `KeyboardInterrupt`, each loan as it stands (the ledger says so)."""
        self._settle(_args.duration(timeout_s, "timeout_s", zero=True), leave=False)

    def leave(self, timeout_s: float = 10.0) -> None:
        """`settle`, then leaves the pool in the same transaction that finds no loan left."""
        self._settle(_args.duration(timeout_s, "timeout_s", zero=True), leave=True)
        if self._fd_server is not None:
            self._fd_server.close()
            self._fd_server = None

    def _settle(self, timeout_s: float, *, leave: bool) -> None:
        self._settling = True
        try:
            self._settle_rounds(timeout_s, leave)
        finally:
            self._settling = False

    def _settle_rounds(self, timeout_s: float, leave: bool) -> None:
        deadline = time.monotonic() + timeout_s
        why = f"{self.name} {'leaves' if leave else 'settles'}"
        while True:
            with self._transaction() as ledger:
                now = self.pool.clock()
                for loan in ledger.loans_of(self.name):
                    state = LoanState(loan.state)
                    if state == LoanState.ASKED and loan.lender == self.name:
                        rules.refuse(ledger, loan.loan_id, why, now)
                    elif state == LoanState.ASKED or state.ended:
                        rules.withdraw(ledger, loan.loan_id, why, now)  # a request of its own
                    elif loan.lender == self.name:
                        rules.recall(ledger, loan.loan_id, why, now)
                        rules.end_offer(ledger, loan.loan_id, why, now)
                if all(LoanState(loan.state).ended for loan in ledger.loans_of(self.name)):
                    if leave:
                        rules.leave(ledger, self.name, now, force=True)
                    return
                borrowed = [
                    loan
                    for loan in ledger.loans_of(self.name)
                    if loan.borrower == self.name and loan.state == LoanState.BORROWED
                ]
            for loan in sorted(borrowed, key=lambda loan: -loan.start_block):
                self._give_back(loan, why)
            self.serve()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{why}, but loans were still in flight after {timeout_s} s")
            time.sleep(0.002)

    # ---------------------------------------------------------------------------------------
    # asking

    def request(self, blocks: int, *, since: float | None = None) -> list[Decision]:
        """Plans how to get `blocks` more of its blocks (what its waiting requests need:
        prompt plus new tokens; up to its maximum) and starts it without waiting: commits
        what the device has free and asks every donor for the rest in the same round (answered
        at their `serve`), or recalls its own loans. `since` (the pool's clock,
        `time.monotonic()` by default) is when the first of those requests began to wait: an
        ask's wait runs from there (default: now). Returns the decisions (each logged with
        its reason)."""
        blocks = _args.size(blocks, "blocks", maximum=rules.MAX_BLOCKS)
        since = self._since(since)
        if self._idle_since is not None:
            # Asking is activity: what it borrows is for requests waiting now, not to go
            # back at once (an idle engine waiting for memory is no idle borrower).
            self._idle_since = time.monotonic()
        steps: dict[Action, Callable[[Ledger, Decision, float], None]] = {
            Action.COMMIT: self._count_commit,
            Action.ASK: self._post_ask,
            Action.RECALL: self._post_recall,
            Action.WAIT: _nothing,
        }
        with self._transaction() as ledger:
            now = self.pool.clock()
            self._record(ledger)
            committed = self.cache.committed_blocks
            top = rules.engine(ledger, self.name).max_blocks
            self._asks.asked(committed, min(committed + blocks, top), since)
            refused = [name for name, until in self._refused.items() if until > now]
            decisions = plan_grow(
                ledger,
                self.name,
                blocks,
                free_bytes=self.hooks.free_bytes(),
                now=now,
                exclude=refused,
            )
            for decision in decisions:
                steps[decision.action](ledger, decision, now)
        self._log_plan(decisions)
        commit = sum(d.blocks for d in decisions if d.action == Action.COMMIT)
        if commit:
            self._commit(commit)
        with self._transaction() as ledger:  # what was counted ahead becomes what is
            self._record(ledger)
            in_flight = self._in_flight(ledger)
        self._asks.settle(self.cache.committed_blocks, in_flight, self.pool.clock())
        return decisions

    def request_bytes(self, num_bytes: int, *, since: float | None = None) -> list[Decision]:
        """`request` for the fewest of its blocks that hold `num_bytes`."""
        num_bytes = _args.size(num_bytes, "num_bytes", maximum=rules.MAX_BLOCKS)
        return self.request(-(-num_bytes // self.block_bytes), since=since)

    def grow(self, blocks: int, timeout_s: float = 5.0, *, since: float | None = None) -> int:
        """Asks for `blocks` more blocks (as `request`) and serves until it has them or
        `timeout_s` (finite, >= 0) passed; returns the committed blocks (its caller checks
        whether that is enough). A Ctrl-C ends the wait with a `KeyboardInterrupt`."""
        blocks = _args.size(blocks, "blocks", maximum=rules.MAX_BLOCKS)
        timeout_s = _args.duration(timeout_s, "timeout_s", zero=True)
        since = self._since(since)
        target = self.cache.committed_blocks + blocks
        with self._transaction() as ledger:  # the limits may have changed since it joined
            target = min(target, rules.engine(ledger, self.name).max_blocks)
        deadline = time.monotonic() + timeout_s
        ask_at = 0.0
        while self.cache.committed_blocks < target:
            # Asked again only once its ask closed (what is on its way, `serve` takes), and
            # then at most every `ASK_AGAIN_S`: an ask that found nothing is planned again
            # when others may have changed what they hold, not at every round.
            now = time.monotonic()
            if not self._asks.open and now >= ask_at:
                self.request(target - self.cache.committed_blocks, since=since)
                ask_at = now + ASK_AGAIN_S
            self.serve()
            if self.cache.committed_blocks >= target or time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        return self.cache.committed_blocks

    def _since(self, since: float | None) -> float:
        if since is None:
            return self.pool.clock()
        return _args.duration(since, "since", zero=True, maximum=MAX_TIME)

    def _count_commit(self, ledger: Ledger, decision: Decision, now: float) -> None:
        rules.commit_ahead(ledger, self.name, decision.blocks)

    def _post_ask(self, ledger: Ledger, decision: Decision, now: float) -> None:
        deadline = now + self.answer_timeout_s
        rules.ask(ledger, self.name, decision.peer, decision.blocks, deadline, now, decision.reason)

    def _post_recall(self, ledger: Ledger, decision: Decision, now: float) -> None:
        loan = ledger.loans.get(decision.loan_id)
        by = "" if loan is None or loan.lender == self.name else self.name
        rules.recall(ledger, decision.loan_id, decision.reason, now, by=by)

    def _commit(self, blocks: int) -> None:
        """Commits `blocks` of the device's free memory (counted ahead in the ledger), in
        `commit_step_blocks` steps."""
        before = self.cache.committed_blocks
        target = before + blocks
        step = self.commit_step_blocks or blocks
        try:
            while self.cache.committed_blocks < target:
                last = self.cache.committed_blocks
                self.cache.commit(min(last + step, target))
                if self.cache.committed_blocks <= last:
                    # A cache may commit whole granules only (transformers' pooled one does,
                    # so that a borrow maps at a boundary): the device's free memory left
                    # less than one. Calling again would never end.
                    break
        except OutOfMemoryError as error:
            logger.info("pool: %s could not commit %d blocks: %s", self.name, blocks, error)
        finally:
            self._resized()  # the engine learns its size even if the post below fails
            grown = self.cache.committed_blocks - before
            if grown > 0:
                self._asks.mapped(self.pool.clock(), committed=grown)

    def _in_flight(self, ledger: Ledger) -> bool:
        """Whether memory for this engine's open ask is on its way: a request to a donor
        asked or offered, one answered through the driver not read yet, or a loan of its own
        recalled or given back, not reclaimed yet."""
        for loan in ledger.loans_of(self.name):
            if loan.borrower == self.name and loan.state in _COMING:
                return True
            if loan.lender == self.name and (loan.state == LoanState.RETURNED or loan.recall):
                return True
        return False

    # ---------------------------------------------------------------------------------------
    # serving: the heartbeat, and everything others asked of this engine

    def serve(self, busy: bool | None = None) -> None:
        """The heartbeat (`busy`, if given, is what `pool status` shows, and donors that are
        idle are asked first), and one round of work: reclaim what borrowers gave back, take
        back offers not taken in time, answer requests, borrow what was offered, give back
        what was recalled or lies past the maximum."""
        if busy is not None:
            busy = _args.flag(busy, "busy")
            if self.busy or busy:
                self._idle_since = None if busy else time.monotonic()
            self.busy = busy
        self._serving += 1
        try:
            if self._quiet():
                self._send_fds()
                self._export_ahead()
                return
            self._serve()
        except PostFailed as failed:
            self._failed_post(failed.__cause__ or failed)
            return
        finally:
            self._serving -= 1
        if self._post_failure is not None:
            logger.warning("pool: %s reaches the ledger again", self.name)
            self._post_failure = None

    def _failed_post(self, error: BaseException) -> None:
        """A transaction of `serve()` failed: left to the next one, whose reconciliation posts
        what moved meanwhile. Warned once a streak (the engine serves often)."""
        text = f"{type(error).__name__}: {error}"
        if self._post_failure is None:
            logger.warning(
                "pool: %s could not use the ledger (%s); what its cache moved is posted at its "
                "next transaction",
                self.name,
                text,
            )
        else:
            logger.debug("pool: %s still cannot use the ledger: %s", self.name, text)
        self._post_failure = text

    def _serve(self) -> None:
        self._send_fds()
        released = False  # a donor released memory to the driver for this engine
        with self._transaction() as ledger:
            now = self.pool.clock()
            self._record(ledger)
            for loan in ledger.loans_of(self.name):
                if loan.borrower == self.name and LoanState(loan.state).ended:
                    if loan.state == LoanState.RELEASED:
                        released = True
                    else:  # not asked again at once: its blocks are live (or it is stuck)
                        self._refused[loan.lender] = now + self.answer_timeout_s
                    rules.withdraw(ledger, loan.loan_id, "", now)
            to_reclaim = self._reclaimable(ledger, now)
            if not to_reclaim:
                lends, to_take = self._work(ledger)
        if to_reclaim:
            for loan in to_reclaim:
                # A returned loan's handles are back, or its borrower is dead; an offer past
                # its deadline is untaken (closed at once) or taken meanwhile (then it stops
                # here, and the older loans wait their turn). Never waited on: one not back
                # yet is tried again at the next serve.
                if not self._reclaim(loan):
                    break
            with self._transaction() as ledger:  # answers planned on the cache as it is
                self._record(ledger)
                lends, to_take = self._work(ledger)
        for decision in lends:
            self._lend(decision)
        for loan in sorted(to_take, key=lambda loan: loan.loan_id):
            self._take(loan)
        with self._transaction() as ledger:  # after the takes: a give-back sees them
            given = plan_release(
                ledger, self.name, spare_blocks=self._spare_blocks(), idle_s=self._idle_for()
            )
            in_flight = self._in_flight(ledger)
        for decision in given:
            self._give_back_or_shrink(decision)
        wanted = self._asks.wanted(self.cache.committed_blocks)
        if released and wanted:  # the driver has it now: committed at once
            self.request(wanted, since=self._asks.since)
        else:
            self._asks.settle(self.cache.committed_blocks, in_flight, self.pool.clock())
        if not (to_reclaim or lends or to_take or given or released):
            self._export_ahead()

    def _work(self, ledger: Ledger) -> tuple[list[Decision], list[PoolLoan]]:
        """Requests to answer (lends planned) and offers to take."""
        mine = ledger.loans_of(self.name)
        asked = [
            loan for loan in mine if loan.lender == self.name and loan.state == LoanState.ASKED
        ]
        offered = [
            loan
            for loan in mine
            if loan.borrower == self.name
            and loan.state == LoanState.OFFERED
            and loan.loan_id not in self._notes.borrowed
        ]
        return self._answer(ledger, asked), offered


# A request whose memory is on its way to its borrower.
_COMING = (LoanState.ASKED, LoanState.OFFERED, LoanState.RELEASED)


def _nothing(ledger: Ledger, decision: Decision, now: float) -> None:
    """A plan's `wait`: nothing to post."""
