"""The ledger's rules: every change to a `Ledger`, as functions of the ledger and the time.

A loan's states (`LoanState`, with what holds in each) and the one function that moves a
loan from one to the next, in the manner of SQLite's pager (`(none)`: no entry):

    (none)   -> asked     [ask]        the borrower asks a lender for blocks
    asked    -> offered   [lent]       the lender lent for it
    asked    -> refused   [refuse]     the lender says no
    asked    -> expired   [expire]     the lender did not answer by the deadline
    asked    -> released  [released]   the lender gave blocks back to the driver for it
    expired  -> released  [released]
    asked    -> (none)    [withdraw]   the borrower withdraws its request, or a party is gone
    refused  -> (none)    [withdraw]   the borrower read the answer
    expired  -> (none)    [withdraw]
    released -> (none)    [withdraw]
    (none)   -> returned  [lent]       a lend posted for a request that had ended: the lender
    refused  -> returned  [lent]         takes it back (no borrower can have it)
    expired  -> returned  [lent]
    released -> returned  [lent]
    offered  -> borrowed  [took]       the borrower maps it
    (none)   -> borrowed  [took]       ... after its lender died: an orphan
    offered  -> returned  [returned]   the borrower could not take it, or died
    borrowed -> returned  [returned]   the borrower gave it back, or died
    borrowed -> (none)    [returned]   an orphan given back: the memory is freed
    offered  -> (none)    [reclaimed]  the lender took its offer back, or died with it
    returned -> (none)    [reclaimed]  the lender reclaimed it, or died

`TRANSITIONS` is that table; `_check` refuses any other move (an `AssertionError`: a bug
here), and `tests/test_pool_rules.py` drives every rule from every state and checks that the
moves made are exactly the table's. Changes that move no state have a rule each too: `recall`
(the loan's flag), `end_offer` (an offer's deadline), and the engines' (`join`, `leave`,
`record`, `set_limits`, `set_cap`, `commit_ahead`, `lend_ahead`, `expire`'s `stuck`); `drop`
applies a gone engine's rules to its loans through the functions above.

These run inside a `Pool.transaction`, under the pool's lock, and do no I/O: the memory itself
moves outside the lock (a lend, a borrow, a reclaim), and its outcome is posted in the next
transaction. So each function here changes the ledger from one consistent state to another,
and `check` says what consistent means. No other module changes a ledger (the pool's members
read it and call these).

`reap` is the recovery step that whoever takes the lock runs first (as every SQLite reader
re-checks what a dead writer left): an engine whose process is gone, or whose pid now names
another process, leaves the pool, and its loans follow the rules below; a request its lender
did not answer in time expires. Every change is logged with its reason, in the ledger's event
list (for `pool status`) and to the `extensible_kv.pool` logger.

A post can fail after its memory moved (the lock held too long, a full `/dev/shm`, a corrupt
ledger). The member then posts it at its next transaction, from its own notes of what it
moved (`extensible_kv.pool.notes`), through the same rules: so each rule that posts a move
(`lent`, `took`, `returned`, `reclaimed`, `released`) changes nothing when the move is posted
already, and `lent` returns a lend whose request ended meanwhile to its lender. What the
member counts ahead of a move (`commit_ahead`, `lend_ahead`) its next `record` corrects.
Every value a rule writes is one the ledger's readers accept (`check_cap`, the limits'
checks, reasons cut to `MAX_REASON`).

Across models the pool counts bytes: a cap, what the pool holds (`used_bytes`), what a request
asks (`PoolLoan.asked_bytes`) and what a loan moves (`num_bytes`); each engine's limits and
holdings stay in its own blocks.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from extensible_kv import _args
from extensible_kv.ipc import Loan
from extensible_kv.pool.ledger import (
    ENGINE_NAME,
    MAX_INT,
    MAX_REASON,
    Engine,
    Ledger,
    LoanState,
    PoolLoan,
    check_device,
)

logger = logging.getLogger("extensible_kv.pool")

__all__ = [
    "MAX_BLOCKS",
    "TRANSITIONS",
    "ask",
    "check",
    "check_cap",
    "commit_ahead",
    "drop",
    "end_offer",
    "engine",
    "expire",
    "join",
    "leave",
    "lend_ahead",
    "lent",
    "limits_in_blocks",
    "reap",
    "recall",
    "reclaimed",
    "record",
    "refuse",
    "released",
    "returned",
    "set_cap",
    "set_limits",
    "took",
    "used_bytes",
    "withdraw",
]

# The most blocks (or bytes) a limit or a cap may say: the ledger's readers refuse integers
# from `MAX_INT` up.
MAX_BLOCKS = MAX_INT - 1

_S = LoanState
# The table at the head of this module: (from, to) -> the one function that makes the move.
TRANSITIONS: dict[tuple[LoanState | None, LoanState | None], str] = {
    (None, _S.ASKED): "ask",
    (_S.ASKED, _S.OFFERED): "lent",
    (_S.ASKED, _S.REFUSED): "refuse",
    (_S.ASKED, _S.EXPIRED): "expire",
    (_S.ASKED, _S.RELEASED): "released",
    (_S.EXPIRED, _S.RELEASED): "released",
    (_S.ASKED, None): "withdraw",
    (_S.REFUSED, None): "withdraw",
    (_S.EXPIRED, None): "withdraw",
    (_S.RELEASED, None): "withdraw",
    (None, _S.RETURNED): "lent",
    (_S.REFUSED, _S.RETURNED): "lent",
    (_S.EXPIRED, _S.RETURNED): "lent",
    (_S.RELEASED, _S.RETURNED): "lent",
    (_S.OFFERED, _S.BORROWED): "took",
    (None, _S.BORROWED): "took",
    (_S.OFFERED, _S.RETURNED): "returned",
    (_S.BORROWED, _S.RETURNED): "returned",
    (_S.BORROWED, None): "returned",
    (_S.OFFERED, None): "reclaimed",
    (_S.RETURNED, None): "reclaimed",
}


def _check(before: LoanState | None, after: LoanState | None, by: str) -> None:
    """Every move of a loan's state passes here: it must be the table's, made by its one
    function."""
    if TRANSITIONS.get((before, after)) != by:
        raise AssertionError(
            f"{by} moved a loan {before or '(none)'} -> {after or '(none)'}, which the table "
            f"gives to {TRANSITIONS.get((before, after), 'no function')}"
        )


def _create(ledger: Ledger, loan: PoolLoan, by: str) -> None:
    """Enters `loan` (in its state), in place of any entry of its id."""
    old = ledger.loans.get(loan.loan_id)
    _check(None if old is None else LoanState(old.state), LoanState(loan.state), by)
    ledger.loans[loan.loan_id] = loan


def _set(loan: PoolLoan, state: LoanState, by: str) -> None:
    _check(LoanState(loan.state), state, by)
    loan.state = state


def _remove(ledger: Ledger, loan_id: int, by: str) -> PoolLoan:
    loan = ledger.loans[loan_id]
    _check(LoanState(loan.state), None, by)
    del ledger.loans[loan_id]
    return loan


def _log(ledger: Ledger, now: float, text: str) -> None:
    ledger.log(now, text)
    logger.info("pool: %s", text)


def _reason(text: str) -> str:
    """A reason as the ledger keeps it: a borrow's error may be longer than its readers take."""
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


# ---------------------------------------------------------------------------------------------
# recovery, and the engines


def reap(ledger: Ledger, now: float, alive: Callable[[int, int], bool]) -> list[str]:
    """Removes every engine whose process is gone (`alive(pid, start_time)` is false), with
    its loans' rules applied (`drop`), and expires every request past its deadline (`expire`).
    Returns the events."""
    before = len(ledger.events)
    for gone in list(ledger.engines.values()):
        if not alive(gone.pid, gone.start_time):
            drop(ledger, gone.name, now, f"{gone.name} (pid {gone.pid}) died")
    for loan in list(ledger.loans.values()):
        if loan.state == _S.ASKED and loan.deadline < now:
            expire(ledger, loan.loan_id, now)
    return [event.text for event in ledger.events[before:]]


def expire(ledger: Ledger, loan_id: int, now: float) -> None:
    """Request `loan_id` was not answered by its deadline: it expires, and its lender is
    `stuck` until its next heartbeat (`record`)."""
    loan = ledger.loans.get(loan_id)
    if loan is None or loan.state != _S.ASKED:
        return
    _set(loan, _S.EXPIRED, "expire")
    loan.reason = f"{loan.lender} did not answer within the bound"
    ledger.engines[loan.lender].stuck = True
    _log(ledger, now, f"loan {loan_id}: {loan.reason}; {loan.lender} is stuck")


def drop(ledger: Ledger, name: str, now: float, why: str) -> None:
    """Engine `name` is gone (dead, or left by force): its entry goes, and its loans follow
    the rules. As a lender: a borrowed loan stays with its borrower, lender-less (giving it
    back frees it); an offered or returned loan's memory died with the lender's process
    (`reclaimed`); its requests end (`withdraw`). As a borrower: what it held goes back to its
    lender (`returned`: the kernel unmapped it), lender-less loans are freed, its requests
    end."""
    _log(ledger, now, f"{why}: its entry goes")
    for loan in ledger.loans_of(name):
        state = LoanState(loan.state)
        if state == _S.ASKED or state.ended:
            role = "lender" if loan.lender == name else "borrower"
            withdraw(ledger, loan.loan_id, f"its {role} {name} is gone", now)
        elif loan.lender == name:
            if state == _S.BORROWED:
                # The borrower maps the handles and holds them; the lender's board is gone
                # with it, so giving them back returns the memory to the driver.
                loan.lender = ""
                loan.reason = f"lender {name} died: giving it back frees it"
                _log(ledger, now, f"loan {loan.loan_id}: {loan.reason}")
            else:  # offered or returned: the kernel freed the lender's memory with it
                reclaimed(ledger, loan.loan_id, now, why=f"it ends with its lender {name}")
        else:
            if state != _S.RETURNED:
                # The kernel unmapped the borrower's memory; the lender's reclaim sees it gone.
                returned(ledger, loan.loan_id, f"borrower {name} died", now)
            if loan.loan_id in ledger.loans:  # an orphan given back is gone
                loan.borrower = ""
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
    check_device(engine.device, "the engine's device")
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
    they follow the rules of a dead engine's (`drop`)."""
    _engine(ledger, name)
    busy = [loan for loan in ledger.loans_of(name) if not LoanState(loan.state).ended]
    if busy and not force:
        ids = ", ".join(f"{loan.loan_id} ({loan.state})" for loan in busy)
        raise ValueError(f"{name} has loans in flight: {ids}; give back and reclaim first")
    drop(ledger, name, now, f"{name} left")


def limits_in_blocks(
    engine: Engine,
    min_blocks: int | None = None,
    max_blocks: int | None = None,
    *,
    min_bytes: int | None = None,
    max_bytes: int | None = None,
) -> tuple[int | None, int | None]:
    """Limits given in blocks or in bytes, as `engine`'s own blocks: a minimum in bytes is the
    fewest blocks that hold it, a maximum the most that fit in it. Each limit at most one way
    (a `ValueError`); None where it is not given."""
    for what, blocks, num_bytes in (("min", min_blocks, min_bytes), ("max", max_blocks, max_bytes)):
        _args.optional_size(blocks, f"{what}_blocks", maximum=MAX_BLOCKS)
        _args.optional_size(num_bytes, f"{what}_bytes", maximum=MAX_BLOCKS)
        if blocks is not None and num_bytes is not None:
            raise ValueError(f"give {what}_blocks or {what}_bytes, not both")
    block_bytes = engine.block_bytes
    if min_bytes is not None:
        min_blocks = -(-min_bytes // block_bytes)
    if max_bytes is not None:
        max_blocks = max_bytes // block_bytes
    return min_blocks, max_blocks


def set_limits(
    ledger: Ledger,
    name: str,
    now: float,
    min_blocks: int | None,
    max_blocks: int | None,
    *,
    min_bytes: int | None = None,
    max_bytes: int | None = None,
) -> None:
    """Engine `name`'s limits, in its blocks or in bytes (`limits_in_blocks`); a limit not
    given stays."""
    engine = _engine(ledger, name)
    low, high = limits_in_blocks(
        engine, min_blocks, max_blocks, min_bytes=min_bytes, max_bytes=max_bytes
    )
    low = engine.min_blocks if low is None else low
    high = engine.max_blocks if high is None else high
    if not 0 <= low <= high <= engine.capacity_blocks:
        bb = engine.block_bytes
        raise ValueError(
            f"need 0 <= min <= max <= capacity, got min {low}, max {high}, capacity "
            f"{engine.capacity_blocks} (blocks of {bb} B: {low * bb} B, {high * bb} B, "
            f"{engine.capacity_blocks * bb} B)"
        )
    engine.min_blocks, engine.max_blocks = low, high
    bb = engine.block_bytes
    _log(ledger, now, f"{name}'s limits are now {low}..{high} blocks ({low * bb}..{high * bb} B)")


def check_cap(device: object, num_bytes: object) -> None:
    """A cap as the ledger reads it: a device (`cpu`, `cuda:N`) and an int of bytes, or None;
    else a `TypeError` or `ValueError` naming what is wrong."""
    check_device(device, "a cap's device")
    _args.optional_size(num_bytes, "a cap (a number of bytes)", maximum=MAX_BLOCKS)


def set_cap(ledger: Ledger, device: str, num_bytes: int | None, now: float) -> None:
    """Caps the bytes the pool's engines may hold on `device` in all (None: no cap, the
    device's free memory alone)."""
    check_cap(device, num_bytes)
    if num_bytes is None:
        ledger.caps.pop(device, None)
        _log(ledger, now, f"the pool may use all the free memory of {device}")
    else:
        ledger.caps[device] = num_bytes
        _log(ledger, now, f"the pool may hold {num_bytes} B of {device}")


def check_share(device: object, num_bytes: object) -> None:
    """Deprecated: `check_cap`."""
    warnings.warn("rules.check_share is deprecated: use check_cap", DeprecationWarning, 2)
    check_cap(device, num_bytes)


def set_share(ledger: Ledger, device: str, num_bytes: int | None, now: float) -> None:
    """Deprecated: `set_cap`."""
    warnings.warn("rules.set_share is deprecated: use set_cap", DeprecationWarning, 2)
    set_cap(ledger, device, num_bytes, now)


def record(
    ledger: Ledger, name: str, now: float, numbers: dict[str, Any], *, heartbeat: bool = True
) -> None:
    """What engine `name` holds now (`committed_blocks`, `physical_bytes`, `lent_bytes`,
    `borrowed_bytes`, `lendable_blocks`, `spare_blocks` and `busy`, any of them), and with
    `heartbeat` that it is alive and answering at `now`."""
    engine = _engine(ledger, name)
    for key, value in numbers.items():
        setattr(engine, key, value)
    if heartbeat:
        engine.heartbeat = now
        engine.stuck = False


def commit_ahead(ledger: Ledger, name: str, blocks: int) -> None:
    """Engine `name` is about to commit `blocks` blocks of the device's free memory: counted
    before it does, so that no other engine plans on the same memory. Its next record says
    what it committed."""
    engine = _engine(ledger, name)
    shape = engine.shape
    # What the commit maps: whole granules per segment, not the blocks' bytes.
    engine.physical_bytes += shape.mapped_bytes(engine.committed_blocks + blocks) - (
        shape.mapped_bytes(engine.committed_blocks)
    )
    engine.committed_blocks += blocks


def lend_ahead(ledger: Ledger, name: str, blocks: int) -> None:
    """Engine `name` is about to lend `blocks` blocks for a request it answers: counted before
    it does, so that its next answer in the same round plans on what is left. Its next record
    says what it lent."""
    engine = _engine(ledger, name)
    engine.committed_blocks = max(0, engine.committed_blocks - blocks)


# ---------------------------------------------------------------------------------------------
# a loan, from the request to the reclaim (the table above)


def ask(
    ledger: Ledger, borrower: str, lender: str, blocks: int, deadline: float, now: float, why: str
) -> int:
    """A request of `borrower` to `lender` for `blocks` of the borrower's blocks; returns the
    loan id."""
    needy = _engine(ledger, borrower)
    _engine(ledger, lender)
    loan_id = ledger.next_loan_id
    ledger.next_loan_id += 1
    asked_bytes = blocks * needy.block_bytes
    loan = PoolLoan(loan_id, lender, borrower, blocks, _S.ASKED, deadline, asked_bytes=asked_bytes)
    _create(ledger, loan, "ask")
    _log(
        ledger,
        now,
        f"loan {loan_id}: {borrower} asks {lender} for {blocks} blocks ({asked_bytes} B): {why}",
    )
    return loan_id


def lent(
    ledger: Ledger,
    loan_id: int,
    lender: str,
    *,
    kept_blocks: int,
    lent_blocks: int,
    blocks: int,
    loans: Sequence[Loan],
    deadline: float,
    now: float,
) -> LoanState:
    """Posts a lend that `lender` made for request `loan_id` (late, or again: a lend posted
    already changes nothing): it kept `kept_blocks` of its blocks and lent the `lent_blocks`
    past them as `loans`, which give the borrower `blocks` of its blocks. While the request
    is asked, the loan is offered until `deadline`; else (it ended, and no borrower can have
    it) it is `returned`, with no borrower, for the lender to reclaim. Returns the loan's
    state."""
    loan = ledger.loans.get(loan_id)
    if loan is not None and loan.memory_out:  # posted already (or, lender-less, never ours)
        return LoanState(loan.state)
    num_bytes = sum(x.num_bytes for x in loans)
    if loan is not None and loan.state == _S.ASKED:
        _set(loan, _S.OFFERED, "lent")
        loan.blocks, loan.num_bytes, loan.loans = blocks, num_bytes, tuple(loans)
        loan.deadline, loan.kept_blocks, loan.lent_blocks = deadline, kept_blocks, lent_blocks
        _log(
            ledger,
            now,
            f"loan {loan_id}: {lender} offers {loan.borrower} {lent_blocks} blocks "
            f"({num_bytes} B: {blocks} of {loan.borrower}'s)",
        )
        return LoanState.OFFERED
    state = "gone" if loan is None else loan.state
    _log(ledger, now, f"loan {loan_id}: lent, but the request is {state}: reclaimed")
    back = PoolLoan(
        loan_id,
        lender,
        "",
        blocks,
        _S.RETURNED,
        now,
        num_bytes,
        kept_blocks=kept_blocks,
        reason="lent, but the request had ended: the lender takes it back",
        loans=tuple(loans),
        asked_bytes=0 if loan is None else loan.asked_bytes,
        lent_blocks=lent_blocks,
    )
    _create(ledger, back, "lent")
    return LoanState.RETURNED


def end_offer(ledger: Ledger, loan_id: int, reason: str, now: float) -> None:
    """The lender takes back offer `loan_id` at its next serve, taken or not (it settles): its
    deadline is past. A loan taken meanwhile waits for its borrower to give it back."""
    loan = ledger.loans.get(loan_id)
    if loan is not None and loan.state == _S.OFFERED and loan.deadline > 0.0:
        loan.deadline = 0.0
        _log(ledger, now, f"loan {loan_id}: {loan.lender} takes its offer back: {reason}")


def withdraw(ledger: Ledger, loan_id: int, reason: str, now: float) -> None:
    """Request `loan_id` ends with no memory moved (asked, refused, expired or released): the
    borrower withdraws it or read its answer (`reason` empty: not logged), or one of its
    parties is gone."""
    loan = ledger.loans.get(loan_id)
    if loan is None or not (loan.state == _S.ASKED or LoanState(loan.state).ended):
        return
    _remove(ledger, loan_id, "withdraw")
    if loan.state == _S.ASKED:
        _log(ledger, now, f"loan {loan_id}: {loan.borrower} withdraws its request: {reason}")
    elif reason:
        _log(ledger, now, f"loan {loan_id} ({loan.state}) ends: {reason}")


def refuse(ledger: Ledger, loan_id: int, reason: str, now: float) -> None:
    reason = _reason(reason)
    loan = ledger.loans.get(loan_id)
    if loan is not None and loan.state == _S.ASKED:
        _set(loan, _S.REFUSED, "refuse")
        loan.reason = reason
        _log(ledger, now, f"loan {loan_id}: {loan.lender} refuses: {reason}")


def released(ledger: Ledger, loan_id: int, blocks: int, now: float) -> None:
    """The lender answered request `loan_id` through the driver (`via="driver"`): it gave
    `blocks` of its blocks back to the device, which the borrower commits. No memory changes
    owner; the borrower reads the answer and withdraws it."""
    loan = ledger.loans.get(loan_id)
    if loan is not None and loan.state in (_S.ASKED, _S.EXPIRED):
        _set(loan, _S.RELEASED, "released")
        loan.lent_blocks = blocks
        _log(
            ledger,
            now,
            f"loan {loan_id}: {loan.lender} released {blocks} blocks to the driver for "
            f"{loan.borrower}",
        )


def took(
    ledger: Ledger,
    entry: PoolLoan,
    start_block: int,
    now: float,
    blocks: int = 0,
    mapped_bytes: int = 0,
) -> None:
    """The borrower mapped `mapped_bytes` of the loan's memory (0: all of it) from its block
    `start_block`, `blocks` of its blocks (0: what the offer said); handles its layout could
    not use went back to the lender at once. If the entry is gone (its lender died
    meanwhile), it comes back as an orphan: the borrower holds the memory, and giving it back
    frees it. A loan taken already changes nothing."""
    loan = ledger.loans.get(entry.loan_id)
    if loan is None:
        loan = PoolLoan(
            entry.loan_id,
            "",
            entry.borrower,
            entry.blocks,
            _S.BORROWED,
            entry.deadline,
            entry.num_bytes,
            start_block,
            kept_blocks=entry.kept_blocks,
            reason=_reason(f"lender {entry.lender} died"),
            loans=entry.loans,
            asked_bytes=entry.asked_bytes,
            lent_blocks=entry.lent_blocks,
        )
        _create(ledger, loan, "took")
    elif loan.state == _S.OFFERED:
        _set(loan, _S.BORROWED, "took")
    else:
        return
    loan.start_block = start_block
    loan.blocks = blocks or loan.blocks
    loan.mapped_bytes = min(mapped_bytes or loan.num_bytes, loan.num_bytes)
    declined = loan.num_bytes - loan.mapped_bytes
    back = f"; {declined} B it cannot use back to the lender" if declined else ""
    _log(
        ledger,
        now,
        f"loan {loan.loan_id}: {loan.borrower} borrowed {loan.lent_blocks} blocks "
        f"from {loan.lender or 'a dead lender'} ({loan.num_bytes} B: {loan.blocks} of its own"
        f"{back}), at block {start_block}",
    )


def returned(ledger: Ledger, loan_id: int, reason: str, now: float) -> None:
    """The borrower gave the loan back, could not take it, or died: the lender reclaims it.
    An orphan (its lender dead) ends here: the memory is freed."""
    reason = _reason(reason)
    loan = ledger.loans.get(loan_id)
    if loan is None or loan.state not in (_S.OFFERED, _S.BORROWED):
        return
    if not loan.lender:
        _remove(ledger, loan_id, "returned")
        _log(ledger, now, f"loan {loan_id}: {loan.borrower} freed it ({reason})")
        return
    _set(loan, _S.RETURNED, "returned")
    loan.reason, loan.recall, loan.mapped_bytes = reason, False, 0
    _log(ledger, now, f"loan {loan_id}: {loan.borrower} gave it back ({reason})")


def reclaimed(ledger: Ledger, loan_id: int, now: float, *, why: str = "") -> None:
    """The lender took its memory back (an offer not taken in time, or a loan given back), or
    died with it (`why`): the loan ends."""
    loan = ledger.loans.get(loan_id)
    if loan is None or loan.state not in (_S.OFFERED, _S.RETURNED):
        return
    _remove(ledger, loan_id, "reclaimed")
    if why:
        _log(ledger, now, f"loan {loan_id} ({loan.state}): {why}")
    else:
        _log(ledger, now, f"loan {loan_id}: {loan.lender} reclaimed {loan.lent_blocks} blocks")


def recall(ledger: Ledger, loan_id: int, reason: str, now: float, by: str = "") -> None:
    """The lender wants its memory back (or engine `by` wants it back with the lender, to
    borrow it from there): the borrower gives the loan back once the blocks are free."""
    loan = ledger.loans.get(loan_id)
    if loan is not None and loan.state in (_S.OFFERED, _S.BORROWED) and not loan.recall:
        loan.recall = True
        who = f"{by} recalls it for {loan.lender}" if by else f"{loan.lender} recalls it"
        _log(ledger, now, f"loan {loan_id}: {who}: {reason}")


# ---------------------------------------------------------------------------------------------
# reading


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
    lent_: dict[str, int] = {}
    for loan in ledger.loans.values():
        if loan.state == _S.BORROWED:
            borrowed[loan.borrower] = borrowed.get(loan.borrower, 0) + loan.mapped_bytes
        if loan.lender and loan.memory_out:
            lent_[loan.lender] = lent_.get(loan.lender, 0) + loan.num_bytes
        for role in ("lender", "borrower"):
            name = getattr(loan, role)
            if name and name not in ledger.engines:
                problems.append(f"loan {loan.loan_id}'s {role} {name} is not in the pool")
    for name, e in ledger.engines.items():
        if e.borrowed_bytes != borrowed.get(name, 0):
            problems.append(
                f"{name} says it borrowed {e.borrowed_bytes} B, its loans {borrowed.get(name, 0)} B"
            )
        if e.lent_bytes != lent_.get(name, 0):
            problems.append(
                f"{name} says it lent {e.lent_bytes} B, its loans {lent_.get(name, 0)} B"
            )
        if e.physical_bytes < e.committed_bytes:
            problems.append(
                f"{name} holds {e.physical_bytes} B, less than its "
                f"{e.committed_blocks} committed blocks"
            )
    return problems


def used_bytes(ledger: Ledger, device: str) -> int:
    """The bytes the pool's engines hold on `device`: what each maps (borrowed memory too),
    and what lenders hold unmapped (offered, returned and not yet reclaimed, or declined by
    its borrower: the handles of a borrowed loan it does not map)."""
    mapped = sum(e.physical_bytes for e in ledger.engines.values() if e.device == device)
    unmapped = sum(
        loan.num_bytes - loan.mapped_bytes
        for loan in ledger.loans.values()
        if loan.memory_out
        and loan.lender in ledger.engines
        and ledger.engines[loan.lender].device == device
    )
    return mapped + unmapped
