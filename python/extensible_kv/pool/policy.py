"""The pool's policy: pure functions from a ledger snapshot to decisions, each with its reason.

- `plan_grow`: an engine that needs blocks takes the device's free memory first (within the
  pool's share), then borrows from engines above their minimum, idle ones first. An engine
  that has lent blocks recalls them instead: its cache cannot grow over lent blocks until it
  reclaims them. A lender whose newest loans others hold free (an idle engine, or free top
  blocks of a busy one) is not asked: the needy engine recalls them for it, and borrows from
  it once they are back. A borrower lends nothing, and once a needy engine borrowed the
  lender's blocks below its loans out, the lender could not take those back (newest first):
  memory lent to an engine whose burst ended would stay there.
- `plan_answer`: a donor lends the free blocks at the top of its cache at once, never below
  its minimum. One that moves live blocks down (`free_blocks` given: the member's
  `move=True`, the run-time resize's move) lends up to all its free blocks, wherever they lie,
  and moves the live ones above the cut into free ones below it first; one that does not and
  whose top blocks are live refuses, saying so.
- `plan_release`: what an engine gives back on its own: loans recalled by their lender, and
  what it holds past its maximum (limits change at run time), each once its blocks are free
  (for a member that moves live blocks down, once as many blocks are free anywhere).

An unresponsive donor (stale heartbeat, or a request to it expired) is never asked; the rules
(`extensible_kv.pool.rules.reap`) expire what it did not answer.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from extensible_kv.pool.ledger import Engine, Ledger, LoanEntry
from extensible_kv.pool.rules import used_bytes

__all__ = ["Decision", "plan_answer", "plan_grow", "plan_release", "unresponsive"]


@dataclass(frozen=True)
class Decision:
    """What `engine` should do: `commit` blocks of free memory; `ask` `peer` to lend it
    blocks; `recall` loan `loan_id` it lent to `peer`; `lend` blocks for loan `loan_id`
    (`release` them to the driver instead, for a member that moves memory `via="driver"`);
    `refuse` it; `give_back` loan `loan_id`; `shrink` by blocks; `wait` (nothing to do now).
    `reason` says why, for the log."""

    action: str
    engine: str
    blocks: int
    reason: str
    peer: str = ""
    loan_id: int = 0


def unresponsive(engine: Engine, ledger: Ledger, now: float) -> bool:
    return engine.stuck or now - engine.heartbeat > ledger.stale_after_s


def incoming_blocks(ledger: Ledger, name: str) -> int:
    """Blocks already asked for or offered to `name`: not asked again."""
    return sum(
        loan.blocks
        for loan in ledger.loans.values()
        if loan.borrower == name and loan.state in ("asked", "offered")
    )


def plan_grow(
    ledger: Ledger,
    name: str,
    blocks: int,
    *,
    free_bytes: int,
    now: float,
    exclude: Collection[str] = (),
) -> list[Decision]:
    """How engine `name` gets `blocks` more blocks; `free_bytes` is its device's free memory
    now (the engine measures it: the ledger cannot). Donors in `exclude` (ones that refused
    it lately) are not asked."""
    engine = ledger.engines[name]
    pending = incoming_blocks(ledger, name)
    room = engine.max_blocks - engine.committed_blocks - pending
    if room <= 0:
        why = f"at its maximum ({engine.max_blocks} blocks, {pending} of them on their way)"
        return [Decision("wait", name, 0, why)]
    want = min(blocks - pending, room)
    if want <= 0:
        return [Decision("wait", name, 0, f"{pending} blocks are on their way already")]
    capped = f" (capped by its maximum, {engine.max_blocks})" if want < blocks - pending else ""
    lent = [
        loan
        for loan in ledger.loans.values()
        if loan.lender == name and loan.state in ("offered", "borrowed", "returned")
    ]
    if lent:
        return _recall(name, want, lent)
    decisions = []
    free = _free_blocks(ledger, engine, free_bytes)
    if free > 0:
        take = min(want, free)
        why = f"the device has {free} blocks free for the pool{capped}"
        decisions.append(Decision("commit", name, take, why))
        want -= take
    # A lender whose newest loans others hold free (an idle engine, or one whose load shrank)
    # gets them back first and lends them again: once this engine borrowed its lower blocks,
    # it could not take back the loans above them.
    back = _coming_back(ledger, name, now) if want > 0 else {}
    for donor, surplus in _donors(ledger, engine, now):
        if donor.name in exclude or donor.name in back:
            continue
        if want <= 0:
            break
        take = min(want, surplus)
        state = "busy" if donor.busy else "idle"
        why = f"{donor.name} is {state} and can lend {surplus} blocks"
        decisions.append(Decision("ask", name, take, why, peer=donor.name))
        want -= take
    for lender, loans in sorted(back.items()):
        if want <= 0:
            break
        coming = recalled = 0
        for loan in loans:  # newest first
            coming += loan.blocks
            if loan.state == "borrowed" and not loan.recall:
                recalled += 1
                why = (
                    f"{loan.borrower} holds {loan.blocks} of {lender}'s blocks free: "
                    f"back to {lender}, to lend again"
                )
                decisions.append(
                    Decision(
                        "recall", name, loan.blocks, why, peer=loan.borrower, loan_id=loan.loan_id
                    )
                )
        if not recalled:
            why = f"{coming} blocks are on their way back to {lender}, to lend again"
            decisions.append(Decision("wait", name, min(want, coming), why))
        want -= coming
    if want > 0:
        decisions.append(Decision("wait", name, want, "no free memory and no donor for the rest"))
    return decisions


def _coming_back(ledger: Ledger, needy: str, now: float) -> dict[str, list[LoanEntry]]:
    """Per lender other than `needy`: its loans out that can come back to it now without
    `needy`, newest first (the order it takes them back in, so only up to the first that
    cannot): each given back or recalled already, or held by a responsive engine other than
    `needy` whose blocks from the loan's start up are free (all of an idle engine's are)."""
    out: dict[str, list[LoanEntry]] = {}
    for loan in ledger.loans.values():
        if loan.lender and loan.state in ("offered", "borrowed", "returned"):
            out.setdefault(loan.lender, []).append(loan)

    def comes_back(loan: LoanEntry) -> bool:
        if loan.state == "returned":
            return True
        if loan.borrower == needy:  # what it must give back itself first
            return False
        if loan.recall:
            return True
        borrower = ledger.engines.get(loan.borrower)
        return (
            loan.state == "borrowed"
            and borrower is not None
            and not unresponsive(borrower, ledger, now)
            and (
                not borrower.busy
                or loan.start_block >= borrower.committed_blocks - borrower.free_top_blocks
            )
        )

    back: dict[str, list[LoanEntry]] = {}
    for lender, loans in out.items():
        if lender == needy:
            continue
        ready = []
        for loan in sorted(loans, key=lambda loan: loan.kept_blocks):
            if not comes_back(loan):
                break
            ready.append(loan)
        if ready:
            back[lender] = ready
    return back


def _recall(name: str, want: int, lent: list[LoanEntry]) -> list[Decision]:
    """The newest loan (the fewest blocks kept) lies right above what the lender kept: its
    cache grows back contiguously only newest first, so that is the order of the reclaims."""
    decisions = []
    for loan in sorted(lent, key=lambda loan: loan.kept_blocks):
        if want <= 0:
            break
        if loan.state == "returned":
            decisions.append(
                Decision(
                    "wait",
                    name,
                    loan.blocks,
                    "it was given back: reclaim",
                    peer=loan.borrower,
                    loan_id=loan.loan_id,
                )
            )
        elif not loan.recall:
            why = "its cache grows only once its lent blocks are back"
            decisions.append(
                Decision("recall", name, loan.blocks, why, peer=loan.borrower, loan_id=loan.loan_id)
            )
        want -= loan.blocks
    return decisions or [Decision("wait", name, 0, "its loans are recalled already")]


def _free_blocks(ledger: Ledger, engine: Engine, free_bytes: int) -> int:
    free = free_bytes
    share = ledger.shares.get(engine.device)
    if share is not None:
        free = min(free, share - used_bytes(ledger, engine.device))
    return max(free, 0) // engine.block_bytes


def _donors(ledger: Ledger, needy: Engine, now: float) -> list[tuple[Engine, int]]:
    """Engines that may lend to `needy`, with the blocks each can lend (less what was asked of
    it already), idle ones first, then the largest surplus."""
    asked: dict[str, int] = {}
    for loan in ledger.loans.values():
        if loan.state == "asked":
            asked[loan.lender] = asked.get(loan.lender, 0) + loan.blocks
    asking = borrowers(ledger)
    donors = []
    for donor in ledger.engines.values():
        if (
            donor.name == needy.name
            or donor.device != needy.device
            or donor.layout != needy.layout
            or donor.borrowed_bytes
            or donor.name in asking
            or unresponsive(donor, ledger, now)
        ):
            continue
        # What it said it could lend at once (free top blocks at handle boundaries), never
        # below its minimum, less what others asked of it already.
        above_min = donor.committed_blocks - donor.min_blocks
        surplus = min(above_min, donor.lendable_blocks) - asked.get(donor.name, 0)
        if surplus > 0:
            donors.append((donor, surplus))
    donors.sort(key=lambda pair: (pair[0].busy, -pair[1], pair[0].name))
    return donors


def borrowers(ledger: Ledger) -> set[str]:
    """Engines that asked for memory, or hold borrowed memory: they lend nothing (a borrower's
    top blocks are borrowed; two needy engines lending to each other would each be left
    with a loan of its own that blocks its borrow)."""
    return {
        loan.borrower
        for loan in ledger.loans.values()
        if loan.state in ("asked", "offered", "borrowed")
    }


def plan_answer(
    ledger: Ledger,
    name: str,
    loan_id: int,
    *,
    free_tail_blocks: int,
    lend_points: Collection[int] | None = None,
    free_blocks: int | None = None,
) -> Decision:
    """Donor `name`'s answer to request `loan_id`: lend at most its free top blocks
    (`free_tail_blocks`, which only the engine knows), never below its minimum. A donor that
    moves live blocks down before it lends gives `free_blocks` too (all its free blocks, the
    top ones among them): it may lend that many, its live blocks then fitting below the cut.

    `lend_points` (what only the engine knows too: the block counts it may keep, where a
    handle starts in every segment) makes the loan whole handles: the most it asked for that
    ends at one; or, when no handle starts within that many top blocks, the fewest whole
    handles that cover the ask, if they are free and the borrower has room under its maximum
    (a donor of handles larger than the ask would otherwise refuse every small request)."""
    engine, loan = ledger.engines[name], ledger.loans[loan_id]
    if engine.borrowed_bytes or name in borrowers(ledger):
        why = "it holds borrowed blocks or waits for memory itself"
        return Decision("refuse", name, 0, why, loan.borrower, loan_id)
    above_min = engine.committed_blocks - engine.min_blocks
    moves = free_blocks is not None
    free = max(free_tail_blocks, free_blocks or 0)
    lendable = min(free, above_min)
    if lendable <= 0:
        if above_min <= 0:
            why = f"at its minimum ({engine.min_blocks} blocks)"
        elif moves:
            why = f"all {engine.committed_blocks} of its blocks are live"
        else:
            why = (
                f"its top {above_min} blocks above its minimum are live, and it does not move "
                "live blocks down (move=False)"
            )
        return Decision("refuse", name, 0, why, loan.borrower, loan_id)
    blocks = min(loan.blocks, lendable)
    where = "" if moves else " at its top"
    why = f"{lendable} free blocks{where} above its minimum"
    if lend_points is not None:
        sizes = [engine.committed_blocks - k for k in lend_points]
        sizes = [n for n in sizes if 0 < n <= lendable]
        borrower = ledger.engines.get(loan.borrower)
        room = borrower.max_blocks - borrower.committed_blocks if borrower else 0
        fits = [n for n in sizes if n <= blocks]
        covers = [n for n in sizes if blocks < n <= room]
        if fits:
            blocks = max(fits)
        elif covers:
            blocks = min(covers)
            why += f"; {blocks} blocks, the fewest whole handles that cover the ask"
        else:
            why = (
                f"no handle starts within its {blocks} free top blocks, and the whole "
                f"handles past them are more than are free or than {loan.borrower} has room "
                "for (a loan is whole handles)"
            )
            return Decision("refuse", name, 0, why, loan.borrower, loan_id)
    if blocks > free_tail_blocks:
        why += f"; its live blocks past the {blocks} lent move down first"
    return Decision("lend", name, blocks, why, loan.borrower, loan_id)


def plan_release(ledger: Ledger, name: str, *, free_tail_blocks: int) -> list[Decision]:
    """What engine `name` gives back now: borrowed loans recalled, orphaned (their lender
    died) or past its maximum, top first, each once every block from its start is free; then
    its own free top blocks past its maximum."""
    engine = ledger.engines[name]
    used_top = engine.committed_blocks - free_tail_blocks  # blocks below it may be live
    top = engine.committed_blocks
    decisions = []
    borrowed = sorted(
        (
            loan
            for loan in ledger.loans.values()
            if loan.borrower == name and loan.state == "borrowed"
        ),
        key=lambda loan: -loan.start_block,
    )
    for loan in borrowed:
        if loan.recall:
            why = f"{loan.lender} recalled it"
        elif not loan.lender:
            why = "its lender died"
        elif loan.start_block >= engine.max_blocks:
            why = f"it lies past its maximum ({engine.max_blocks} blocks)"
        else:
            break  # a loan below this one cannot go back before it
        if loan.start_block < used_top:
            break  # live blocks: once they are free
        decisions.append(Decision("give_back", name, loan.blocks, why, loan.lender, loan.loan_id))
        top = loan.start_block
    given = {d.loan_id for d in decisions}
    kept_top = max(
        (loan.start_block + loan.blocks for loan in borrowed if loan.loan_id not in given),
        default=0,
    )
    lends = any(
        loan.lender == name and loan.state in ("offered", "borrowed", "returned")
        for loan in ledger.loans.values()
    )
    # A shrink past a borrowed block would give it back behind the ledger's back, and one
    # below lent blocks is no shrink at all: neither is planned.
    keep = max(engine.max_blocks, used_top, kept_top)
    if top > keep and not lends:
        why = f"past its maximum ({engine.max_blocks} blocks)"
        decisions.append(Decision("shrink", name, top - keep, why))
    return decisions
