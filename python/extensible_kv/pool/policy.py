"""The pool's policy: pure functions from a ledger snapshot to decisions, each with its reason.

- `plan_grow`: an engine that needs blocks takes the device's free memory first (within the
  pool's cap), then borrows from engines above their minimum, idle ones first. An engine
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
- `plan_release`: what an engine gives back on its own: loans recalled by their lender, every
  loan once it has been idle a while, and what it holds past its maximum (limits change at
  run time), each once its blocks are free (for a member that moves live blocks down, once
  as many blocks are free anywhere).

Engines of different models share a device: what a needy engine needs is its own blocks, what
a donor can lend is its own blocks, and the two meet in bytes. A donor may lend to any engine
of its device and granularity; the needy engine counts a donor's surplus in its own blocks
(the bytes, in whole blocks of its own), and the donor's answer picks the cut whose handles
give the borrower the most blocks of the borrower's shape it asked for (`cuts`: the engine
says what each of its cuts gives).

A burst gets what its queue needs in one move: `plan_grow` takes what the engine asks for
(the need of its waiting requests, up to its maximum), commits the device's free memory and
asks every donor for the rest in the same round, idle donors first.

An unresponsive donor (stale heartbeat, or a request to it expired) is never asked; the rules
(`extensible_kv.pool.rules.reap`) expire what it did not answer.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from extensible_kv.pool.ledger import Engine, Ledger, LoanState, PoolLoan
from extensible_kv.pool.rules import used_bytes

__all__ = ["Action", "Decision", "plan_answer", "plan_grow", "plan_release", "unresponsive"]


class Action(enum.StrEnum):
    """What a `Decision` says to do. A needy engine's plan (`plan_grow`): `COMMIT` blocks of
    free memory, `ASK` a donor, `RECALL` a loan, `WAIT`. A donor's answer (`plan_answer`):
    `LEND`, or `RELEASE` to the driver (`via="driver"`), or `REFUSE`. What an engine gives
    back on its own (`plan_release`): `GIVE_BACK` a loan, `SHRINK`."""

    COMMIT = "commit"
    ASK = "ask"
    RECALL = "recall"
    WAIT = "wait"
    LEND = "lend"
    RELEASE = "release"
    REFUSE = "refuse"
    GIVE_BACK = "give_back"
    SHRINK = "shrink"


@dataclass(frozen=True)
class Decision:
    """What `engine` should do (`action`), with `blocks` of its own blocks: commit them; ask
    `peer` to lend them; recall loan `loan_id` (that `peer` holds); lend them for loan
    `loan_id` (which gives the borrower `peer_blocks` of its blocks), or release them to the
    driver; refuse it; give back loan `loan_id`; shrink by them; wait. `reason` says why,
    for the log."""

    action: Action
    engine: str
    blocks: int
    reason: str
    peer: str = ""
    loan_id: int = 0
    peer_blocks: int = 0


def unresponsive(engine: Engine, ledger: Ledger, now: float) -> bool:
    return engine.stuck or now - engine.heartbeat > ledger.stale_after_s


def incoming_blocks(ledger: Ledger, name: str) -> int:
    """Blocks (of `name`'s) already asked for or offered to `name`: not asked again."""
    return sum(
        loan.blocks
        for loan in ledger.loans.values()
        if loan.borrower == name and loan.state in (LoanState.ASKED, LoanState.OFFERED)
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
    """How engine `name` gets `blocks` more of its blocks (what its waiting requests need):
    the device's free memory first, then every donor, idle ones first, all in this one plan;
    `free_bytes` is its device's free memory now (the engine measures it: the ledger cannot).
    Donors in `exclude` (ones that refused it lately) are not asked."""
    engine = ledger.engines[name]
    pending = incoming_blocks(ledger, name)
    room = engine.max_blocks - engine.committed_blocks - pending
    if room <= 0:
        why = f"at its maximum ({engine.max_blocks} blocks, {pending} of them on their way)"
        return [Decision(Action.WAIT, name, 0, why)]
    want = min(blocks - pending, room)
    if want <= 0:
        return [Decision(Action.WAIT, name, 0, f"{pending} blocks are on their way already")]
    capped = f" (capped by its maximum, {engine.max_blocks})" if want < blocks - pending else ""
    lent = [loan for loan in ledger.loans.values() if loan.lender == name and loan.memory_out]
    if lent:
        return _recall(name, want, lent)
    decisions = []
    free = _free_blocks(ledger, engine, free_bytes)
    if free > 0:
        take = min(want, free)
        why = f"the device has {free} blocks free for the pool{capped}"
        decisions.append(Decision(Action.COMMIT, name, take, why))
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
        if donor.block_bytes != engine.block_bytes:
            why += f" of its ({donor.lendable_bytes} B)"
        decisions.append(Decision(Action.ASK, name, take, why, peer=donor.name))
        want -= take
    asked = _asked_bytes(ledger)
    for lender, loans in sorted(back.items()):
        if want <= 0:
            break
        coming = recalled = 0
        # The newest loans given back already: the lender takes them back and answers in the
        # same `serve` (it reclaims first), so it is asked for them now, not once they are
        # back (a round trip less).
        returned = list(itertools.takewhile(lambda loan: loan.state == LoanState.RETURNED, loans))
        owner = ledger.engines.get(lender)
        if returned and owner is not None and lender not in exclude and _may_ask(owner, engine):
            given_back = sum(loan.num_bytes for loan in returned)
            surplus = max(0, min(owner.committed_blocks - owner.min_blocks, owner.lendable_blocks))
            ready = given_back + surplus * owner.block_bytes - asked.get(lender, 0)
            take = min(want, ready // engine.block_bytes)
            if take > 0 and not unresponsive(owner, ledger, now):
                why = (
                    f"{lender} takes back {given_back} B given back to it, and can lend "
                    f"{ready // engine.block_bytes} blocks then"
                )
                decisions.append(Decision(Action.ASK, name, take, why, peer=lender))
                want -= take
                loans = loans[len(returned) :]
        if want <= 0:
            break
        for loan in loans:  # newest first
            coming += loan.num_bytes // engine.block_bytes
            if loan.state == LoanState.BORROWED and not loan.recall:
                recalled += 1
                why = (
                    f"{loan.borrower} holds {loan.lent_blocks} of {lender}'s blocks free: "
                    f"back to {lender}, to lend again"
                )
                recall = Decision(
                    Action.RECALL, name, loan.blocks, why, loan.borrower, loan.loan_id
                )
                decisions.append(recall)
        if loans and not recalled:
            why = f"{coming} blocks are on their way back to {lender}, to lend again"
            decisions.append(Decision(Action.WAIT, name, min(want, coming), why))
        want -= coming
    if want > 0:
        why = "no free memory and no donor for the rest"
        decisions.append(Decision(Action.WAIT, name, want, why))
    return decisions


def _coming_back(ledger: Ledger, needy: str, now: float) -> dict[str, list[PoolLoan]]:
    """Per lender other than `needy`: its loans out that can come back to it now without
    `needy`, newest first (the order it takes them back in, so only up to the first that
    cannot): each given back or recalled already, or held by a responsive engine other than
    `needy` whose blocks from the loan's start up are free (all of an idle engine's are)."""
    out: dict[str, list[PoolLoan]] = {}
    for loan in ledger.loans.values():
        if loan.lender and loan.memory_out:
            out.setdefault(loan.lender, []).append(loan)

    def comes_back(loan: PoolLoan) -> bool:
        if loan.state == LoanState.RETURNED:
            return True
        if loan.borrower == needy:  # what it must give back itself first
            return False
        if loan.recall:
            return True
        borrower = ledger.engines.get(loan.borrower)
        return (
            loan.state == LoanState.BORROWED
            and borrower is not None
            and not unresponsive(borrower, ledger, now)
            and (
                not borrower.busy
                or loan.start_block >= borrower.committed_blocks - borrower.spare_blocks
            )
        )

    back: dict[str, list[PoolLoan]] = {}
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


def _recall(name: str, want: int, lent: list[PoolLoan]) -> list[Decision]:
    """The newest loan (the fewest blocks kept) lies right above what the lender kept: its
    cache grows back contiguously only newest first, so that is the order of the reclaims."""
    decisions = []
    for loan in sorted(lent, key=lambda loan: loan.kept_blocks):
        if want <= 0:
            break
        blocks, peer, loan_id = loan.lent_blocks, loan.borrower, loan.loan_id
        if loan.state == LoanState.RETURNED:
            why = "it was given back: reclaim"
            decisions.append(Decision(Action.WAIT, name, blocks, why, peer, loan_id))
        elif not loan.recall:
            why = "its cache grows only once its lent blocks are back"
            decisions.append(Decision(Action.RECALL, name, blocks, why, peer, loan_id))
        want -= blocks
    return decisions or [Decision(Action.WAIT, name, 0, "its loans are recalled already")]


def _free_blocks(ledger: Ledger, engine: Engine, free_bytes: int) -> int:
    """The most blocks `engine` may commit from free memory: what their granules map (every
    segment maps whole granules, a block ending inside one maps all of it), not their bytes,
    within the device's free memory and the pool's cap."""
    free = free_bytes
    cap = ledger.caps.get(engine.device)
    if cap is not None:
        free = min(free, cap - used_bytes(ledger, engine.device))
    if free <= 0:
        return 0
    shape, now = engine.shape, engine.committed_blocks
    mapped_now = shape.mapped_bytes(now)
    low, high = 0, (free + shape.num_segments * shape.granularity) // engine.block_bytes
    while low < high:  # the most blocks whose granules fit: mapped_bytes only grows
        mid = (low + high + 1) // 2
        if shape.mapped_bytes(now + mid) - mapped_now <= free:
            low = mid
        else:
            high = mid - 1
    return low


def can_lend_to(donor: Engine, needy: Engine) -> bool:
    """A loan is memory: it moves between engines of one device and granularity, whatever
    their models (the borrower maps the lender's whole handles at its own blocks)."""
    return donor.device == needy.device and donor.shape.granularity == needy.shape.granularity


def _asked_bytes(ledger: Ledger) -> dict[str, int]:
    """Per engine, the bytes others asked of it and it has not answered yet."""
    asked: dict[str, int] = {}
    for loan in ledger.loans.values():
        if loan.state == LoanState.ASKED:
            asked[loan.lender] = asked.get(loan.lender, 0) + loan.asked_bytes
    return asked


def _may_ask(donor: Engine, needy: Engine) -> bool:
    return can_lend_to(donor, needy) and not donor.borrowed_bytes


def _donors(ledger: Ledger, needy: Engine, now: float) -> list[tuple[Engine, int]]:
    """Engines that may lend to `needy`, with what each can lend in `needy`'s blocks (its
    surplus in bytes, less what others asked of it already, in whole blocks of `needy`'s),
    idle ones first, then the largest surplus."""
    asked = _asked_bytes(ledger)
    asking = borrowers(ledger)
    donors = []
    for donor in ledger.engines.values():
        if (
            donor.name == needy.name
            or not can_lend_to(donor, needy)
            or donor.borrowed_bytes
            or donor.name in asking
            or unresponsive(donor, ledger, now)
        ):
            continue
        # What it said it could lend at once (free top blocks at handle boundaries), never
        # below its minimum, less what others asked of it already.
        above_min = donor.committed_blocks - donor.min_blocks
        surplus_bytes = min(above_min, donor.lendable_blocks) * donor.block_bytes
        surplus = (surplus_bytes - asked.get(donor.name, 0)) // needy.block_bytes
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
        if loan.state in (LoanState.ASKED, LoanState.OFFERED, LoanState.BORROWED)
    }


def plan_answer(
    ledger: Ledger,
    name: str,
    loan_id: int,
    *,
    free_tail_blocks: int,
    cuts: Mapping[int, int] | None = None,
    free_blocks: int | None = None,
) -> Decision:
    """Donor `name`'s answer to request `loan_id`: lend at most its free top blocks
    (`free_tail_blocks`, which only the engine knows), never below its minimum. A donor that
    moves live blocks down before it lends gives `free_blocks` too (all its free blocks, the
    top ones among them): it may lend that many, its live blocks then fitting below the cut.

    `cuts` (what only the engine knows too) maps each number of its top blocks it may lend
    (a lend point: a handle starts there in every segment, since a loan is whole handles) to
    the blocks those handles give the borrower, in the borrower's own shape
    (`extensible_kv.shape.blocks_from`). The loan is the cut that gives the most of what was
    asked, lending the least for it (nothing the borrower cannot use); or, when no cut within
    the ask gives any, the fewest that cover the ask, if they are free and the borrower has
    room for them under its maximum (a donor of handles larger than the ask would otherwise
    refuse every small request). Without `cuts`, any number of blocks is a cut, giving the
    borrower what their bytes hold of its blocks."""
    engine, loan = ledger.engines[name], ledger.loans[loan_id]
    borrower = ledger.engines.get(loan.borrower)

    def refuse(why: str) -> Decision:
        return Decision(Action.REFUSE, name, 0, why, loan.borrower, loan_id)

    if engine.borrowed_bytes or name in borrowers(ledger):
        return refuse("it holds borrowed blocks or waits for memory itself")
    above_min = engine.committed_blocks - engine.min_blocks
    moves = free_blocks is not None
    free = max(free_tail_blocks, free_blocks or 0)
    lendable = min(free, above_min)
    if lendable <= 0:
        if above_min <= 0:
            return refuse(f"at its minimum ({engine.min_blocks} blocks)")
        if moves:
            return refuse(f"all {engine.committed_blocks} of its blocks are live")
        return refuse(
            f"its top {above_min} blocks above its minimum are live, and it does not move "
            "live blocks down (move=False)"
        )
    where = "" if moves else " at its top"
    why = f"{lendable} free blocks{where} above its minimum"
    wanted = loan.blocks  # the borrower's blocks
    if cuts is None:
        ratio = (engine.block_bytes, borrower.block_bytes if borrower else engine.block_bytes)
        cuts = {n: n * ratio[0] // ratio[1] for n in range(1, lendable + 1)}
    gains = sorted((n, g) for n, g in cuts.items() if 0 < n <= lendable and g > 0)
    room = borrower.max_blocks - borrower.committed_blocks if borrower else 0
    fits = [(g, -n) for n, g in gains if g <= wanted]
    covers = [(g, n) for n, g in gains if wanted < g <= room]
    if fits:
        gain, blocks = max(fits)
        blocks = -blocks
    elif covers:
        gain, blocks = min(covers)
        why += f"; {blocks} blocks, the fewest whole handles that cover the ask"
    else:
        return refuse(
            f"no whole handles within its {lendable} free blocks give {loan.borrower} up to "
            f"the {wanted} blocks asked, and those that cover the ask are more than are free "
            f"or than {loan.borrower} has room for (a loan is whole handles)"
        )
    if borrower is not None and borrower.block_bytes != engine.block_bytes:
        why += f"; {gain} of {loan.borrower}'s blocks"
    if blocks > free_tail_blocks:
        why += f"; its live blocks past the {blocks} lent move down first"
    return Decision(Action.LEND, name, blocks, why, loan.borrower, loan_id, gain)


def plan_release(
    ledger: Ledger, name: str, *, spare_blocks: int, idle_s: float | None = None
) -> list[Decision]:
    """What engine `name` gives back now: borrowed loans recalled, orphaned (their lender
    died) or past its maximum, top first, each once every block from its start is free; then
    its own free top blocks past its maximum. `spare_blocks` (what only the engine knows) is
    how many of its top blocks could go at once: its free tail, or, moving live blocks down,
    as many as are free anywhere. `idle_s`, if given, says the engine has been idle that
    long, past its member's bound: every loan goes back to its lender (top first, once
    free), where the next needy engine is asked for it in one step (from an idle borrower,
    it is recalled for its lender first: two more)."""
    engine = ledger.engines[name]
    used_top = engine.committed_blocks - spare_blocks  # blocks below it may be live
    top = engine.committed_blocks
    decisions = []
    borrowed = sorted(
        (
            loan
            for loan in ledger.loans.values()
            if loan.borrower == name and loan.state == LoanState.BORROWED
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
        elif idle_s is not None:
            why = f"it has been idle for {idle_s:.2f} s: back to its lender, to lend again"
        else:
            break  # a loan below this one cannot go back before it
        if loan.start_block < used_top:
            break  # live blocks: once they are free
        decisions.append(
            Decision(Action.GIVE_BACK, name, loan.blocks, why, loan.lender, loan.loan_id)
        )
        top = loan.start_block
    given = {d.loan_id for d in decisions}
    kept_top = max(
        (loan.start_block + loan.blocks for loan in borrowed if loan.loan_id not in given),
        default=0,
    )
    lends = any(loan.lender == name and loan.memory_out for loan in ledger.loans.values())
    # A shrink past a borrowed block would give it back behind the ledger's back, and one
    # below lent blocks is no shrink at all: neither is planned.
    keep = max(engine.max_blocks, used_top, kept_top)
    if top > keep and not lends:
        why = f"past its maximum ({engine.max_blocks} blocks)"
        decisions.append(Decision(Action.SHRINK, name, top - keep, why))
    return decisions
