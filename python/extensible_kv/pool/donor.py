"""A pool member's donor side (`DonorSide`): it answers the requests others posted to it, lends
(or, `via="driver"`, releases to the driver), takes back what comes back, sends a loan's fds
over its socket to a borrower that may not take them by pid, and exports its handles ahead of
a loan while idle.

An answer is planned in the ledger's transaction (`policy.plan_answer`, with the cuts this
cache may make and what each gives the borrower in the borrower's own shape), counted ahead
(`rules.lend_ahead`) so that the next answer of the round plans on what is left, and made
after it, outside the lock: the lend, its note, then its post (`rules.lent`, through the
notes' reconciliation).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from extensible_kv._native import LoanTimeoutError
from extensible_kv.ipc import send_shared
from extensible_kv.pool import fds, rules
from extensible_kv.pool.base import MemberBase
from extensible_kv.pool.caches import gains, lend_points, lent_bytes
from extensible_kv.pool.ledger import Engine, Ledger, LoanState, PoolLoan
from extensible_kv.pool.notes import Lent, uninterrupted
from extensible_kv.pool.policy import Action, Decision, plan_answer

logger = logging.getLogger("extensible_kv.pool")

__all__ = ["EXPORT_AHEAD_HANDLES", "DonorSide"]

# Handles a buffer exports ahead of a loan in one idle `serve()` (`DonorSide._export_ahead`).
EXPORT_AHEAD_HANDLES = 4
# How long the reclaim of a returned loan may look for its borrower's death (the board sees a
# give-back at once, a dead borrower only through its pidfd, a poll of a few ms): long enough
# for that, short enough that a loan the ledger says is back and is not never stalls a serve.
RECLAIM_LOOK_S = 0.01
# Socket peers refused with a warning; the rest at debug level (a stranger may knock often).
REFUSALS_WARNED = 16


class DonorSide(MemberBase):
    """What a member does as a donor (see the module's docstring)."""

    # ---------------------------------------------------------------------------------------
    # answering

    def _answer(self, ledger: Ledger, asked: list[PoolLoan]) -> list[Decision]:
        """The answers to the requests `asked` of this engine: refusals posted now, lends (or
        releases) to make after the transaction."""
        planned: list[Decision] = []
        answers: dict[Action, Callable[[Ledger, PoolLoan, Decision], Decision | None]] = {
            Action.LEND: self._plan_lend,
            Action.RELEASE: self._plan_lend,
            Action.REFUSE: self._post_refusal,
        }
        free_tail = self._free_tail_blocks()
        free = self._free_blocks() if asked else None
        points = lend_points(self.cache) if asked else set()
        me = rules.engine(ledger, self.name)
        # Loans given back and not reclaimed yet (one still out at this serve's reclaim): a
        # request it could not answer now waits for them (within its deadline) rather than
        # being refused, for it was asked for them (`policy.plan_grow`).
        coming_back = any(
            loan.lender == self.name and loan.state == LoanState.RETURNED
            for loan in ledger.loans.values()
        )
        for loan in sorted(asked, key=lambda loan: loan.loan_id):
            if self._settling:
                rules.refuse(ledger, loan.loan_id, f"{self.name} is settling", self.pool.clock())
                continue
            borrower = ledger.engines.get(loan.borrower)
            spare = max(free_tail, free or 0)  # `_spare_blocks`, less what was planned
            most = min(spare, me.committed_blocks - me.min_blocks)
            cuts = self._cuts(points, borrower, me.committed_blocks, most, loan.blocks)
            decision = plan_answer(
                ledger,
                self.name,
                loan.loan_id,
                free_tail_blocks=free_tail,
                cuts=cuts,
                free_blocks=free,
            )
            if decision.action == Action.REFUSE and coming_back:
                continue
            if decision.action == Action.LEND and self.via == "driver":
                why = f"{decision.reason}; released to the driver, not lent"
                decision = dataclasses.replace(decision, action=Action.RELEASE, reason=why)
            self._log(decision)
            made = answers[decision.action](ledger, loan, decision)
            if made is not None:
                planned.append(made)
                free_tail = max(0, free_tail - made.blocks)
                if free is not None:
                    free -= made.blocks
        return planned

    def _cuts(
        self, points: set[int], borrower: Engine | None, top: int, most: int, wanted: int
    ) -> dict[int, int] | None:
        """What this cache's cuts below `top` of at most `most` blocks give `borrower`, which
        asked for `wanted` blocks of its own (None: a borrower gone, whose request the plan
        refuses anyway)."""
        if borrower is None:
            return None
        if self.via == "driver":  # the borrower commits the bytes: whole blocks of its own
            bb, theirs = self.cache.shape().block_bytes(), borrower.block_bytes
            return {top - k: (top - k) * bb // theirs for k in points if k < top}
        room = max(0, borrower.max_blocks - borrower.committed_blocks)
        return gains(
            self.cache, points, borrower.shape, top, room, most=max(most, 0), wanted=wanted
        )

    def _plan_lend(self, ledger: Ledger, loan: PoolLoan, decision: Decision) -> Decision:
        rules.lend_ahead(ledger, self.name, decision.blocks)  # what the next answer sees
        return decision

    def _post_refusal(self, ledger: Ledger, loan: PoolLoan, decision: Decision) -> None:
        rules.refuse(ledger, loan.loan_id, decision.reason, self.pool.clock())

    def _lend(self, decision: Decision) -> None:
        """Makes a planned answer: a lend (`_lend_loans`) or a release to the driver
        (`_release_for`)."""
        answers: dict[Action, Callable[[Decision], None]] = {
            Action.LEND: self._lend_loans,
            Action.RELEASE: self._release_for,
        }
        answers[decision.action](decision)

    def _lend_loans(self, decision: Decision) -> None:
        before = self.cache.committed_blocks
        keep = before - decision.blocks
        try:
            self._clear_past(keep)
            with uninterrupted():
                loans = self.cache.lend(keep, stream=self.stream)
                lent = Lent(tuple(loans), keep, before - keep, decision.peer_blocks)
                self._notes.lent[decision.loan_id] = lent
        except (ValueError, RuntimeError) as error:  # a straddling handle past `keep`, say
            with self._transaction() as ledger:
                rules.refuse(ledger, decision.loan_id, f"cannot lend: {error}", self.pool.clock())
                self._record(ledger)
            return
        self._resized()
        with self._transaction() as ledger:  # the notes' reconciliation offers it
            self._record(ledger)
            entry = ledger.loans.get(decision.loan_id)
        if entry is not None and entry.state == LoanState.RETURNED:
            # The request ended meanwhile (expired, or the borrower is gone): never taken,
            # so back at once.
            self._reclaim(entry)

    def _release_for(self, decision: Decision) -> None:
        """`via="driver"`'s answer: the blocks go back to the driver, and the request is
        answered so; the needy engine commits them from the device's free memory."""
        keep = self.cache.committed_blocks - decision.blocks
        try:
            self._clear_past(keep)
            with uninterrupted():
                self.cache.shrink_to(keep)
                self._notes.released[decision.loan_id] = decision.blocks
        except (ValueError, RuntimeError) as error:  # its top blocks are no longer free, say
            with self._transaction() as ledger:
                why = f"cannot release: {error}"
                rules.refuse(ledger, decision.loan_id, why, self.pool.clock())
                self._record(ledger)
            return
        self._released_to_driver()
        with self._transaction() as ledger:  # the notes' reconciliation posts it released
            self._record(ledger)

    # ---------------------------------------------------------------------------------------
    # taking back

    def _reclaimable(self, ledger: Ledger, now: float) -> list[PoolLoan]:
        """The loans it lent that it can take back now, newest first (the fewest blocks kept:
        its cache grows back contiguously only in that order), up to the first it cannot."""
        lent = sorted(
            (loan for loan in ledger.loans_of(self.name) if loan.lender == self.name),
            key=lambda loan: loan.kept_blocks,
        )
        ready = []
        for loan in (loan for loan in lent if loan.memory_out):
            back = loan.state == LoanState.RETURNED
            if not (back or (loan.state == LoanState.OFFERED and loan.deadline < now)):
                break
            ready.append(loan)
        return ready

    def _reclaim(self, entry: PoolLoan) -> bool:
        """Takes loan `entry` back if its borrower gave it back, died or never took it, and
        posts it; never waits longer than `RECLAIM_LOOK_S`. False while it is still out (the
        borrower posts it)."""
        lent = self._notes.lent.get(entry.loan_id)
        if lent is None:  # reclaimed already: the reconciliation posts it
            return True
        before = lent_bytes(self.cache)
        with uninterrupted():
            try:
                look = RECLAIM_LOOK_S if entry.state == LoanState.RETURNED else 0.0
                self.cache.reclaim(lent.loans, zero=self.zero, timeout=look, stream=self.stream)
            except LoanTimeoutError:
                return False
            except BaseException:
                # All back, then the cache's own step failed: reclaimed. Some buffers back
                # and not the rest: still lent, and the next call takes back the rest.
                if before - lent_bytes(self.cache) >= lent.num_bytes:
                    del self._notes.lent[entry.loan_id]
                raise
            del self._notes.lent[entry.loan_id]
        self._resized()
        self._asks.mapped(self.pool.clock())  # its own memory back, for its own growth
        with self._transaction() as ledger:  # the reconciliation posts it reclaimed
            self._record(ledger)
        return True

    # ---------------------------------------------------------------------------------------
    # the fd socket, and exporting ahead

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

    def _send_fds(self) -> None:
        """Answers the borrowers that asked on this engine's socket: a loan's fds go only to
        the process the ledger names as its borrower, and only while it is on offer. Never
        waits: any other process's connection is closed at once, before anything is read."""
        if self._fd_server is None:
            return
        offered: dict[int, dict[int, PoolLoan]] = {}  # borrower's pid -> its loans on offer

        def peers() -> dict[int, dict[int, PoolLoan]]:
            with self._transaction() as ledger:
                for loan in ledger.loans.values():
                    borrower = ledger.engines.get(loan.borrower)
                    if loan.lender == self.name and loan.state == LoanState.OFFERED and borrower:
                        offered.setdefault(borrower.pid, {})[loan.loan_id] = loan
            return offered

        for conn, pid, loan_id in self._fd_server.requests(peers, self._refused_peer):
            with conn:
                entry = offered.get(pid, {}).get(loan_id)
                if entry is None:
                    self._refused_peer(pid, f"loan {loan_id} is not on offer to it")
                    continue
                try:
                    for loan in entry.loans:
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
        top ones first (`ExtensibleTensor.export_ahead`), so that a lend only unmaps (a first
        loan of 60 GiB spent half of its ~60 ms exporting 60 handles: the export cost,
        docs/design.md §2). A few a round keep each call short; a failed export (out of fds,
        say) is left to the lend, which reports it."""
        committed = self.cache.committed_blocks
        if self.via != "loan" or committed == self._exported_at:
            return
        try:
            left = sum(t.export_ahead(EXPORT_AHEAD_HANDLES) for t in self.cache.buffers)
        except Exception as error:  # an optimization: serving goes on without it
            logger.warning("%s: not exporting ahead of loans: %s", self.name, error)
            left = 0
        if not left:
            self._exported_at = committed
