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

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from extensible_kv import _args
from extensible_kv._native import LoanTimeoutError, OutOfMemoryError
from extensible_kv.flow import ExtendableCache
from extensible_kv.ipc import Loan, send_shared
from extensible_kv.pool import _proc, fds, rules
from extensible_kv.pool.ledger import Engine, Ledger, LoanEntry
from extensible_kv.pool.policy import Decision, plan_answer, plan_grow, plan_release
from extensible_kv.pool.store import Pool

if TYPE_CHECKING:
    from extensible_kv.tensor import ExtensibleTensor

logger = logging.getLogger("extensible_kv.pool")

__all__ = ["VIAS", "MovingCache", "PoolCache", "PoolMember"]

# How a donor's memory reaches a needy engine: as a loan of its handles, or through the driver
# (released, then created again by the needy engine).
VIAS = ("loan", "driver")

# Handles a buffer exports ahead of a loan in one idle `serve()` (`PoolMember._export_ahead`).
EXPORT_AHEAD_HANDLES = 4


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
    (see the module's docstring)."""

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
        self.pool = Pool(pool) if isinstance(pool, str) else pool
        self.name = name
        self.cache = cache
        self.min_blocks = _args.size(min_blocks, "min_blocks")
        self.max_blocks = _args.size(max_blocks, "max_blocks")
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
        self.free_tail_blocks = free_tail_blocks
        self.on_resize = on_resize
        self.free_bytes = free_bytes or _device_free_bytes(str(cache.buffers[0].device))
        self.zero = _args.flag(zero, "zero")
        self.answer_timeout_s = answer_timeout_s
        self.take_timeout_s = take_timeout_s
        self.commit_step_blocks = _args.optional_size(
            commit_step_blocks, "commit_step_blocks", minimum=1
        )
        self.stream = stream
        self.busy = False
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
        with self.pool.transaction() as ledger:
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
        recalls and reclaims what it lent, waiting up to `timeout_s` for the borrowers (who
        must `serve`). Past the timeout, a `TimeoutError`."""
        self._settle(timeout_s, leave=False)

    def leave(self, timeout_s: float = 10.0) -> None:
        """`settle`, then leaves the pool in the same transaction that finds no loan left."""
        self._settle(timeout_s, leave=True)
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
            with self.pool.transaction() as ledger:
                now = self.pool.clock()
                for loan in ledger.loans_of(self.name):
                    if loan.state == "asked" and loan.lender == self.name:
                        rules.refuse(ledger, loan.loan_id, why, now)
                    elif loan.state in ("asked", "refused", "expired"):
                        rules.forget(ledger, loan.loan_id)
                        ledger.loans.pop(loan.loan_id, None)  # a request of its own: withdrawn
                    elif loan.lender == self.name:
                        rules.recall(ledger, loan.loan_id, why, now)
                        if loan.state == "offered":
                            loan.deadline = 0.0  # not taken yet: this serve takes it back
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
        blocks = _args.size(blocks, "blocks")
        commit = 0
        with self.pool.transaction() as ledger:
            now = self.pool.clock()
            self._record(ledger)
            refused = [name for name, until in self._refused.items() if until > now]
            decisions = plan_grow(
                ledger, self.name, blocks, free_bytes=self.free_bytes(), now=now, exclude=refused
            )
            for d in decisions:
                if d.action == "commit":
                    commit = d.blocks
                    engine = ledger.engines[self.name]
                    # Counted before it is done, so that no other engine takes the same memory.
                    engine.committed_blocks += commit
                    engine.physical_bytes += commit * engine.block_bytes
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
                with self.pool.transaction() as ledger:
                    self._record(ledger)
            self._resized()
        return decisions

    def grow(self, blocks: int, timeout_s: float = 5.0) -> int:
        """Asks for `blocks` more blocks and serves until it has them or `timeout_s` passed;
        returns the committed blocks (its caller checks whether that is enough)."""
        target = self.cache.committed_blocks + _args.size(blocks, "blocks")
        with self.pool.transaction() as ledger:  # the limits may have changed since it joined
            target = min(target, ledger.engines[self.name].max_blocks)
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
        self._send_fds()
        with self.pool.transaction() as ledger:
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
                # A returned loan's handles are back, or its borrower is dead (seen within a
                # few ms); an offer past its deadline is untaken (closed at once) or taken
                # meanwhile (then it stops here, and the older loans wait their turn).
                if not self._reclaim(loan, timeout=1.0 if loan.state == "returned" else 0.0):
                    break
            with self.pool.transaction() as ledger:  # answers planned on the cache as it is
                self._record(ledger)
                lends, to_take = self._work(ledger)
        for decision in lends:
            self._lend(decision)
        for loan in sorted(to_take, key=lambda loan: loan.loan_id):
            self._take(loan)
        with self.pool.transaction() as ledger:  # after the takes: a give-back sees them
            released = plan_release(ledger, self.name, free_tail_blocks=self._free_top())
        for decision in released:
            self._release(decision)
        if not (to_reclaim or lends or to_take or released):
            self._export_ahead()

    def _send_fds(self) -> None:
        """Answers the borrowers that asked on this engine's socket: a loan's fds go only to
        the process the ledger names as its borrower, and only while it is on offer."""
        if self._fd_server is None:
            return
        for conn, pid, loan_id in self._fd_server.requests():
            with conn:
                with self.pool.transaction() as ledger:
                    entry = ledger.loans.get(loan_id)
                    borrower = ledger.engines.get(entry.borrower) if entry else None
                if entry is None or entry.lender != self.name or entry.state != "offered":
                    why = "it is not on offer from this engine"
                elif borrower is None or borrower.pid != pid:
                    why = "that process is not its borrower"
                else:
                    try:
                        for loan in _loans(entry):
                            send_shared(conn, loan)
                    except (OSError, ValueError) as error:  # gone meanwhile, or stale
                        logger.warning(
                            "pool: %s could not send loan %d's fds: %s", self.name, loan_id, error
                        )
                    continue
                logger.warning(
                    "pool: %s refuses process %d the fds of loan %d: %s",
                    self.name,
                    pid,
                    loan_id,
                    why,
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
        offered = [loan for loan in mine if loan.borrower == self.name and loan.state == "offered"]
        return self._answer(ledger, asked), offered

    def _answer(self, ledger: Ledger, asked: list[LoanEntry]) -> list[Decision]:
        lends = []
        engine = ledger.engines[self.name]
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
            engine.committed_blocks -= decision.blocks  # what the next answer sees
        return lends

    def _lend(self, decision: Decision) -> None:
        if self.via == "driver":
            self._release_for(decision)
            return
        keep = self.cache.committed_blocks - decision.blocks
        try:
            self._clear_past(keep)
            loans = self.cache.lend(keep, stream=self.stream)
        except (ValueError, RuntimeError) as error:  # a straddling handle past `keep`, say
            with self.pool.transaction() as ledger:
                rules.refuse(ledger, decision.loan_id, f"cannot lend: {error}", self.pool.clock())
                self._record(ledger)
            return
        self._resized()
        blocks = _loan_blocks(self.cache, loans[0])
        entry = [list(_jsonable(loan._to_native())) for loan in loans]
        with self.pool.transaction() as ledger:
            now = self.pool.clock()
            offered = rules.offer(
                ledger,
                decision.loan_id,
                keep,
                blocks,
                sum(x.num_bytes for x in loans),
                entry,
                now + self.take_timeout_s,
                now,
            )
            if offered:
                self._record(ledger)
        if not offered:  # expired, or the borrower is gone: never taken, so back at once
            self.cache.reclaim(loans, zero=False, timeout=0, stream=self.stream)
            with self.pool.transaction() as ledger:
                self._record(ledger)
            self._resized()

    def _release_for(self, decision: Decision) -> None:
        """`via="driver"`'s answer: the blocks go back to the driver, and the request ends;
        the needy engine's next request finds them free on the device."""
        keep = self.cache.committed_blocks - decision.blocks
        try:
            self._clear_past(keep)
            self._shrink(keep)
        except (ValueError, RuntimeError) as error:  # its top blocks are no longer free, say
            with self.pool.transaction() as ledger:
                why = f"cannot release: {error}"
                rules.refuse(ledger, decision.loan_id, why, self.pool.clock())
                self._record(ledger)
            return
        with self.pool.transaction() as ledger:
            rules.released(ledger, decision.loan_id, decision.blocks, self.pool.clock())
            self._record(ledger)

    def _clear_past(self, keep: int) -> None:
        """With `move=True`, moves the live blocks at or past `keep` down, if any: before a
        lend or a release, and before a borrowed loan goes back (so that a recalled loan goes
        back at once, however busy the borrower is, if it has free blocks enough below)."""
        if self.move and self._free_tail() < self.cache.committed_blocks - keep:
            cast(MovingCache, self.cache).move_below(keep)

    def _shrink(self, keep: int) -> None:
        """Shrinks the cache to `keep` blocks (a handle boundary) and waits until the memory
        is the driver's: before the ledger says so, or another engine could count on memory
        the device still holds."""
        self.cache.shrink_to(keep)
        self.cache.wait_released()
        self._resized()

    def _reclaim(self, entry: LoanEntry, timeout: float) -> bool:
        loans = _loans(entry)
        try:
            self.cache.reclaim(loans, zero=self.zero, timeout=timeout, stream=self.stream)
        except LoanTimeoutError:
            return False  # taken after all: the borrower posts it
        with self.pool.transaction() as ledger:
            rules.reclaimed(ledger, entry.loan_id, self.pool.clock())
            self._record(ledger)
        self._resized()
        return True

    def _take(self, entry: LoanEntry) -> None:
        start = self.cache.committed_blocks
        try:
            try:
                self.cache.borrow(_loans(entry), zero=self.zero, stream=self.stream)
            except (ValueError, OSError) as by_pid:
                if PTRACE_REFUSED not in str(by_pid):
                    raise
                self._take_over_socket(entry, by_pid)
        except (ValueError, OSError) as error:  # stale, foreign, or no room: the lender's again
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
            with self.pool.transaction() as ledger:
                rules.returned(ledger, entry.loan_id, f"could not borrow: {error}", now)
                self._record(ledger)
            return
        with self.pool.transaction() as ledger:
            rules.took(ledger, entry, start, self.pool.clock())
            self._record(ledger)
        self._resized()

    def _take_over_socket(self, entry: LoanEntry, by_pid: Exception) -> None:
        """The borrow of `entry` with its fds asked of the lender on its socket, after taking
        them by pid failed with `by_pid` (refused where this process may not trace the
        lender; else the socket's answer fails alike). Raises a `ValueError` naming both."""
        with self.pool.transaction() as ledger:
            lender = ledger.engines.get(entry.lender)
        if lender is None:
            raise by_pid
        name = fds.address(self.pool.path, lender.name, lender.pid, lender.start_time)
        expected = _loans(entry)
        try:
            received = fds.fetch(name, entry.loan_id, len(expected), self.take_timeout_s)
        except (OSError, ValueError, ConnectionError) as error:
            raise ValueError(f"{by_pid}; over {entry.lender}'s socket: {error}") from error
        try:
            if received != expected:
                raise ValueError(
                    f"{by_pid}; over {entry.lender}'s socket came other loans than the ledger's"
                )
            self.cache.borrow(received, zero=self.zero, stream=self.stream)
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
            self._shrink(cut)
            with self.pool.transaction() as ledger:
                self._record(ledger)
            return
        with self.pool.transaction() as ledger:
            entry = ledger.loans.get(decision.loan_id)
        if entry is not None and entry.state == "borrowed":
            self._give_back(entry, decision.reason)

    def _give_back(self, entry: LoanEntry, reason: str) -> None:
        with self.pool.transaction() as ledger:
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
        self.cache.give_back(_loans(entry), stream=self.stream)
        with self.pool.transaction() as ledger:
            rules.returned(ledger, entry.loan_id, reason, self.pool.clock())
            self._record(ledger)
        self._resized()

    # ---------------------------------------------------------------------------------------

    def _record(self, ledger: Ledger) -> None:
        cache = self.cache
        lendable = 0
        committed, free = cache.committed_blocks, self._free_top()
        if not any(t.borrowed_bytes for t in cache.buffers):  # a borrower lends nothing
            fits = [committed - k for k in _lend_points(cache) if committed - k <= free]
            lendable = max(fits, default=0)
        rules.record(
            ledger,
            self.name,
            self.pool.clock(),
            {
                "committed_blocks": cache.committed_blocks,
                "physical_bytes": cache.physical_bytes,
                "lent_bytes": sum(t.lent_bytes for t in cache.buffers),
                "borrowed_bytes": sum(t.borrowed_bytes for t in cache.buffers),
                "lendable_blocks": lendable,
                "free_top_blocks": free,
                "busy": self.busy,
            },
        )

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
    """What two caches must share for one to borrow the other's blocks."""
    granularity = [t.granularity for t in cache.buffers]
    return json.dumps([list(cache.num_segments), list(cache.segment_block_bytes), granularity])


def _loan_blocks(cache: PoolCache, loan: Loan) -> int:
    return loan.num_bytes // (cache.num_segments[0] * cache.segment_block_bytes[0])


def _jsonable(native: tuple[Any, ...]) -> list[Any]:
    *head, handles = native
    return [*head, [list(h) for h in handles]]


# What a borrow refused by pid says (src/ipc.rs, `PTRACE_REFUSED_HINT`): then the member asks
# the lender for the fds over its socket.
PTRACE_REFUSED = "may not trace the owner"


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
