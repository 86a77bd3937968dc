"""The pool's policy (`extensible_kv.pool.policy`): pure decisions from a ledger, each with its
reason. A needy engine commits free memory within the cap, then asks every donor in the same
round, idle ones first, up to its maximum; donors of any model on its device and granularity
lend, counted in bytes; a lender recalls newest first; loans others hold free go back to their
lender first; a donor lends whole handles, at the cut that gives the borrower the most of what
it asked in its own blocks; an engine gives back what was recalled and shrinks past a lowered
maximum."""

from __future__ import annotations

from extensible_kv.pool import Action, Ledger
from extensible_kv.pool.policy import plan_answer, plan_grow, plan_release
from support.pool_ledgers import BB, NOW, engine, loan, shape


def test_free_memory_first_within_the_cap_then_idle_donors_first() -> None:
    ledger = Ledger(caps={"cpu": 100 * BB})
    ledger.engines = {
        "needy": engine("needy", 1, 10),
        "busy": engine("busy", 2, 40, lo=4, busy=True),  # 36 above its minimum
        "idle": engine("idle", 3, 30, lo=20),  # 10 above its minimum
        "stale": engine("stale", 4, 10),
    }
    ledger.engines["stale"].heartbeat = NOW - 60
    decisions = plan_grow(ledger, "needy", 40, free_bytes=1 << 40, now=NOW)
    assert [(d.action, d.peer, d.blocks) for d in decisions] == [
        ("commit", "", 10),  # the cap less 90 blocks held
        ("ask", "idle", 10),
        ("ask", "busy", 20),
    ]
    assert all(isinstance(d.action, Action) for d in decisions)
    assert "10 blocks free for the pool" in decisions[0].reason
    assert decisions[1].reason == "idle is idle and can lend 10 blocks"
    # The device's own free memory caps it too; a donor asked already is asked for the rest.
    ledger.caps = {}
    decisions = plan_grow(ledger, "needy", 40, free_bytes=5 * BB + 100, now=NOW)
    assert decisions[0] == plan_grow(ledger, "needy", 5, free_bytes=5 * BB, now=NOW)[0]


def test_a_burst_asks_for_its_whole_need_from_free_memory_and_every_donor_at_once() -> None:
    """What its waiting requests need, up to its maximum, in one plan: no fixed step."""
    ledger = Ledger(caps={"cpu": 70 * BB})
    ledger.engines = {
        "needy": engine("needy", 1, 4, hi=100),
        "d1": engine("d1", 2, 20, lo=4),
        "d2": engine("d2", 3, 20, lo=4),
        "d3": engine("d3", 4, 20, lo=4, busy=True),
    }
    plan = plan_grow(ledger, "needy", 58, free_bytes=1 << 40, now=NOW)
    assert [(d.action, d.peer, d.blocks) for d in plan] == [
        ("commit", "", 6),  # 70 - 64 held
        ("ask", "d1", 16),
        ("ask", "d2", 16),
        ("ask", "d3", 16),
        ("wait", "", 4),
    ]
    # Up to its maximum, whatever it asks for.
    ledger.engines["needy"].max_blocks = 30
    plan = plan_grow(ledger, "needy", 58, free_bytes=1 << 40, now=NOW)
    assert sum(d.blocks for d in plan if d.action != "wait") == 26
    assert "capped by its maximum" in plan[0].reason


def test_donors_of_other_models_lend_counted_in_bytes() -> None:
    """A donor whose blocks are 4 times the needy engine's lends its surplus's bytes: four of
    the needy engine's blocks for each of its own. Another granularity or device: no loan."""
    ledger = Ledger()
    ledger.engines = {
        "small": engine("small", 1, 0, block_bytes=BB),
        "big": engine("big", 2, 10, lo=4, block_bytes=4 * BB),  # 6 big blocks = 24 small
        "other-granule": engine("other-granule", 3, 30, of=shape(BB, granularity=8192)),
        "other-device": engine("other-device", 4, 30, of=shape(BB, device="cuda:0")),
    }
    plan = plan_grow(ledger, "small", 30, free_bytes=0, now=NOW)
    assert [(d.action, d.peer, d.blocks) for d in plan] == [("ask", "big", 24), ("wait", "", 6)]
    assert plan[0].reason == f"big is idle and can lend 24 blocks of its ({6 * 4 * BB} B)"
    # Asked of it already, in bytes: 5 small blocks leave one big block's worth, 4 small.
    ledger.loans[1] = loan(1, "big", "other-granule", 5, "asked")
    ledger.next_loan_id = 2
    ledger.loans[1].asked_bytes = 5 * 4 * BB
    plan = plan_grow(ledger, "small", 30, free_bytes=0, now=NOW)
    assert (plan[0].action, plan[0].blocks) == ("ask", 4)
    # The big engine needs 2 of its blocks: 8 of the small one's, which can lend 7 (too few
    # for one of its blocks' 4 ... twice).
    del ledger.loans[1]
    ledger.engines["small"].committed_blocks = 7
    ledger.engines["small"].lendable_blocks = 7
    plan = plan_grow(ledger, "big", 2, free_bytes=0, now=NOW)
    assert [(d.action, d.peer, d.blocks) for d in plan] == [("ask", "small", 1), ("wait", "", 1)]


def test_grows_stop_at_the_maximum_and_count_what_is_on_its_way() -> None:
    ledger = Ledger()
    ledger.engines = {"a": engine("a", 1, 10, hi=20), "b": engine("b", 2, 30)}
    ledger.loans[1] = loan(1, "b", "a", 4, "asked")
    ledger.next_loan_id = 2
    decisions = plan_grow(ledger, "a", 100, free_bytes=0, now=NOW)
    assert [(d.action, d.blocks) for d in decisions] == [("ask", 6)]  # 20 - 10 - 4
    assert plan_grow(ledger, "a", 4, free_bytes=0, now=NOW)[0].reason == (
        "4 blocks are on their way already"
    )
    ledger.engines["a"].committed_blocks = 16
    assert "at its maximum" in plan_grow(ledger, "a", 1, free_bytes=0, now=NOW)[0].reason


def test_donors_that_cannot_lend_are_not_asked() -> None:
    ledger = Ledger()
    ledger.engines = {
        "needy": engine("needy", 1, 0),
        "stuck": engine("stuck", 2, 30),
        "other-granule": engine("other-granule", 3, 30, of=shape(BB, granularity=16384)),
        "borrower": engine("borrower", 4, 30),
        "refused-me": engine("refused-me", 5, 30),
        "live": engine("live", 6, 30, lendable=0),  # its top blocks are live
        "tiny": engine("tiny", 7, 30, lendable=0),
    }
    ledger.engines["stuck"].stuck = True
    ledger.loans[1] = loan(1, "live", "borrower", 4, "asked")
    ledger.next_loan_id = 2
    decisions = plan_grow(ledger, "needy", 8, free_bytes=0, now=NOW, exclude={"refused-me"})
    assert [d.action for d in decisions] == ["wait"]
    assert decisions[0].reason == "no free memory and no donor for the rest"


def test_a_lender_recalls_its_loans_newest_first_before_anything_else() -> None:
    ledger = Ledger()
    ledger.engines = {"a": engine("a", 1, 8), "b": engine("b", 2, 8), "c": engine("c", 3, 8)}
    ledger.loans = {
        1: loan(1, "a", "b", 4, "borrowed", 0, kept_blocks=12),
        2: loan(2, "a", "c", 4, "borrowed", 0, kept_blocks=8),
    }
    ledger.next_loan_id = 3
    decisions = plan_grow(ledger, "a", 4, free_bytes=1 << 40, now=NOW)
    assert [(d.action, d.loan_id) for d in decisions] == [("recall", 2)]
    assert decisions[0].reason == "its cache grows only once its lent blocks are back"
    decisions = plan_grow(ledger, "a", 8, free_bytes=1 << 40, now=NOW)
    assert [(d.action, d.loan_id) for d in decisions] == [("recall", 2), ("recall", 1)]


def test_loans_others_hold_free_go_back_to_their_lender_before_it_is_asked() -> None:
    """The H100 trace: engine 1's burst borrowed from engine 0 and ended; engine 2, bursting,
    borrowed engine 0's blocks below those loans, so engine 0 could not take them back (newest
    first) and engine 2 waited with the memory free at engine 1. Now the needy engine recalls
    them for their lender first, and asks the lender once they are back."""
    ledger = Ledger()
    ledger.engines = {
        "lender": engine("lender", 1, 20, lendable=12),
        "other": engine("other", 2, 30),
        "needy": engine("needy", 3, 8),
    }
    ledger.engines["other"].borrowed_bytes = 12 * BB
    ledger.loans = {
        1: loan(1, "lender", "other", 8, "borrowed", 0, start_block=18, kept_blocks=28),
        2: loan(2, "lender", "other", 4, "borrowed", 0, start_block=26, kept_blocks=20),
    }
    ledger.next_loan_id = 3

    def plan() -> list[tuple[str, str, int]]:
        decisions = plan_grow(ledger, "needy", 10, free_bytes=0, now=NOW)
        return [(d.action, d.peer, d.blocks) for d in decisions]

    # Idle: newest first (the order the lender takes them back in), not the lender's blocks.
    decisions = plan_grow(ledger, "needy", 10, free_bytes=0, now=NOW)
    assert [(d.action, d.peer, d.loan_id, d.blocks) for d in decisions] == [
        ("recall", "other", 2, 4),
        ("recall", "other", 1, 8),
    ]
    assert decisions[0].reason == (
        "other holds 4 of lender's blocks free: back to lender, to lend again"
    )
    # Busy, with its top 4 blocks free: the newest loan only (the older one is in use).
    ledger.engines["other"].busy = True
    ledger.engines["other"].spare_blocks = 4
    assert plan() == [("recall", "other", 4), ("wait", "", 6)]
    # Recalled already: it waits for them, and still does not ask the lender.
    ledger.loans[2].recall = True
    assert plan() == [("wait", "", 4), ("wait", "", 6)]
    # Its top block in use: the lender lends what it has.
    ledger.loans[2].recall = False
    ledger.engines["other"].spare_blocks = 3
    assert plan() == [("ask", "lender", 10)]
    # So does a lender whose newest loan the needy engine holds (recalled or not): it cannot
    # take back the rest before that one.
    ledger.engines["other"].busy = False
    ledger.loans[3] = loan(3, "lender", "needy", 2, "borrowed", 0, start_block=8, kept_blocks=18)
    assert plan() == [("ask", "lender", 10)]
    ledger.loans[3].recall = True
    assert plan() == [("ask", "lender", 10)]


def test_a_lender_whose_loans_were_given_back_is_asked_at_once() -> None:
    """The host trace: the needy engine recalled a lender's loans from an idle borrower, the
    borrower gave them back, and the needy engine asked the lender only after its reclaim, a
    round trip of both later (~60 ms of a 115 ms TTFT). Given back, the lender is asked for
    them at once (it reclaims first and answers in the same serve); loans still out below
    them are waited for."""
    ledger = Ledger()
    ledger.engines = {
        "lender": engine("lender", 1, 20, lo=18, lendable=2),
        "other": engine("other", 2, 30),
        "needy": engine("needy", 3, 8, block_bytes=2 * BB),
    }
    ledger.engines["other"].borrowed_bytes = 12 * BB
    ledger.loans = {
        1: loan(1, "lender", "other", 8, "borrowed", 0, start_block=18, kept_blocks=28),
        2: loan(2, "lender", "other", 4, "returned", 0, start_block=26, kept_blocks=20),
    }
    ledger.loans[1].recall = True
    ledger.next_loan_id = 3

    def plan(blocks: int) -> list[tuple[str, str, int]]:
        decisions = plan_grow(ledger, "needy", blocks, free_bytes=0, now=NOW)
        return [(d.action, d.peer, d.blocks) for d in decisions]

    # 4 of the lender's blocks back and 2 free above its minimum: 3 of the needy engine's;
    # the older loan (8 of the lender's, 4 of its) is on its way.
    assert plan(10) == [("ask", "lender", 3), ("wait", "", 4), ("wait", "", 3)]
    reason = plan_grow(ledger, "needy", 10, free_bytes=0, now=NOW)[0].reason
    assert reason == f"lender takes back {4 * BB} B given back to it, and can lend 3 blocks then"
    assert plan(2) == [("ask", "lender", 2)]
    # What others asked of it already is not asked again; a lender that refused lately, or
    # one that holds borrowed memory, is not asked.
    ledger.loans[3] = loan(3, "lender", "other", 1, "asked")
    ledger.loans[3].asked_bytes = 2 * BB
    assert plan(10)[0] == ("ask", "lender", 2)
    del ledger.loans[3]
    decisions = plan_grow(ledger, "needy", 10, free_bytes=0, now=NOW, exclude=["lender"])
    assert "ask" not in [d.action for d in decisions]
    ledger.engines["lender"].borrowed_bytes = BB
    assert "ask" not in [a for a, _, _ in plan(10)]


def test_a_donor_lends_free_top_blocks_above_its_minimum_and_says_why_not() -> None:
    ledger = Ledger()
    ledger.engines = {"d": engine("d", 1, 20, lo=8), "n": engine("n", 2, 0)}
    ledger.loans[1] = loan(1, "d", "n", 10, "asked")
    ledger.next_loan_id = 2
    lend = plan_answer(ledger, "d", 1, free_tail_blocks=20)
    assert (lend.action, lend.blocks, lend.peer_blocks) == ("lend", 10, 10)
    assert (plan_answer(ledger, "d", 1, free_tail_blocks=6).blocks) == 6
    assert plan_answer(ledger, "d", 1, free_tail_blocks=0).reason == (
        "its top 12 blocks above its minimum are live, and it does not move live blocks down "
        "(move=False)"
    )
    # Moving live blocks down, it lends its free blocks wherever they lie, above its minimum.
    moved = plan_answer(ledger, "d", 1, free_tail_blocks=0, free_blocks=7)
    assert (moved.action, moved.blocks) == ("lend", 7)
    assert moved.reason == (
        "7 free blocks above its minimum; its live blocks past the 7 lent move down first"
    )
    assert plan_answer(ledger, "d", 1, free_tail_blocks=10, free_blocks=11).reason == (
        "11 free blocks above its minimum"  # the 10 asked are free at its top
    )
    assert plan_answer(ledger, "d", 1, free_tail_blocks=0, free_blocks=30).blocks == 10
    refused = plan_answer(ledger, "d", 1, free_tail_blocks=0, free_blocks=0)
    assert (refused.action, refused.reason) == ("refuse", "all 20 of its blocks are live")
    ledger.engines["d"].committed_blocks = 8
    assert plan_answer(ledger, "d", 1, free_tail_blocks=8).reason == "at its minimum (8 blocks)"
    assert plan_answer(ledger, "d", 1, free_tail_blocks=8, free_blocks=8).action == "refuse"


def test_a_donor_lends_whole_handles_covering_a_small_ask_if_the_borrower_has_room() -> None:
    ledger = Ledger()
    ledger.engines = {"d": engine("d", 1, 20, lo=8), "n": engine("n", 2, 4)}
    ledger.loans[1] = loan(1, "d", "n", 2, "asked")
    ledger.next_loan_id = 2
    # Handles start at blocks 12 and 16: a loan is 4 or 8 blocks, never the 2 asked.
    cuts = {4: 4, 8: 8}
    lend = plan_answer(ledger, "d", 1, free_tail_blocks=12, cuts=cuts)
    assert (lend.action, lend.blocks) == ("lend", 4)
    assert "the fewest whole handles that cover the ask" in lend.reason
    ledger.loans[1].blocks = 6  # the most of the ask that ends at a handle
    assert plan_answer(ledger, "d", 1, free_tail_blocks=12, cuts=cuts).blocks == 4
    ledger.loans[1].blocks = 2
    # Not free (the top 3 blocks only), or no room under the borrower's maximum: refused.
    refused = plan_answer(ledger, "d", 1, free_tail_blocks=3, cuts=cuts)
    assert (refused.action, refused.blocks) == ("refuse", 0)
    assert "no whole handles within its 3 free blocks give n up to the 2 blocks" in refused.reason
    ledger.engines["n"].max_blocks = 7
    refused = plan_answer(ledger, "d", 1, free_tail_blocks=12, cuts=cuts)
    assert refused.action == "refuse" and "than n has room for" in refused.reason


def test_a_donor_picks_the_cut_that_gives_a_borrower_of_another_model_what_it_asked() -> None:
    """The cuts say what each gives the borrower in its own blocks: the loan is the one that
    gives the most of the ask, lending the least for it (nothing the borrower cannot use)."""
    ledger = Ledger()
    ledger.engines = {"d": engine("d", 1, 20), "n": engine("n", 2, 0, block_bytes=3 * BB)}
    ledger.loans[1] = loan(1, "d", "n", 3, "asked")
    ledger.next_loan_id = 2
    # 4 of d's blocks hold 1 of n's, 8 hold 2, 10 still 3 (a remainder), 12 hold 4.
    cuts = {4: 1, 8: 2, 9: 3, 10: 3, 12: 4}
    lend = plan_answer(ledger, "d", 1, free_tail_blocks=20, cuts=cuts)
    assert (lend.action, lend.blocks, lend.peer_blocks) == ("lend", 9, 3)
    assert "3 of n's blocks" in lend.reason
    # Without cuts, its blocks' bytes in whole blocks of the borrower's.
    lend = plan_answer(ledger, "d", 1, free_tail_blocks=20)
    assert (lend.blocks, lend.peer_blocks) == (9, 3)


def test_an_engine_gives_back_recalled_and_orphaned_loans_top_first_once_free() -> None:
    ledger = Ledger()
    ledger.engines = {"a": engine("a", 1, 8), "b": engine("b", 2, 24, hi=64)}
    ledger.loans = {
        1: loan(1, "a", "b", 4, "borrowed", 0, num_bytes=BB, start_block=12),
        2: loan(2, "a", "b", 8, "borrowed", 0, num_bytes=BB, start_block=16, recall=True),
    }
    ledger.next_loan_id = 3
    ledger.engines["b"].borrowed_bytes = 2 * BB
    # The recalled loan is on top: back once its blocks are free; the other one stays.
    assert plan_release(ledger, "b", spare_blocks=2) == []
    (back,) = plan_release(ledger, "b", spare_blocks=8)
    assert (back.action, back.loan_id, back.reason) == ("give_back", 2, "a recalled it")
    # A loan below a kept one cannot go back before it.
    ledger.loans[1].recall, ledger.loans[2].recall = True, False
    assert plan_release(ledger, "b", spare_blocks=24) == []
    ledger.loans[2].lender = ""  # its lender died: giving it back frees it
    assert [d.loan_id for d in plan_release(ledger, "b", spare_blocks=24)] == [2, 1]


def test_an_engine_past_a_lowered_maximum_shrinks_to_its_used_blocks() -> None:
    ledger = Ledger()
    ledger.engines = {"a": engine("a", 1, 40, hi=8)}
    (shrink,) = plan_release(ledger, "a", spare_blocks=30)
    assert (shrink.action, shrink.blocks) == ("shrink", 30)  # 10 used: it keeps them
    assert shrink.reason == "past its maximum (8 blocks)"
    (shrink,) = plan_release(ledger, "a", spare_blocks=40)
    assert shrink.blocks == 32
