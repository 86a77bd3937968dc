"""The ledger's rules: every change to a `Ledger`, as functions of the ledger and the time.

These run inside a `Pool.transaction`, under the pool's lock, and do no I/O: the memory itself
moves outside the lock (a lend, a borrow, a reclaim), and its outcome is posted in the next
transaction. So each function here changes the ledger from one consistent state to another,
and `check` says what consistent means.

`reap` is the recovery step that whoever takes the lock runs first (as every SQLite reader
re-checks what a dead writer left): an engine whose process is gone, or whose pid now names
another process, leaves the pool, and its loans follow the rules below; a request its lender
did not answer in time expires. Every change is logged with its reason, in the ledger's event
list (for `pool status`) and to the `extensible_kv.pool` logger.

A post can fail after its memory moved (the lock held too long, a full `/dev/shm`, a corrupt
ledger). The member then posts it at its next transaction, from its own notes of what it
moved (`PoolMember._reconcile`), through the same rules: so each rule that posts a move (`lent`
for a lend, `took`, `returned`, `reclaimed`, `released`) changes nothing when the move is
posted already, and `lent` returns a lend whose request ended meanwhile to its lender. What
the member counts ahead of a move (`commit_ahead`, `lend_ahead`) its next `record` corrects.
Every value a rule writes is one the ledger's readers accept (`check_share`, the limits'
checks, reasons cut to `MAX_REASON`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from extensible_kv import _args
from extensible_kv.pool.ledger import (
    ENGINE_NAME,
    MAX_INT,
    MAX_REASON,
    Engine,
    Ledger,
    LoanEntry,
    check_device,
)

logger = logging.getLogger("extensible_kv.pool")

__all__ = [
    "MAX_BLOCKS",
    "ask",
    "check",
    "check_share",
    "commit_ahead",
    "end_offer",
    "engine",
    "forget",
    "join",
    "leave",
    "lend_ahead",
    "lent",
    "offer",
    "reap",
    "recall",
    "reclaimed",
    "record",
    "refuse",
    "released",
    "returned",
    "set_limits",
    "set_share",
    "took",
    "withdraw",
]

# The most blocks (or bytes) a limit or a share may say: the ledger's readers refuse integers
# from `MAX_INT` up.
MAX_BLOCKS = MAX_INT - 1
# The states in which a loan's memory is the lender's, lent out: offered, borrowed, returned.
HOLDING = ("offered", "borrowed", "returned")


def _log(ledger: Ledger, now: float, text: str) -> None:
    ledger.log(now, text)
    logger.info("pool: %s", text)


def _reason(text: str) -> str:
    """A reason as the ledger keeps it: a borrow's error may be longer than its readers take."""
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def reap(ledger: Ledger, now: float, alive: Callable[[int, int], bool]) -> list[str]:
    """Removes every engine whose process is gone (`alive(pid, start_time)` is false), with
    its loans' rules applied, and expires every request past its deadline. Returns the
    events."""
    before = len(ledger.events)
    for engine in list(ledger.engines.values()):
        if not alive(engine.pid, engine.start_time):
            _drop_engine(ledger, engine.name, now, f"{engine.name} (pid {engine.pid}) died")
    for loan in ledger.loans.values():
        if loan.state == "asked" and loan.deadline < now:
            loan.state = "expired"
            loan.reason = f"{loan.lender} did not answer within the bound"
            ledger.engines[loan.lender].stuck = True
            _log(ledger, now, f"loan {loan.loan_id}: {loan.reason}; {loan.lender} is stuck")
    return [event.text for event in ledger.events[before:]]


def _drop_engine(ledger: Ledger, name: str, now: float, why: str) -> None:
    """The rules for the loans of an engine that is gone (dead, or left by force)."""
    _log(ledger, now, f"{why}: its entry goes")
    for loan in ledger.loans_of(name):
        if loan.lender == name:
            if loan.state == "borrowed":
                # The borrower maps the handles and holds them; the lender's board is gone
                # with it, so giving them back returns the memory to the driver.
                loan.lender = ""
                loan.reason = f"lender {name} died: giving it back frees it"
                _log(ledger, now, f"loan {loan.loan_id}: {loan.reason}")
            else:
                # Asked, refused or expired: no memory. Offered or returned: the lender's
                # process held the memory, and the kernel freed it when it died.
                del ledger.loans[loan.loan_id]
                _log(ledger, now, f"loan {loan.loan_id} ({loan.state}) ends with its lender")
        elif loan.state in ("offered", "borrowed", "returned") and loan.lender:
            # The kernel unmapped the borrower's memory; the lender's reclaim sees it gone.
            if loan.state != "returned":
                loan.state = "returned"
                loan.reason = f"borrower {name} died"
                _log(ledger, now, f"loan {loan.loan_id} returns to {loan.lender}: {loan.reason}")
            loan.borrower = ""
        else:
            del ledger.loans[loan.loan_id]
            _log(ledger, now, f"loan {loan.loan_id} ({loan.state}) ends with its borrower")
    del ledger.engines[name]


def join(ledger: Ledger, engine: Engine, now: float) -> None:
    """Adds `engine`; a name taken by a live engine is a `ValueError` (reap first)."""
    if not ENGINE_NAME.match(engine.name):
        raise ValueError(
            f"engine name {engine.name!r}: 1 to 64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if engine.name in ledger.engines:
        other = ledger.engines[engine.name]
        raise ValueError(f"engine {engine.name!r} is in the pool already (pid {other.pid})")
    engine.capacity_blocks = engine.capacity_blocks or engine.max_blocks
    if not 0 <= engine.min_blocks <= engine.max_blocks <= engine.capacity_blocks:
        raise ValueError(
            f"need 0 <= min_blocks <= max_blocks <= capacity, got {engine.min_blocks}, "
            f"{engine.max_blocks}, {engine.capacity_blocks}"
        )
    engine.heartbeat = now
    ledger.engines[engine.name] = engine
    _log(
        ledger,
        now,
        f"{engine.name} (pid {engine.pid}, {engine.device}) joined: "
        f"{engine.min_blocks}..{engine.max_blocks} blocks of {engine.block_bytes} B",
    )


def leave(ledger: Ledger, name: str, now: float, *, force: bool = False) -> None:
    """Removes engine `name`. With loans in flight it is a `ValueError`, unless `force`: then
    they follow the rules of a dead engine's."""
    _engine(ledger, name)
    busy = [loan for loan in ledger.loans_of(name) if loan.state not in ("refused", "expired")]
    if busy and not force:
        ids = ", ".join(f"{loan.loan_id} ({loan.state})" for loan in busy)
        raise ValueError(f"{name} has loans in flight: {ids}; give back and reclaim first")
    _drop_engine(ledger, name, now, f"{name} left")


def set_limits(
    ledger: Ledger, name: str, now: float, min_blocks: int | None, max_blocks: int | None
) -> None:
    _args.optional_size(min_blocks, "min_blocks", maximum=MAX_BLOCKS)
    _args.optional_size(max_blocks, "max_blocks", maximum=MAX_BLOCKS)
    engine = _engine(ledger, name)
    low = engine.min_blocks if min_blocks is None else min_blocks
    high = engine.max_blocks if max_blocks is None else max_blocks
    if not 0 <= low <= high <= engine.capacity_blocks:
        raise ValueError(
            f"need 0 <= min <= max <= capacity, got min {low}, max {high}, capacity "
            f"{engine.capacity_blocks}"
        )
    engine.min_blocks, engine.max_blocks = low, high
    _log(ledger, now, f"{name}'s limits are now {low}..{high} blocks")


def check_share(device: object, num_bytes: object) -> None:
    """A share as the ledger reads it: a device (`cpu`, `cuda:N`) and an int of bytes, or
    None; else a `TypeError` or `ValueError` naming what is wrong."""
    check_device(device, "a share's device")
    _args.optional_size(num_bytes, "a share (a number of bytes)", maximum=MAX_BLOCKS)


def set_share(ledger: Ledger, device: str, num_bytes: int | None, now: float) -> None:
    check_share(device, num_bytes)
    if num_bytes is None:
        ledger.shares.pop(device, None)
        _log(ledger, now, f"the pool may use all the free memory of {device}")
    else:
        ledger.shares[device] = num_bytes
        _log(ledger, now, f"the pool may hold {num_bytes} B of {device}")


def record(
    ledger: Ledger, name: str, now: float, numbers: dict[str, Any], *, heartbeat: bool = True
) -> None:
    """What engine `name` holds now (`committed_blocks`, `physical_bytes`, `lent_bytes`,
    `borrowed_bytes`, and `busy`, any of them), and with `heartbeat` that it is alive and
    answering at `now`."""
    engine = _engine(ledger, name)
    for key, value in numbers.items():
        setattr(engine, key, value)
    if heartbeat:
        engine.heartbeat = now
        engine.stuck = False


def ask(
    ledger: Ledger, borrower: str, lender: str, blocks: int, deadline: float, now: float, why: str
) -> int:
    """A request of `borrower` to `lender` for `blocks`; returns the loan id."""
    _engine(ledger, borrower)
    _engine(ledger, lender)
    loan_id = ledger.next_loan_id
    ledger.next_loan_id += 1
    ledger.loans[loan_id] = LoanEntry(loan_id, lender, borrower, blocks, "asked", deadline)
    _log(ledger, now, f"loan {loan_id}: {borrower} asks {lender} for {blocks} blocks: {why}")
    return loan_id


def offer(
    ledger: Ledger,
    loan_id: int,
    kept_blocks: int,
    blocks: int,
    num_bytes: int,
    loans: list[list[Any]],
    deadline: float,
    now: float,
) -> bool:
    """The lender lent the blocks past its `kept_blocks`: the loan is offered. False when the
    request is no longer asked (it expired, or the borrower is gone): the lender then takes
    its memory back."""
    loan = ledger.loans.get(loan_id)
    if loan is None or loan.state != "asked":
        state = "gone" if loan is None else loan.state
        _log(ledger, now, f"loan {loan_id}: lent, but the request is {state}: reclaimed")
        return False
    loan.state, loan.blocks, loan.num_bytes = "offered", blocks, num_bytes
    loan.loans, loan.deadline, loan.kept_blocks = loans, deadline, kept_blocks
    _log(ledger, now, f"loan {loan_id}: {loan.lender} offers {loan.borrower} {blocks} blocks")
    return True


def lent(
    ledger: Ledger,
    loan_id: int,
    lender: str,
    kept_blocks: int,
    blocks: int,
    num_bytes: int,
    loans: list[list[Any]],
    deadline: float,
    now: float,
) -> str:
    """Posts a lend that `lender` made for request `loan_id`, late or again (a lend posted
    already changes nothing): offered while the request is asked; else (it expired, was
    refused or withdrawn meanwhile, and no borrower can have it) the loan is `returned`, with
    no borrower, for the lender to reclaim. Returns the loan's state."""
    loan = ledger.loans.get(loan_id)
    if loan is not None and loan.lender == lender and loan.state in HOLDING:
        return loan.state
    if offer(ledger, loan_id, kept_blocks, blocks, num_bytes, loans, deadline, now):
        return "offered"
    why = "lent, but the request had ended: the lender takes it back"
    ledger.loans[loan_id] = LoanEntry(
        loan_id,
        lender,
        "",
        blocks,
        "returned",
        now,
        num_bytes,
        kept_blocks=kept_blocks,
        reason=why,
        loans=loans,
    )
    return "returned"


def end_offer(ledger: Ledger, loan_id: int, reason: str, now: float) -> None:
    """The lender takes back offer `loan_id` at its next serve, taken or not (it settles): its
    deadline is past. A loan taken meanwhile waits for its borrower to give it back."""
    loan = ledger.loans.get(loan_id)
    if loan is not None and loan.state == "offered" and loan.deadline > 0.0:
        loan.deadline = 0.0
        _log(ledger, now, f"loan {loan_id}: {loan.lender} takes its offer back: {reason}")


def withdraw(ledger: Ledger, loan_id: int, reason: str, now: float) -> None:
    """The borrower withdraws request `loan_id` (asked, refused or expired: no memory moved)."""
    loan = ledger.loans.get(loan_id)
    if loan is not None and loan.state in ("asked", "refused", "expired"):
        del ledger.loans[loan_id]
        _log(ledger, now, f"loan {loan_id}: {loan.borrower} withdraws its request: {reason}")


def commit_ahead(ledger: Ledger, name: str, blocks: int) -> None:
    """Engine `name` is about to commit `blocks` blocks of the device's free memory: counted
    before it does, so that no other engine plans on the same memory. Its next record says
    what it committed."""
    engine = _engine(ledger, name)
    engine.committed_blocks += blocks
    engine.physical_bytes += blocks * engine.block_bytes


def lend_ahead(ledger: Ledger, name: str, blocks: int) -> None:
    """Engine `name` is about to lend `blocks` blocks for a request it answers: counted before
    it does, so that its next answer in the same round plans on what is left. Its next record
    says what it lent."""
    engine = _engine(ledger, name)
    engine.committed_blocks = max(0, engine.committed_blocks - blocks)


def refuse(ledger: Ledger, loan_id: int, reason: str, now: float) -> None:
    reason = _reason(reason)
    loan = ledger.loans.get(loan_id)
    if loan is not None and loan.state == "asked":
        loan.state, loan.reason = "refused", reason
        _log(ledger, now, f"loan {loan_id}: {loan.lender} refuses: {reason}")


def released(ledger: Ledger, loan_id: int, blocks: int, now: float) -> None:
    """The lender answered request `loan_id` through the driver (`via="driver"`): it gave
    `blocks` back to the device, which the borrower commits at its next request. The request
    ends here: no memory changes owner, so nothing follows it."""
    loan = ledger.loans.get(loan_id)
    if loan is not None and loan.state in ("asked", "expired"):
        del ledger.loans[loan_id]
        _log(
            ledger,
            now,
            f"loan {loan_id}: {loan.lender} released {blocks} blocks to the driver for "
            f"{loan.borrower or 'a borrower that is gone'}",
        )


def took(ledger: Ledger, entry: LoanEntry, start_block: int, now: float) -> None:
    """The borrower mapped the loan's memory from its block `start_block`. If the entry is
    gone (its lender died meanwhile), it comes back as an orphan: the borrower holds the
    memory, and giving it back frees it."""
    loan = ledger.loans.get(entry.loan_id)
    if loan is None:
        loan = LoanEntry(
            entry.loan_id,
            "",
            entry.borrower,
            entry.blocks,
            "borrowed",
            entry.deadline,
            entry.num_bytes,
            kept_blocks=entry.kept_blocks,
            reason=_reason(f"lender {entry.lender} died"),
            loans=entry.loans,
        )
        ledger.loans[loan.loan_id] = loan
    loan.state, loan.start_block = "borrowed", start_block
    _log(
        ledger,
        now,
        f"loan {loan.loan_id}: {loan.borrower} borrowed {loan.blocks} blocks "
        f"from {loan.lender or 'a dead lender'}, at block {start_block}",
    )


def returned(ledger: Ledger, loan_id: int, reason: str, now: float) -> None:
    """The borrower gave the loan back (or could not take it): the lender reclaims it. An
    orphan (its lender dead) ends here."""
    reason = _reason(reason)
    loan = ledger.loans.get(loan_id)
    if loan is None:
        return
    if not loan.lender:
        del ledger.loans[loan_id]
        _log(ledger, now, f"loan {loan_id}: {loan.borrower} freed it ({reason})")
        return
    loan.state, loan.reason, loan.recall = "returned", reason, False
    _log(ledger, now, f"loan {loan_id}: {loan.borrower} gave it back ({reason})")


def reclaimed(ledger: Ledger, loan_id: int, now: float) -> None:
    loan = ledger.loans.pop(loan_id, None)
    if loan is not None:
        _log(ledger, now, f"loan {loan_id}: {loan.lender} reclaimed {loan.blocks} blocks")


def forget(ledger: Ledger, loan_id: int) -> None:
    """The borrower read a refused or expired request."""
    loan = ledger.loans.get(loan_id)
    if loan is not None and loan.state in ("refused", "expired"):
        del ledger.loans[loan_id]


def recall(ledger: Ledger, loan_id: int, reason: str, now: float, by: str = "") -> None:
    """The lender wants its memory back (or engine `by` wants it back with the lender, to
    borrow it from there): the borrower gives the loan back once the blocks are free."""
    loan = ledger.loans.get(loan_id)
    if loan is not None and loan.state in ("offered", "borrowed") and not loan.recall:
        loan.recall = True
        who = f"{by} recalls it for {loan.lender}" if by else f"{loan.lender} recalls it"
        _log(ledger, now, f"loan {loan_id}: {who}: {reason}")


def engine(ledger: Ledger, name: str) -> Engine:
    """Engine `name`'s entry; a `ValueError` naming the pool's engines if it has none (it
    left, or the pool was reset)."""
    return _engine(ledger, name)


def _engine(ledger: Ledger, name: str) -> Engine:
    try:
        return ledger.engines[name]
    except KeyError:
        known = ", ".join(sorted(ledger.engines)) or "none"
        raise ValueError(f"no engine {name!r} in the pool (engines: {known})") from None


def check(ledger: Ledger) -> list[str]:
    """What is inconsistent in `ledger`, as sentences (empty: nothing). Holds between any two
    transactions: a member posts its numbers in the same transaction as the loans they
    follow from."""
    problems = []
    borrowed: dict[str, int] = {}
    lent: dict[str, int] = {}
    for loan in ledger.loans.values():
        if loan.state in ("borrowed",):
            borrowed[loan.borrower] = borrowed.get(loan.borrower, 0) + loan.num_bytes
        if loan.lender and loan.state in ("offered", "borrowed", "returned"):
            lent[loan.lender] = lent.get(loan.lender, 0) + loan.num_bytes
        for role in ("lender", "borrower"):
            name = getattr(loan, role)
            if name and name not in ledger.engines:
                problems.append(f"loan {loan.loan_id}'s {role} {name} is not in the pool")
    for name, engine in ledger.engines.items():
        if engine.borrowed_bytes != borrowed.get(name, 0):
            problems.append(
                f"{name} says it borrowed {engine.borrowed_bytes} B, its loans "
                f"{borrowed.get(name, 0)} B"
            )
        if engine.lent_bytes != lent.get(name, 0):
            problems.append(
                f"{name} says it lent {engine.lent_bytes} B, its loans {lent.get(name, 0)} B"
            )
        if engine.physical_bytes < engine.committed_blocks * engine.block_bytes:
            problems.append(
                f"{name} holds {engine.physical_bytes} B, less than its "
                f"{engine.committed_blocks} committed blocks"
            )
    return problems


def used_bytes(ledger: Ledger, device: str) -> int:
    """The bytes the pool's engines hold on `device`: what each maps (borrowed memory too),
    and what lenders hold unmapped (offered, or returned and not yet reclaimed)."""
    mapped = sum(e.physical_bytes for e in ledger.engines.values() if e.device == device)
    unmapped = sum(
        loan.num_bytes
        for loan in ledger.loans.values()
        if loan.state in ("offered", "returned")
        and loan.lender in ledger.engines
        and ledger.engines[loan.lender].device == device
    )
    return mapped + unmapped
