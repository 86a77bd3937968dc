"""An engine's side of the pool: `PoolMember` joins, heartbeats, asks for blocks and, as a
donor, lends whole blocks of its cache (a `PoolCache`: an `ExtensibleKVCache`, or
transformers' cache through `extensible_kv.transformers`).

No daemon: requests and answers go through the ledger itself. A needy engine posts a request
(`asked`) to each donor the policy picks; the donor, at its next `serve()`, lends its free top
blocks (`ExtensibleKVCache.lend`) and posts the `Loan`s in the entry (`offered`); the borrower,
at its next `serve()`, borrows them (the fds are taken from the lender by pid, as
`extensible_kv.ipc` does) and posts `borrowed`. Giving back and reclaiming go the same way. The
memory moves outside the pool's lock; each outcome is posted in the next transaction, together
with the engine's own numbers, so the ledger is consistent between any two transactions.

A post can fail after the memory moved (the lock held too long by another process, a full
`/dev/shm`, a corrupt ledger), and a Ctrl-C can fall between the two. So the member's own
cache is the truth: right after each move, before any post, the member notes what it moved
(the loans it lent, by loan id, with their `Loan`s; the loans it borrowed, with where they
begin), and every transaction it runs starts by bringing the ledger's entries for this engine
in line with that record (`PoolMember._reconcile`, through the rules: an offer, a take, a
give-back or a reclaim posted late; a lend whose request ended meanwhile is returned to be
reclaimed). A failed post inside `serve()` is logged and left to the next transaction; an
explicit call (`grow`, `request`, `settle`, `leave`) raises, and its move is reconciled all
the same. A Ctrl-C during a move is held until the move and its note are done; every wait
(for the lock, for memory, for borrowers) ends on it.

Call `serve()` from the engine's own thread between its steps, often (it is the heartbeat, and
a donor answers only there): a lend takes blocks away from the cache, which must not happen
while a step uses them. `free_tail_blocks()` says how many top blocks the engine does not use
now; the engine learns the cache's new size from `on_resize(committed_blocks)`.

`via="driver"` moves memory as kvcached does, for comparison: a donor answers a request by
giving its free top blocks back to the driver (`shrink_to`, then `wait_released`), and the
needy engine commits them from the device's free memory (a create, after the driver's scrub).
Same ledger, policy and log; only the donor's answer differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from extensible_kv import _args
from extensible_kv._native import LoanTimeoutError, OutOfMemoryError, PtraceRefusedError
from extensible_kv.flow import ExtendableCache
from extensible_kv.ipc import Loan, send_shared
from extensible_kv.pool import _proc, fds, rules
from extensible_kv.pool.ledger import (
    MAX_LAYOUT,
    Engine,
    Ledger,
    LedgerCorruptError,
    LoanEntry,
    check_device,
    check_name,
)
from extensible_kv.pool.policy import Decision, plan_answer, plan_grow, plan_release
from extensible_kv.pool.store import Pool, PoolLockTimeout

if TYPE_CHECKING:
    from extensible_kv.tensor import ExtensibleTensor

logger = logging.getLogger("extensible_kv.pool")

__all__ = ["VIAS", "MovingCache", "PoolCache", "PoolMember"]

# How a donor's memory reaches a needy engine: as a loan of its handles, or through the driver
# (released, then created again by the needy engine).
VIAS = ("loan", "driver")

# Handles a buffer exports ahead of a loan in one idle `serve()` (`PoolMember._export_ahead`).
EXPORT_AHEAD_HANDLES = 4
# How long a shrink through the driver waits for its memory to be the driver's, in slices
# that a Ctrl-C ends, before it posts anyway (the release thread is late, not lost).
RELEASE_WAIT_S = 10.0
# How long the reclaim of a returned loan may look for its borrower's death (the board sees a
# give-back at once, a dead borrower only through its pidfd, a poll of a few ms): long enough
# for that, short enough that a loan the ledger says is back and is not never stalls a serve.
RECLAIM_LOOK_S = 0.01
# Socket peers refused with a warning; the rest at debug level (a stranger may knock often).
REFUSALS_WARNED = 16
# What failing to use the ledger raises: the lock held too long, the file system (a full
# /dev/shm, a file in the wrong hands), the ledger unreadable.
_STORE_FAILURES = (PoolLockTimeout, LedgerCorruptError, OSError)


@dataclasses.dataclass(frozen=True)
class _Lent:
    """A loan this engine lent and has not reclaimed: what its cache holds out."""

    loans: tuple[Loan, ...]
    kept_blocks: int
    blocks: int
    num_bytes: int
    native: list[list[Any]]  # the loans as the ledger keeps them


@dataclasses.dataclass(frozen=True)
class _Borrowed:
    """A loan this engine borrowed and has not given back: what its cache maps of another."""

    entry: LoanEntry
    start_block: int


class _PostFailed(Exception):
    """Inside `serve()`: the ledger could not be used; what moved is posted later."""


class PoolCache(ExtendableCache, Protocol):
    """What `PoolMember` drives: a cache the flow drives (`ExtendableCache`) whose buffers are
    each an `ExtensibleTensor` of `num_segments` segments that grow by `segment_block_bytes` a
    block, whose `footprint().leading_blocks` blocks sit below block 0 in every segment
    (transformers' trash sectors; none in an `ExtensibleKVCache`). It also shrinks, lends,
    borrows, gives back and reclaims whole blocks as `ExtensibleKVCache` does, which is one;
    `extensible_kv.transformers` adapts transformers' cache to it."""

    @property
    def buffers(self) -> tuple[ExtensibleTensor, ...]: ...
    @property
    def num_segments(self) -> tuple[int, ...]: ...
    @property
    def segment_block_bytes(self) -> tuple[int, ...]: ...
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
    """A `PoolCache` that moves live blocks down, for a member with `move=True`:
    `free_blocks()` counts its committed blocks no request holds, wherever they lie, and
    `move_below(num_blocks)` copies every live block at or past `num_blocks` into a free one
    below it and renames it in the engine's books (a `RuntimeError` when too few are free
    there, and nothing moved), between the engine's steps. transformers' pooled cache is one:
    its block tables are ours to rename. An `ExtensibleKVCache`'s are its engine's."""

    def free_blocks(self) -> int: ...
    def move_below(self, num_blocks: int) -> None: ...


class PoolMember:
    """Engine `name` of `pool` (a `Pool`, or a pool name), over `cache` (a `PoolCache`),
    created with `export_handle_types="posix_fd"` (loans travel as POSIX fds) unless `via` is
    `"driver"`.

    `min_blocks` it never lends below; `max_blocks` it never grows past (at most the cache's
    capacity). `free_tail_blocks()` returns how many of its top committed blocks it does not
    use now; `on_resize(committed_blocks)` is called after every change of the cache's size.
    `free_bytes()` measures the device's free memory (default: the host's for `cpu`, CUDA's
    for `cuda:N`). `zero` zeroes what it borrows and reclaims (across tenants). A request to a
    donor that does not answer within `answer_timeout_s` expires (the donor is then stuck, and
    not asked again until it heartbeats); a loan offered and not taken within
    `take_timeout_s` is taken back. A loan is whole physical handles: `commit_step_blocks`
    commits free memory in steps of that many blocks, so that each step's handles can be lent
    on their own later (a CUDA cache's handles are at most 1 GiB anyway). `move=True` lends
    free blocks wherever they lie: the live blocks above the cut are moved down first (the
    cache must be a `MovingCache`, a `ValueError` otherwise), and so does a borrower before a
    loan goes back: a recalled loan goes back at once if the blocks below it can hold what
    is live in it. `via` is how it answers a request as a donor: `"loan"` lends its free top
    blocks' handles, `"driver"` gives them back to the driver for the needy engine to commit
    (see the module's docstring). Every argument is checked as it is given (a `TypeError` or
    `ValueError` naming it): the timeouts are finite seconds, more than 0 and at most
    `_args.MAX_SECONDS`, since a deadline goes into the ledger that every engine reads."""

    def __init__(
        self,
        pool: Pool | str,
        name: str,
        cache: PoolCache,
        *,
        min_blocks: int,
        max_blocks: int,
        free_tail_blocks: Callable[[], int],
        on_resize: Callable[[int], None] | None = None,
        free_bytes: Callable[[], int] | None = None,
        zero: bool = True,
        move: bool = False,
        answer_timeout_s: float = 1.0,
        take_timeout_s: float = 1.0,
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
        self.min_blocks = _args.size(min_blocks, "min_blocks", maximum=rules.MAX_BLOCKS)
        self.max_blocks = _args.size(max_blocks, "max_blocks", maximum=rules.MAX_BLOCKS)
        if self.max_blocks > cache.capacity_blocks:
            raise ValueError(
                f"max_blocks {self.max_blocks} is more than the cache's capacity "
                f"({cache.capacity_blocks} blocks)"
            )
        self.move = _args.flag(move, "move")
        if self.move and not _moves(cache):
            raise ValueError(
                "move=True needs a cache that moves live blocks down (free_blocks() and "
                "move_below(num_blocks), as transformers' pooled cache has): an "
                "ExtensibleKVCache's block tables are its engine's, so it lends free top "
                "blocks only"
            )
        if cache.legacy:
            raise ValueError("a pool member's cache cannot be legacy (plain torch memory)")
        if via == "loan" and not all(t.export_handle_types & 1 for t in cache.buffers):
            raise ValueError(
                "a pool member lends and borrows blocks as POSIX fds: create its cache with "
                "export_handle_types='posix_fd' (or join with via='driver')"
            )
        for what, function in [
            ("free_tail_blocks", free_tail_blocks),
            ("on_resize", on_resize),
            ("free_bytes", free_bytes),
        ]:
            if function is not None and not callable(function):
                raise TypeError(f"{what} must be callable, not {type(function).__name__}")
        if not callable(free_tail_blocks):
            raise TypeError("free_tail_blocks must be callable, not None")
        self.free_tail_blocks = free_tail_blocks
        self.on_resize = on_resize
        device = check_device(str(cache.buffers[0].device), "the cache's device")
        self.free_bytes = free_bytes or _device_free_bytes(device)
        self.zero = _args.flag(zero, "zero")
        self.answer_timeout_s = _args.duration(answer_timeout_s, "answer_timeout_s")
        self.take_timeout_s = _args.duration(take_timeout_s, "take_timeout_s")
        self.commit_step_blocks = _args.optional_size(
            commit_step_blocks, "commit_step_blocks", minimum=1
        )
        self.stream = stream
        self.busy = False
        # What this engine's cache holds out and holds of others, noted right after each move
        # and before its post: the truth that `_reconcile` brings the ledger in line with.
        self._lent: dict[int, _Lent] = {}
        self._borrowed: dict[int, _Borrowed] = {}
        self._gave_back: dict[int, str] = {}  # loan id -> why, until the ledger says so
        self._released: dict[int, int] = {}  # request -> blocks given to the driver for it
        self._serving = 0  # serve() calls in progress: a failed post is logged there
        self._post_failure: str | None = None  # the last failed post's error, while failing
        self._refusals = 0  # socket peers refused so far
        self._last_plan: list[tuple[str, str, int]] = []
        self._refused: dict[str, float] = {}  # donor -> when it may be asked again
        self._warned: set[str] = set()  # lenders whose loan this engine could not borrow
        self._exported_at = -1  # the committed blocks when every handle was last exported
        self._settling = False
        self._fd_server: fds.FdServer | None = None  # where borrowers refused by pid ask

    # ---------------------------------------------------------------------------------------
    # joining and leaving

    def join(self) -> None:
        """Enters the pool (a `ValueError` if a live engine has the name)."""
        cache = self.cache
        engine = Engine(
            name=self.name,
            pid=os.getpid(),
            start_time=_proc.own_start_time(),
            device=str(cache.buffers[0].device),
            layout=_layout(cache),
            block_bytes=sum(
                n * b for n, b in zip(cache.num_segments, cache.segment_block_bytes, strict=True)
            ),
            min_blocks=self.min_blocks,
            max_blocks=self.max_blocks,
            capacity_blocks=cache.capacity_blocks,
        )
        with self._transaction() as ledger:
            rules.join(ledger, engine, self.pool.clock())
            self._record(ledger)
        if self.via == "loan":
            self._listen(engine)

    def _listen(self, engine: Engine) -> None:
        """Opens the socket where a borrower that may not take this engine's fds by pid asks
        for them (`fds`); without it, such a borrower cannot borrow from this engine."""
        name = fds.address(self.pool.path, engine.name, engine.pid, engine.start_time)
        try:
            self._fd_server = fds.FdServer(name)
        except OSError as error:
            logger.warning(
                "pool: %s lends by pid only (its fd socket: %s): a borrower that may not "
                "trace this process cannot borrow from it",
                self.name,
                error,
            )

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
                    if loan.state == "asked" and loan.lender == self.name:
                        rules.refuse(ledger, loan.loan_id, why, now)
                    elif loan.state in ("asked", "refused", "expired"):
                        rules.withdraw(ledger, loan.loan_id, why, now)  # a request of its own
                    elif loan.lender == self.name:
                        rules.recall(ledger, loan.loan_id, why, now)
                        rules.end_offer(ledger, loan.loan_id, why, now)
                if not any(
                    loan.state not in ("refused", "expired") for loan in ledger.loans_of(self.name)
                ):
                    if leave:
                        rules.leave(ledger, self.name, now, force=True)
                    return
                borrowed = [
                    loan
                    for loan in ledger.loans_of(self.name)
                    if loan.borrower == self.name and loan.state == "borrowed"
                ]
            for loan in sorted(borrowed, key=lambda loan: -loan.start_block):
                self._give_back(loan, why)
            self.serve()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{why}, but loans were still in flight after {timeout_s} s")
            time.sleep(0.002)

    # ---------------------------------------------------------------------------------------
    # asking

    def request(self, blocks: int) -> list[Decision]:
        """Plans how to get `blocks` more blocks and starts it without waiting: commits what
        the device has free, asks donors (answered at their `serve`), recalls its own loans.
        Returns the decisions (each logged with its reason)."""
        blocks = _args.size(blocks, "blocks", maximum=rules.MAX_BLOCKS)
        commit = 0
        with self._transaction() as ledger:
            now = self.pool.clock()
            self._record(ledger)
            refused = [name for name, until in self._refused.items() if until > now]
            decisions = plan_grow(
                ledger, self.name, blocks, free_bytes=self.free_bytes(), now=now, exclude=refused
            )
            for d in decisions:
                if d.action == "commit":
                    commit = d.blocks
                    rules.commit_ahead(ledger, self.name, commit)
                elif d.action == "ask":
                    rules.ask(
                        ledger,
                        self.name,
                        d.peer,
                        d.blocks,
                        now + self.answer_timeout_s,
                        now,
                        d.reason,
                    )
                elif d.action == "recall":
                    loan = ledger.loans.get(d.loan_id)
                    by = "" if loan is None or loan.lender == self.name else self.name
                    rules.recall(ledger, d.loan_id, d.reason, now, by=by)
        self._log_plan(decisions)
        if commit:
            target = self.cache.committed_blocks + commit
            step = self.commit_step_blocks or commit
            try:
                while self.cache.committed_blocks < target:
                    before = self.cache.committed_blocks
                    self.cache.commit(min(before + step, target))
                    if self.cache.committed_blocks <= before:
                        # A cache may commit whole granules only (transformers' pooled one
                        # does, so that a borrow maps at a boundary): the device's free
                        # memory left less than one. Calling again would never end.
                        break
            except OutOfMemoryError as error:
                logger.info("pool: %s could not commit %d blocks: %s", self.name, commit, error)
            finally:
                self._resized()  # the engine learns its size even if the post below fails
            with self._transaction() as ledger:  # what was counted ahead becomes what is
                self._record(ledger)
        return decisions

    def grow(self, blocks: int, timeout_s: float = 5.0) -> int:
        """Asks for `blocks` more blocks and serves until it has them or `timeout_s` (finite,
        >= 0) passed; returns the committed blocks (its caller checks whether that is enough).
        A Ctrl-C ends the wait with a `KeyboardInterrupt`."""
        blocks = _args.size(blocks, "blocks", maximum=rules.MAX_BLOCKS)
        timeout_s = _args.duration(timeout_s, "timeout_s", zero=True)
        target = self.cache.committed_blocks + blocks
        with self._transaction() as ledger:  # the limits may have changed since it joined
            target = min(target, rules.engine(ledger, self.name).max_blocks)
        deadline = time.monotonic() + timeout_s
        while self.cache.committed_blocks < target:
            self.request(target - self.cache.committed_blocks)
            self.serve()
            if self.cache.committed_blocks >= target or time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        return self.cache.committed_blocks

    # ---------------------------------------------------------------------------------------
    # serving: the heartbeat, and everything others asked of this engine

    def serve(self, busy: bool | None = None) -> None:
        """The heartbeat (`busy`, if given, is what `pool status` shows, and donors that are
        idle are asked first), and one round of work: reclaim what borrowers gave back, take
        back offers not taken in time, answer requests, borrow what was offered, give back
        what was recalled or lies past the maximum."""
        if busy is not None:
            self.busy = _args.flag(busy, "busy")
        self._serving += 1
        try:
            self._serve()
        except _PostFailed as failed:
            self._failed_post(failed.__cause__ or failed)
            return
        finally:
            self._serving -= 1
        if self._post_failure is not None:
            logger.warning("pool: %s reaches the ledger again", self.name)
            self._post_failure = None

    def _failed_post(self, error: BaseException) -> None:
        """A transaction of `serve()` failed: left to the next one, whose `_reconcile` posts
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
        with self._transaction() as ledger:
            now = self.pool.clock()
            self._record(ledger)
            for loan in ledger.loans_of(self.name):
                if loan.borrower == self.name and loan.state in ("refused", "expired"):
                    # Not asked again at once: its blocks are live (or it is stuck).
                    self._refused[loan.lender] = now + self.answer_timeout_s
                    rules.forget(ledger, loan.loan_id)
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
            released = plan_release(ledger, self.name, free_tail_blocks=self._free_top())
        for decision in released:
            self._release(decision)
        if not (to_reclaim or lends or to_take or released):
            self._export_ahead()

    def _send_fds(self) -> None:
        """Answers the borrowers that asked on this engine's socket: a loan's fds go only to
        the process the ledger names as its borrower, and only while it is on offer. Never
        waits: any other process's connection is closed at once, before anything is read."""
        if self._fd_server is None:
            return
        offered: dict[int, dict[int, LoanEntry]] = {}  # borrower's pid -> its loans on offer

        def peers() -> dict[int, dict[int, LoanEntry]]:
            with self._transaction() as ledger:
                for loan in ledger.loans.values():
                    borrower = ledger.engines.get(loan.borrower)
                    if loan.lender == self.name and loan.state == "offered" and borrower:
                        offered.setdefault(borrower.pid, {})[loan.loan_id] = loan
            return offered

        for conn, pid, loan_id in self._fd_server.requests(peers, self._refused_peer):
            with conn:
                entry = offered.get(pid, {}).get(loan_id)
                if entry is None:
                    self._refused_peer(pid, f"loan {loan_id} is not on offer to it")
                    continue
                try:
                    for loan in _loans(entry):
                        send_shared(conn, loan)
                except (OSError, ValueError) as error:  # gone meanwhile, or stale
                    logger.warning(
                        "pool: %s could not send loan %d's fds: %s", self.name, loan_id, error
                    )

    def _refused_peer(self, pid: int, why: str = "") -> None:
        self._refusals += 1
        level = logging.WARNING if self._refusals <= REFUSALS_WARNED else logging.DEBUG
        logger.log(
            level,
            "pool: %s refuses process %d on its socket: %s",
            self.name,
            pid,
            why or "it is not the borrower of a loan this engine has on offer",
        )

    def _export_ahead(self) -> None:
        """With nothing else to do: exports a few of the cache's handles ahead of a loan, the
        top ones first, so that a lend only unmaps (a first loan of 60 GiB spent half of its
        ~60 ms exporting 60 handles, ~0.5 ms each on CUDA). A few a round keep each call to
        ~2 ms; a failed export (out of fds, say) is left to the lend, which reports it."""
        committed = self.cache.committed_blocks
        if self.via != "loan" or committed == self._exported_at:
            return
        try:
            left = sum(t._export_ahead(EXPORT_AHEAD_HANDLES) for t in self.cache.buffers)
        except Exception as error:  # an optimization: serving goes on without it
            logger.warning("%s: not exporting ahead of loans: %s", self.name, error)
            left = 0
        if not left:
            self._exported_at = committed

    def _reclaimable(self, ledger: Ledger, now: float) -> list[LoanEntry]:
        """The loans it lent that it can take back now, newest first (the fewest blocks kept:
        its cache grows back contiguously only in that order), up to the first it cannot."""
        lent = sorted(
            (
                loan
                for loan in ledger.loans_of(self.name)
                if loan.lender == self.name and loan.state in ("offered", "borrowed", "returned")
            ),
            key=lambda loan: loan.kept_blocks,
        )
        ready = []
        for loan in lent:
            if not (loan.state == "returned" or (loan.state == "offered" and loan.deadline < now)):
                break
            ready.append(loan)
        return ready

    def _work(self, ledger: Ledger) -> tuple[list[Decision], list[LoanEntry]]:
        """Requests to answer (lends planned) and offers to take."""
        mine = ledger.loans_of(self.name)
        asked = [loan for loan in mine if loan.lender == self.name and loan.state == "asked"]
        offered = [
            loan
            for loan in mine
            if loan.borrower == self.name
            and loan.state == "offered"
            and loan.loan_id not in self._borrowed
        ]
        return self._answer(ledger, asked), offered

    def _answer(self, ledger: Ledger, asked: list[LoanEntry]) -> list[Decision]:
        lends = []
        free_tail = self._free_tail()
        free = self._free_anywhere() if asked else None
        points = _lend_points(self.cache) if asked else set()
        for loan in sorted(asked, key=lambda loan: loan.loan_id):
            if self._settling:
                rules.refuse(ledger, loan.loan_id, f"{self.name} is settling", self.pool.clock())
                continue
            decision = plan_answer(
                ledger,
                self.name,
                loan.loan_id,
                free_tail_blocks=free_tail,
                lend_points=points,
                free_blocks=free,
            )
            if decision.action == "lend" and self.via == "driver":
                why = f"{decision.reason}; released to the driver, not lent"
                decision = dataclasses.replace(decision, action="release", reason=why)
            self._log(decision)
            if decision.action == "refuse":
                rules.refuse(ledger, loan.loan_id, decision.reason, self.pool.clock())
                continue
            lends.append(decision)
            free_tail = max(0, free_tail - decision.blocks)
            if free is not None:
                free -= decision.blocks
            rules.lend_ahead(ledger, self.name, decision.blocks)  # what the next answer sees
        return lends

    def _lend(self, decision: Decision) -> None:
        if self.via == "driver":
            self._release_for(decision)
            return
        keep = self.cache.committed_blocks - decision.blocks
        try:
            self._clear_past(keep)
            with _uninterrupted():
                loans = self.cache.lend(keep, stream=self.stream)
                self._lent[decision.loan_id] = _Lent(
                    tuple(loans),
                    keep,
                    _loan_blocks(self.cache, loans[0]),
                    sum(x.num_bytes for x in loans),
                    [list(_jsonable(loan._to_native())) for loan in loans],
                )
        except (ValueError, RuntimeError) as error:  # a straddling handle past `keep`, say
            with self._transaction() as ledger:
                rules.refuse(ledger, decision.loan_id, f"cannot lend: {error}", self.pool.clock())
                self._record(ledger)
            return
        self._resized()
        with self._transaction() as ledger:  # `_reconcile` offers it
            self._record(ledger)
            entry = ledger.loans.get(decision.loan_id)
        if entry is not None and entry.state == "returned":
            # The request ended meanwhile (expired, or the borrower is gone): never taken,
            # so back at once.
            self._reclaim(entry)

    def _release_for(self, decision: Decision) -> None:
        """`via="driver"`'s answer: the blocks go back to the driver, and the request ends;
        the needy engine's next request finds them free on the device."""
        keep = self.cache.committed_blocks - decision.blocks
        try:
            self._clear_past(keep)
            with _uninterrupted():
                self.cache.shrink_to(keep)
                self._released[decision.loan_id] = decision.blocks
        except (ValueError, RuntimeError) as error:  # its top blocks are no longer free, say
            with self._transaction() as ledger:
                why = f"cannot release: {error}"
                rules.refuse(ledger, decision.loan_id, why, self.pool.clock())
                self._record(ledger)
            return
        self._released_to_driver()
        with self._transaction() as ledger:  # `_reconcile` posts it released
            self._record(ledger)

    def _clear_past(self, keep: int) -> None:
        """With `move=True`, moves the live blocks at or past `keep` down, if any: before a
        lend or a release, and before a borrowed loan goes back (so that a recalled loan goes
        back at once, however busy the borrower is, if it has free blocks enough below)."""
        if self.move and self._free_tail() < self.cache.committed_blocks - keep:
            cast(MovingCache, self.cache).move_below(keep)

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

    def _reclaim(self, entry: LoanEntry) -> bool:
        """Takes loan `entry` back if its borrower gave it back, died or never took it, and
        posts it; never waits longer than `RECLAIM_LOOK_S`. False while it is still out (the
        borrower posts it)."""
        lent = self._lent.get(entry.loan_id)
        if lent is None:  # reclaimed already: `_reconcile` posts it
            return True
        before = _lent_bytes(self.cache)
        with _uninterrupted():
            try:
                look = RECLAIM_LOOK_S if entry.state == "returned" else 0.0
                self.cache.reclaim(lent.loans, zero=self.zero, timeout=look, stream=self.stream)
            except LoanTimeoutError:
                return False
            except BaseException:
                # All back, then the cache's own step failed: reclaimed. Some buffers back
                # and not the rest: still lent, and the next call takes back the rest.
                if before - _lent_bytes(self.cache) >= lent.num_bytes:
                    del self._lent[entry.loan_id]
                raise
            del self._lent[entry.loan_id]
        self._resized()
        with self._transaction() as ledger:  # `_reconcile` posts it reclaimed
            self._record(ledger)
        return True

    def _take(self, entry: LoanEntry) -> None:
        start = self.cache.committed_blocks
        try:
            try:
                self._borrow(entry, _loans(entry), start)
            except PtraceRefusedError as by_pid:
                if entry.loan_id in self._borrowed:
                    raise
                self._take_over_socket(entry, by_pid, start)
        except (ValueError, OSError) as error:  # stale, foreign, or no room: the lender's again
            if entry.loan_id not in self._borrowed:
                self._could_not_take(entry, error)
                return
            logger.warning(
                "pool: %s borrowed loan %d, then its cache failed: %s",
                self.name,
                entry.loan_id,
                error,
            )
        self._resized()
        with self._transaction() as ledger:  # `_reconcile` posts it borrowed
            self._record(ledger)

    def _borrow(self, entry: LoanEntry, loans: Sequence[Loan], start: int) -> None:
        """Borrows `loans` and notes it; a cache whose own step after the mapping failed has
        borrowed them all the same (its borrowed bytes say so), and that is noted too."""
        before = _borrowed_bytes(self.cache)
        with _uninterrupted():
            try:
                self.cache.borrow(loans, zero=self.zero, stream=self.stream)
            except BaseException:
                if _borrowed_bytes(self.cache) - before >= entry.num_bytes:
                    self._borrowed[entry.loan_id] = _Borrowed(entry, start)
                raise
            self._borrowed[entry.loan_id] = _Borrowed(entry, start)

    def _could_not_take(self, entry: LoanEntry, error: Exception) -> None:
        now = self.pool.clock()
        # Not asked again at once: a lender whose fds this process may not take (ptrace
        # refused: Yama's ptrace_scope, another user, a container without CAP_SYS_PTRACE)
        # would otherwise unmap, lend and reclaim at every step, and nothing would move.
        self._refused[entry.lender] = now + self.answer_timeout_s
        if entry.lender not in self._warned:
            self._warned.add(entry.lender)
            logger.warning(
                "pool: %s could not borrow from %s, and asks it again in %.1f s at the "
                "earliest: %s",
                self.name,
                entry.lender,
                self.answer_timeout_s,
                error,
            )
        with self._transaction() as ledger:
            rules.returned(ledger, entry.loan_id, f"could not borrow: {error}", now)
            self._record(ledger)

    def _take_over_socket(self, entry: LoanEntry, by_pid: Exception, start: int) -> None:
        """The borrow of `entry` with its fds asked of the lender on its socket, after taking
        them by pid failed with `by_pid` (refused where this process may not trace the
        lender; else the socket's answer fails alike). Raises a `ValueError` naming both."""
        with self._transaction() as ledger:
            lender = ledger.engines.get(entry.lender)
        if lender is None:
            raise by_pid
        name = fds.address(self.pool.path, lender.name, lender.pid, lender.start_time)
        expected = _loans(entry)
        try:
            received = fds.fetch(
                name, entry.loan_id, len(expected), self.take_timeout_s, lender_pid=lender.pid
            )
        except (OSError, ValueError, ConnectionError) as error:
            raise ValueError(f"{by_pid}; over {entry.lender}'s socket: {error}") from error
        try:
            if received != expected:
                raise ValueError(
                    f"{by_pid}; over {entry.lender}'s socket came other loans than the ledger's"
                )
            self._borrow(entry, received, start)
        finally:
            fds.close_received(received)
        logger.info(
            "pool: %s took loan %d from %s over its socket (by pid: %s)",
            self.name,
            entry.loan_id,
            entry.lender,
            by_pid,
        )

    def _release(self, decision: Decision) -> None:
        self._log(decision)
        if decision.action == "shrink":
            # At a handle boundary: a cut inside a handle keeps its tail mapped as slack,
            # which a later borrow refuses.
            committed = self.cache.committed_blocks
            target = committed - decision.blocks
            cut = min((k for k in _lend_points(self.cache) if k >= target), default=committed)
            if cut == committed:
                return
            try:
                self._clear_past(cut)
            except RuntimeError as error:  # its blocks were taken meanwhile
                logger.info("pool: %s does not shrink to %d blocks: %s", self.name, cut, error)
                return
            self.cache.shrink_to(cut)
            self._released_to_driver()
            with self._transaction() as ledger:
                self._record(ledger)
            return
        with self._transaction() as ledger:
            entry = ledger.loans.get(decision.loan_id)
        if entry is not None and entry.state == "borrowed":
            self._give_back(entry, decision.reason)

    def _give_back(self, entry: LoanEntry, reason: str) -> None:
        if entry.loan_id not in self._borrowed:  # given back already: `_reconcile` posts it
            return
        with self._transaction() as ledger:
            above = [
                loan.loan_id
                for loan in ledger.loans_of(self.name)
                if loan.borrower == self.name
                and loan.state == "borrowed"
                and loan.start_block > entry.start_block
            ]
        if above:
            # Giving it back would drop every block above it too, these loans' with them.
            logger.info(
                "pool: %s keeps loan %d: loans %s lie above it", self.name, entry.loan_id, above
            )
            return
        try:
            self._clear_past(entry.start_block)
        except RuntimeError as error:  # too few free blocks below it now
            logger.info("pool: %s keeps loan %d: %s", self.name, entry.loan_id, error)
            return
        before = _borrowed_bytes(self.cache)
        with _uninterrupted():
            try:
                self.cache.give_back(_loans(entry), stream=self.stream)
            except BaseException:
                if before - _borrowed_bytes(self.cache) >= entry.num_bytes:  # all back, then
                    self._gave(entry.loan_id, reason)  # the cache's own step failed
                raise
            self._gave(entry.loan_id, reason)
        self._resized()
        with self._transaction() as ledger:  # `_reconcile` posts it returned
            self._record(ledger)

    def _gave(self, loan_id: int, reason: str) -> None:
        del self._borrowed[loan_id]
        self._gave_back[loan_id] = reason

    # ---------------------------------------------------------------------------------------
    # the ledger, in line with the cache

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[Ledger]:
        """A transaction of the pool whose recovery step also reconciles this engine's entries
        with its cache (`_reconcile`). Inside `serve()`, a failure to use the ledger (not one
        of the body's) is a `_PostFailed`, which `serve` logs."""
        body_failed = False
        try:
            with self.pool.transaction(repair=self._reconcile) as ledger:
                try:
                    yield ledger
                except BaseException:
                    body_failed = True
                    raise
        except _STORE_FAILURES as error:
            if body_failed or not self._serving:
                raise
            raise _PostFailed(str(error)) from error

    def _reconcile(self, ledger: Ledger) -> None:
        """Brings this engine's entries in the ledger in line with what its cache holds (the
        member's own record, kept right after each move): what a failed post, or a Ctrl-C
        between a move and its post, left unsaid is posted now, through the rules. A loan
        lent and not offered is offered (or, its request gone, returned to be reclaimed); one
        reclaimed, borrowed, given back or released to the driver is posted so. Each rule
        changes nothing for what was posted already. Then the engine's numbers, if the
        ledger's differ from its cache's."""
        engine = ledger.engines.get(self.name)
        if engine is None:  # not in the pool (not joined yet, left, or the pool was reset)
            return
        now = self.pool.clock()
        for loan_id, lent in self._lent.items():
            deadline = now + self.take_timeout_s
            args = (lent.kept_blocks, lent.blocks, lent.num_bytes, lent.native, deadline, now)
            rules.lent(ledger, loan_id, self.name, *args)
        for loan_id, borrowed in self._borrowed.items():
            entry = ledger.loans.get(loan_id)
            if entry is None or entry.state != "borrowed":
                rules.took(ledger, borrowed.entry, borrowed.start_block, now)
        # Notes of posts, not of what the cache holds: dropped once the ledger as read says
        # so (this transaction's own write may yet fail).
        self._gave_back = {
            i: why for i, why in self._gave_back.items() if _state(ledger, i) == "borrowed"
        }
        self._released = {
            i: n for i, n in self._released.items() if _state(ledger, i) in ("asked", "expired")
        }
        for loan in ledger.loans_of(self.name):
            if loan.lender == self.name and loan.state in rules.HOLDING:
                if loan.loan_id not in self._lent:
                    rules.reclaimed(ledger, loan.loan_id, now)
            elif loan.borrower == self.name and loan.state == "borrowed":
                if loan.loan_id not in self._borrowed:
                    why = self._gave_back.get(loan.loan_id, "given back")
                    rules.returned(ledger, loan.loan_id, why, now)
        for loan_id, blocks in self._released.items():
            rules.released(ledger, loan_id, blocks, now)
        held = self._held()
        if any(getattr(engine, key) != value for key, value in held.items()):
            rules.record(ledger, self.name, now, held, heartbeat=False)

    def _held(self) -> dict[str, int]:
        cache = self.cache
        return {
            "committed_blocks": cache.committed_blocks,
            "physical_bytes": cache.physical_bytes,
            "lent_bytes": _lent_bytes(cache),
            "borrowed_bytes": _borrowed_bytes(cache),
        }

    def _record(self, ledger: Ledger) -> None:
        cache = self.cache
        lendable = 0
        committed, free = cache.committed_blocks, self._free_top()
        if not any(t.borrowed_bytes for t in cache.buffers):  # a borrower lends nothing
            fits = [committed - k for k in _lend_points(cache) if committed - k <= free]
            lendable = max(fits, default=0)
        numbers: dict[str, Any] = {
            **self._held(),
            "lendable_blocks": lendable,
            "free_top_blocks": free,
            "busy": self.busy,
        }
        rules.record(ledger, self.name, self.pool.clock(), numbers)

    def _free_tail(self) -> int:
        free = _args.size(self.free_tail_blocks(), "free_tail_blocks()")
        return min(free, self.cache.committed_blocks)

    def _free_top(self) -> int:
        """The top blocks that could go at once: the free ones at the top, or with
        `move=True` as many as are free anywhere (the live ones above them move down)."""
        return max(self._free_tail(), self._free_anywhere() or 0)

    def _free_anywhere(self) -> int | None:
        """With `move=True`, the free blocks wherever they lie (None without)."""
        if not self.move:
            return None
        free = _args.size(cast(MovingCache, self.cache).free_blocks(), "free_blocks()")
        return min(free, self.cache.committed_blocks)

    def _resized(self) -> None:
        if self.on_resize is not None:
            self.on_resize(self.cache.committed_blocks)

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
        plan = [(d.action, d.peer, d.blocks) for d in decisions]
        if plan != self._last_plan:
            for decision in decisions:
                self._log(decision)
        self._last_plan = plan


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """Holds a Ctrl-C (SIGINT) until the block ends, then delivers it: a memory move and the
    member's note of it are one step, so that a `KeyboardInterrupt` never falls between them
    (the note is what repairs the ledger). Python runs signal handlers on the main thread
    only: on any other there is nothing to hold."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or previous == signal.SIG_IGN:  # a handler not Python's, or none
        yield
        return
    caught: list[tuple[int, Any]] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(*caught[0])
            else:  # SIG_DFL: what the signal would have done
                signal.raise_signal(signal.SIGINT)


def _state(ledger: Ledger, loan_id: int) -> str | None:
    loan = ledger.loans.get(loan_id)
    return None if loan is None else loan.state


def _lent_bytes(cache: PoolCache) -> int:
    return sum(t.lent_bytes for t in cache.buffers)


def _borrowed_bytes(cache: PoolCache) -> int:
    return sum(t.borrowed_bytes for t in cache.buffers)


def _moves(cache: PoolCache) -> bool:
    return all(callable(getattr(cache, name, None)) for name in ("free_blocks", "move_below"))


def _lend_points(cache: PoolCache) -> set[int]:
    """The block counts a lend may keep: those where every segment of every buffer has a
    handle starting exactly at the cut, since a loan is whole handles (a handle that straddles
    the cut stays with the lender) and must be whole blocks of every buffer. Block 0 lies
    `leading_blocks` blocks into each segment."""
    points: set[int] | None = None
    leading = cache.footprint().leading_blocks
    for tensor, block_bytes in zip(cache.buffers, cache.segment_block_bytes, strict=True):
        g = tensor.granularity
        starts = {first * g for first, _ in tensor.handle_runs()}
        firsts = [offset + leading * block_bytes for offset in tensor.segment_offsets]
        if points is None:
            points = {
                (start - firsts[0]) // block_bytes
                for start in starts
                if start >= firsts[0] and (start - firsts[0]) % block_bytes == 0
            }
        points = {k for k in points if all(first + k * block_bytes in starts for first in firsts)}
    return {k for k in points or () if k < cache.committed_blocks}


def _layout(cache: PoolCache) -> str:
    """What two caches must share for one to borrow the other's blocks: their geometry, or
    its digest where it is longer than the ledger's readers take (a cache of many buffers)."""
    granularity = [t.granularity for t in cache.buffers]
    text = json.dumps([list(cache.num_segments), list(cache.segment_block_bytes), granularity])
    if len(text) <= MAX_LAYOUT:
        return text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _loan_blocks(cache: PoolCache, loan: Loan) -> int:
    return loan.num_bytes // (cache.num_segments[0] * cache.segment_block_bytes[0])


def _jsonable(native: tuple[Any, ...]) -> list[Any]:
    *head, handles = native
    return [*head, [list(h) for h in handles]]


def _loans(entry: LoanEntry) -> list[Loan]:
    return [Loan._from_native(tuple(native)) for native in entry.loans]


def _device_free_bytes(device: str) -> Callable[[], int]:
    if device == "cpu":
        from extensible_kv.sizing import host_free_bytes

        return host_free_bytes

    def cuda_free() -> int:
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)

    return cuda_free
