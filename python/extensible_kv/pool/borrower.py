"""A pool member's borrower side (`BorrowerSide`): it takes the loans offered to it (the fds by
pid, or over the lender's socket where the kernel refuses that), gives back what was
recalled, orphaned or lies past its maximum, and shrinks past a lowered maximum.

A borrow maps a loan of any shape of its device and granularity: the cache deals the lender's
whole handles to its own segments and says how many of its blocks it gained, which the
member notes and posts (`rules.took`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from extensible_kv._native import PtraceRefusedError
from extensible_kv.ipc import Loan
from extensible_kv.pool import fds, rules
from extensible_kv.pool.base import MemberBase
from extensible_kv.pool.caches import borrowed_bytes, lend_points
from extensible_kv.pool.ledger import LoanState, PoolLoan
from extensible_kv.pool.notes import Borrowed, uninterrupted
from extensible_kv.pool.policy import Action, Decision

logger = logging.getLogger("extensible_kv.pool")

__all__ = ["BorrowerSide"]


class BorrowerSide(MemberBase):
    """What a member does as a borrower (see the module's docstring)."""

    # ---------------------------------------------------------------------------------------
    # taking

    def _take(self, entry: PoolLoan) -> None:
        start = self.cache.committed_blocks
        try:
            try:
                self._borrow(entry, entry.loans, start)
            except PtraceRefusedError as by_pid:
                if entry.loan_id in self._notes.borrowed:
                    raise
                self._take_over_socket(entry, by_pid, start)
        except (ValueError, OSError) as error:  # stale, foreign, or no room: the lender's again
            if entry.loan_id not in self._notes.borrowed:
                self._could_not_take(entry, error)
                return
            logger.warning(
                "pool: %s borrowed loan %d, then its cache failed: %s",
                self.name,
                entry.loan_id,
                error,
            )
        self._resized()
        with self._transaction() as ledger:  # the reconciliation posts it borrowed
            self._record(ledger)

    def _borrow(self, entry: PoolLoan, loans: Sequence[Loan], start: int) -> None:
        """Borrows `loans` and notes it: the blocks its cache gained, and the bytes it maps (a
        borrower of another model may use less than the whole loan: the handles it cannot
        use go back to the lender at once). A cache whose own step after the mapping failed
        has borrowed them all the same (its borrowed bytes say so), and that is noted too."""
        before = borrowed_bytes(self.cache)
        with uninterrupted():
            try:
                gained = self.cache.borrow(loans, zero=self.zero, stream=self.stream)
            except BaseException:
                mapped = borrowed_bytes(self.cache) - before
                if mapped > 0:
                    blocks = max(self.cache.committed_blocks - start, 0) or entry.blocks
                    note = Borrowed(entry, start, blocks, mapped)
                    self._notes.borrowed[entry.loan_id] = note
                raise
            mapped = borrowed_bytes(self.cache) - before
            self._notes.borrowed[entry.loan_id] = Borrowed(entry, start, gained, mapped)
        if self._idle_since is not None:  # its idle time starts again with the loan
            self._idle_since = time.monotonic()
        self._asks.mapped(self.pool.clock(), borrowed=gained, lender=entry.lender)

    def _could_not_take(self, entry: PoolLoan, error: Exception) -> None:
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

    def _take_over_socket(self, entry: PoolLoan, by_pid: Exception, start: int) -> None:
        """The borrow of `entry` with its fds asked of the lender on its socket, after taking
        them by pid failed with `by_pid` (refused where this process may not trace the
        lender; else the socket's answer fails alike). Raises a `ValueError` naming both."""
        with self._transaction() as ledger:
            lender = ledger.engines.get(entry.lender)
        if lender is None:
            raise by_pid
        name = fds.address(self.pool.path, lender.name, lender.pid, lender.start_time)
        expected = list(entry.loans)
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

    # ---------------------------------------------------------------------------------------
    # giving back, shrinking

    def _give_back_or_shrink(self, decision: Decision) -> None:
        """Makes one of `plan_release`'s decisions."""
        self._log(decision)
        steps: dict[Action, Callable[[Decision], None]] = {
            Action.GIVE_BACK: self._give_back_decided,
            Action.SHRINK: self._shrink,
        }
        steps[decision.action](decision)

    def _give_back_decided(self, decision: Decision) -> None:
        with self._transaction() as ledger:
            entry = ledger.loans.get(decision.loan_id)
        if entry is not None and entry.state == LoanState.BORROWED:
            self._give_back(entry, decision.reason)

    def _shrink(self, decision: Decision) -> None:
        # At a handle boundary: a cut inside a handle keeps its tail mapped as slack, which a
        # later borrow refuses.
        committed = self.cache.committed_blocks
        target = committed - decision.blocks
        cut = min((k for k in lend_points(self.cache) if k >= target), default=committed)
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

    def _give_back(self, entry: PoolLoan, reason: str) -> None:
        note = self._notes.borrowed.get(entry.loan_id)
        if note is None:  # given back already: reconciled
            return
        start = note.start_block
        with self._transaction() as ledger:
            above = [
                loan.loan_id
                for loan in ledger.loans_of(self.name)
                if loan.borrower == self.name
                and loan.state == LoanState.BORROWED
                and loan.start_block > start
            ]
        if above:
            # Giving it back would drop every block above it too, these loans' with them.
            logger.info(
                "pool: %s keeps loan %d: loans %s lie above it", self.name, entry.loan_id, above
            )
            return
        try:
            self._clear_past(start)
        except RuntimeError as error:  # too few free blocks below it now
            logger.info("pool: %s keeps loan %d: %s", self.name, entry.loan_id, error)
            return
        before = borrowed_bytes(self.cache)
        with uninterrupted():
            try:
                self.cache.give_back(entry.loans, stream=self.stream)
            except BaseException:
                if before - borrowed_bytes(self.cache) >= note.mapped_bytes:  # all back, then
                    self._notes.gave(entry.loan_id, reason)  # the cache's own step failed
                raise
            self._notes.gave(entry.loan_id, reason)
        self._resized()
        with self._transaction() as ledger:  # the reconciliation posts it returned
            self._record(ledger)
