"""A member's notes of what its cache moved, and how they bring the ledger in line.

The memory moves outside the pool's lock, and its post is a second transaction, which can fail
(the lock held too long by another process, a full `/dev/shm`, a corrupt ledger), and a
Ctrl-C can fall between the two. So the member's own cache is the truth: right after each
move, before any post, the member notes it (`Notes`: the loans it lent, by loan id, with their
`Loan`s; the loans it borrowed, with where they begin; the reasons of give-backs and the
releases to the driver not posted yet), inside `uninterrupted()`, so that no Ctrl-C falls
between a move and its note. Every transaction the member runs first brings this engine's
entries in line with the notes (`Notes.reconcile`, the store's recovery step), through the
rules: a lend posted late is offered (or returned, its request gone), a take, a give-back, a
reclaim or a release posted late lands once (the rules are idempotent). A note of a post is
dropped only once the ledger as read says it landed, never by a transaction whose write then
fails.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from extensible_kv.ipc import Loan
from extensible_kv.pool import rules
from extensible_kv.pool.ledger import Ledger, LoanState, PoolLoan

__all__ = ["Borrowed", "Lent", "Notes", "uninterrupted"]


@dataclass(frozen=True)
class Lent:
    """A loan this engine lent and has not reclaimed: what its cache holds out. It kept
    `kept_blocks` and lent `lent_blocks` of its blocks, which give the borrower `blocks` of
    the borrower's."""

    loans: tuple[Loan, ...]
    kept_blocks: int
    lent_blocks: int
    blocks: int

    @property
    def num_bytes(self) -> int:
        return sum(loan.num_bytes for loan in self.loans)


@dataclass(frozen=True)
class Borrowed:
    """A loan this engine borrowed and has not given back: what its cache maps of another,
    `mapped_bytes` of it (the rest went back unused), `blocks` of its own from
    `start_block`."""

    entry: PoolLoan
    start_block: int
    blocks: int
    mapped_bytes: int


@dataclass
class Notes:
    """What this engine's cache holds out and holds of others, noted right after each move and
    before its post; and the posts not landed yet."""

    lent: dict[int, Lent] = field(default_factory=dict)
    borrowed: dict[int, Borrowed] = field(default_factory=dict)
    gave_back: dict[int, str] = field(default_factory=dict)  # loan id -> why
    released: dict[int, int] = field(default_factory=dict)  # request -> blocks released

    def gave(self, loan_id: int, reason: str) -> None:
        """Loan `loan_id`, borrowed, is given back (`reason`, for the post)."""
        del self.borrowed[loan_id]
        self.gave_back[loan_id] = reason

    def reconcile(
        self,
        ledger: Ledger,
        name: str,
        now: float,
        take_timeout_s: float,
        held: dict[str, int],
    ) -> None:
        """Brings engine `name`'s entries in `ledger` in line with the notes: what a failed
        post, or a Ctrl-C between a move and its post, left unsaid is posted now, through the
        rules. A loan lent and not offered is offered (or, its request gone, returned to be
        reclaimed); one reclaimed, borrowed, given back or released to the driver is posted
        so. Each rule changes nothing for what was posted already. Then the engine's numbers
        (`held`: what its cache holds), if the ledger's differ."""
        engine = ledger.engines.get(name)
        if engine is None:  # not in the pool (not joined yet, left, or the pool was reset)
            return
        for loan_id, lent in self.lent.items():
            rules.lent(
                ledger,
                loan_id,
                name,
                kept_blocks=lent.kept_blocks,
                lent_blocks=lent.lent_blocks,
                blocks=lent.blocks,
                loans=lent.loans,
                deadline=now + take_timeout_s,
                now=now,
            )
        for loan_id, borrowed in self.borrowed.items():
            entry = ledger.loans.get(loan_id)
            if entry is None or entry.state != LoanState.BORROWED:
                rules.took(
                    ledger,
                    borrowed.entry,
                    borrowed.start_block,
                    now,
                    borrowed.blocks,
                    borrowed.mapped_bytes,
                )
        # Notes of posts, not of what the cache holds: dropped once the ledger as read says
        # so (this transaction's own write may yet fail).
        self.gave_back = {
            i: why for i, why in self.gave_back.items() if _state(ledger, i) == "borrowed"
        }
        self.released = {
            i: n for i, n in self.released.items() if _state(ledger, i) in ("asked", "expired")
        }
        for loan in ledger.loans_of(name):
            if loan.lender == name and loan.memory_out:
                if loan.loan_id not in self.lent:
                    rules.reclaimed(ledger, loan.loan_id, now)
            elif loan.borrower == name and loan.state == LoanState.BORROWED:
                if loan.loan_id not in self.borrowed:
                    why = self.gave_back.get(loan.loan_id, "given back")
                    rules.returned(ledger, loan.loan_id, why, now)
        for loan_id, blocks in self.released.items():
            rules.released(ledger, loan_id, blocks, now)
        if any(getattr(engine, key) != value for key, value in held.items()):
            rules.record(ledger, name, now, dict(held), heartbeat=False)


def _state(ledger: Ledger, loan_id: int) -> str | None:
    loan = ledger.loans.get(loan_id)
    return None if loan is None else str(loan.state)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
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
