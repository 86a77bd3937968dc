"""`PoolMember` in one process (the cross-process behaviour is `test_pool_processes.py`'s):
two members lend, recall and leave; a loan the borrower cannot take goes back; a borrower
refused by pid takes the loan over the lender's socket; memory an idle borrower holds moves on;
a donor with `move=True` moves its live blocks down; an idle member exports ahead; a cache of
whole granules; through the driver. Across models: engines of different block bytes lend to
each other both ways, the ledger counting bytes; limits in bytes. A burst: one ask, answered
from free memory and every donor in the same round, logged with its wait (`PoolMember.asks`).
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from extensible_kv import AttentionLayerSpec, ExtensibleKVCache, KVCacheTensorSpec
from extensible_kv.pool import Pool, PoolMember, rules
from extensible_kv.pool.donor import EXPORT_AHEAD_HANDLES
from support.pool_ledgers import Clock
from support.pool_members import (
    GRANULE,
    Moving,
    cache,
    check_holdings,
    lender_and_borrower,
    members_of,
)


def test_member_arguments_are_checked(tmp_path: Path) -> None:
    pool = Pool("test", directory=tmp_path)
    with cache() as c:
        free = lambda: 0  # noqa: E731
        with pytest.raises(ValueError, match="move=True needs a cache that moves live blocks"):
            PoolMember(pool, "a", c, min_blocks=0, max_blocks=8, free_tail_blocks=free, move=True)
        with pytest.raises(ValueError, match="more than the cache's capacity"):
            PoolMember(pool, "a", c, min_blocks=0, max_blocks=65, free_tail_blocks=free)
        with pytest.raises(ValueError, match="need 0 <= min_blocks <= max_blocks <= capacity"):
            PoolMember(pool, "a", c, min_blocks=9, max_blocks=8, free_tail_blocks=free).join()
    with cache(export_handle_types=0) as c:
        with pytest.raises(ValueError, match="posix_fd"):
            PoolMember(pool, "a", c, min_blocks=0, max_blocks=8, free_tail_blocks=lambda: 0)
        # Through the driver nothing is exported: any cache of its own memory will do.
        PoolMember(pool, "a", c, min_blocks=0, max_blocks=8, free_tail_blocks=free, via="driver")
        with pytest.raises(ValueError, match="via must be one of 'loan', 'driver', not 'dma'"):
            PoolMember(pool, "a", c, min_blocks=0, max_blocks=8, free_tail_blocks=free, via="dma")
    with cache(legacy=True) as c, pytest.raises(ValueError, match="legacy"):
        PoolMember(pool, "a", c, min_blocks=0, max_blocks=8, free_tail_blocks=free, via="driver")


def test_two_members_in_one_process_lend_recall_and_leave(tmp_path: Path) -> None:
    pool = Pool("test", directory=tmp_path)
    pool.set_cap("cpu", 48 * 2 * 4096)
    used = {"a": 0, "b": 0}
    sizes: list[int] = []
    with cache() as ca, cache() as cb:
        a = PoolMember(
            pool,
            "a",
            ca,
            min_blocks=4,
            max_blocks=64,
            commit_step_blocks=4,
            free_tail_blocks=lambda: ca.committed_blocks - used["a"],
            on_resize=sizes.append,
        )
        b = PoolMember(
            pool,
            "b",
            cb,
            min_blocks=4,
            max_blocks=64,
            commit_step_blocks=4,
            free_tail_blocks=lambda: cb.committed_blocks - used["b"],
        )
        a.join()
        b.join()
        with pytest.raises(ValueError, match="in the pool already"):
            PoolMember(pool, "a", cb, min_blocks=0, max_blocks=8, free_tail_blocks=lambda: 0).join()
        assert a.grow(32) == 32
        used["a"] = 10
        ca.views["attn"][:, :10].fill_(3)  # type: ignore[call-overload]
        a.serve()
        decisions = b.request(40)
        assert [(d.action, d.peer, d.blocks) for d in decisions] == [
            ("commit", "", 16),  # 48 - 32
            ("ask", "a", 20),  # a can lend above its 10 used blocks, at a handle boundary
            ("wait", "", 4),
        ]
        a.serve()  # lends 20 blocks: 10 used + 2 free kept (a loan is whole handles)
        assert ca.committed_blocks == 12 and sizes[-1] == 12
        b.serve()  # borrows them
        assert cb.committed_blocks == 36
        assert bool(ca.views["attn"][:, :10].eq(3).all())  # type: ignore[call-overload]
        ledger = pool.snapshot()
        assert rules.check(ledger) == []
        assert rules.used_bytes(ledger, "cpu") == 48 * 2 * 4096
        (loan,) = ledger.loans.values()
        assert (loan.state, loan.blocks, loan.start_block, loan.kept_blocks) == (
            "borrowed",
            20,
            16,
            12,
        )
        # a needs its memory back: it recalls the loan, b gives it back, a reclaims it.
        assert [d.action for d in a.request(8)] == ["recall"]
        b.serve()
        a.serve()
        assert (ca.committed_blocks, cb.committed_blocks) == (32, 16)
        assert bool(ca.views["attn"][:, :10].eq(3).all())  # type: ignore[call-overload]
        assert pool.snapshot().loans == {}
        b.leave()
        a.leave()
        assert pool.snapshot().engines == {}


def test_a_loan_the_borrower_cannot_take_goes_back_and_its_lender_waits_to_be_asked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A borrow that fails (here as a stale loan; a refusal by pid that the lender's socket
    cannot mend goes alike) gives the loan back, the lender reclaims it whole, and the
    borrower warns once and does not ask that lender again before `answer_timeout_s` has
    passed: else the lender would unmap, lend and reclaim at every step, and nothing would
    move. Then it asks again, and borrows."""
    clock = Clock()
    pool = Pool("test", directory=tmp_path, clock=clock)
    pool.set_cap("cpu", 48 * 2 * 4096)
    used = {"a": 0, "b": 0}
    caplog.set_level(logging.INFO, logger="extensible_kv")
    with cache() as ca, cache() as cb:
        a, b = lender_and_borrower(pool, ca, cb, used)
        refusal = ValueError(
            "stale or foreign loan: the lender, process 1, is gone; ask the lender for a "
            "current loan (lend again)"
        )

        def refused(*args: Any, **kw: Any) -> int:
            raise refusal

        cb.borrow = refused  # type: ignore[method-assign]
        assert ("ask", "a") in [(d.action, d.peer) for d in b.request(40)]
        a.serve()  # lends what lies above its 10 used blocks, in whole handles
        assert ca.committed_blocks == 12
        b.serve()  # cannot take them: given back
        (loan,) = pool.snapshot().loans.values()
        assert (loan.state, loan.reason) == ("returned", f"could not borrow: {refusal}")
        a.serve()  # reclaims them, its bytes kept
        assert ca.committed_blocks == 32 and pool.snapshot().loans == {}
        assert bool(ca.views["attn"][:, :10].eq(3).all())  # type: ignore[call-overload]
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert [r.getMessage() for r in warned] == [
            f"pool: b could not borrow from a, and asks it again in 1.0 s at the earliest: "
            f"{refusal}"
        ]
        # Within the bound a is not asked, however often b asks.
        for _ in range(3):
            assert "ask" not in [d.action for d in b.request(20)]
            a.serve()
            b.serve()
        assert pool.snapshot().loans == {} and ca.committed_blocks == 32
        del cb.borrow  # the class's own again
        clock.now += 1.0
        assert [(d.action, d.peer) for d in b.request(20)][:1] == [("ask", "a")]
        a.serve()
        b.serve()
        assert cb.committed_blocks == 36  # 16 committed + 20 borrowed
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
        assert [d.action for d in a.request(8)] == ["recall"]
        b.serve()
        a.serve()
        b.leave()
        a.leave()
    assert pool.snapshot().engines == {}


def test_a_borrower_refused_by_pid_takes_the_loan_over_the_lenders_socket(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Where this process may not take the lender's fds by pid (pidfd_getfd's EPERM under
    Yama's ptrace_scope, stood in for here), the borrower asks the lender on its socket and
    the lender sends them at its next serve; the loan is borrowed, the lender's bytes below
    it kept. The lender sends a loan's fds to no one else: asked for a loan it does not
    offer, it closes the connection and warns."""
    import threading

    from extensible_kv.pool import fds
    from pool_engine import refused_by_pid

    pool = Pool("test", directory=tmp_path, clock=Clock())
    pool.set_cap("cpu", 48 * 2 * 4096)
    used = {"a": 0, "b": 0}
    caplog.set_level(logging.INFO, logger="extensible_kv")
    with cache() as ca, cache() as cb:
        a, b = lender_and_borrower(pool, ca, cb, used)
        by_pid, over_socket = [], []
        own_borrow = cb.borrow

        def borrow(loans: Any, **kw: Any) -> int:
            if any(loan.received_fds is None for loan in loans):
                by_pid.append(loans)
                raise refused_by_pid()
            over_socket.append(len(loans[0].received_fds))
            return own_borrow(loans, **kw)

        cb.borrow = borrow  # type: ignore[method-assign]
        assert ("ask", "a") in [(d.action, d.peer) for d in b.request(40)]
        a.serve()  # lends what lies above its 10 used blocks
        assert ca.committed_blocks == 12
        stop = threading.Event()

        def serve_a() -> None:  # the lender's own loop, between its steps
            while not stop.is_set():
                a.serve()
                time.sleep(0.005)

        lender = threading.Thread(target=serve_a)
        lender.start()
        try:
            with pool.transaction() as ledger:
                engine = ledger.engines["a"]
            name = fds.address(pool.path, "a", engine.pid, engine.start_time)
            (offered,) = pool.snapshot().loans.values()
            assert offered.state == "offered"
            other = subprocess.run(  # a process that is not the borrower asks for it
                [
                    sys.executable,
                    "-c",
                    "import sys; from extensible_kv.pool import fds\n"
                    "try:\n"
                    f"    fds.fetch({name!r}, {offered.loan_id}, 1, timeout_s=5.0)\n"
                    "except ConnectionError:\n"
                    "    sys.exit(3)",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert other.returncode == 3, other.stderr
            import socket

            silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            silent.connect(name)  # asks nothing: dropped, and a serves on
            b.serve()  # refused by pid: asks a's socket, a's loop answers
            assert silent.recv(1) == b""  # closed by a, unanswered
            silent.close()
            (loan,) = pool.snapshot().loans.values()
            assert loan.state == "borrowed", loan
            assert len(by_pid) == 1 and over_socket and over_socket[0] > 0
            assert cb.committed_blocks == 16 + 20
            with pytest.raises(ConnectionError):
                fds.fetch(name, loan.loan_id + 1000, 1, timeout_s=2.0)
            with pytest.raises(ConnectionError):  # borrowed, no longer on offer
                fds.fetch(name, loan.loan_id, 1, timeout_s=2.0)
        finally:
            stop.set()
            lender.join()
        messages = [r.getMessage() for r in caplog.records]
        assert any(f"b took loan {loan.loan_id} from a over its socket" in m for m in messages)
        refused = [m for m in messages if m.startswith("pool: a refuses process")]
        assert len(refused) == 3, refused
        # Each refused as it connects, before anything is read: not a borrower of an offer.
        offer = "not the borrower of a loan this engine has on offer"
        assert all(m.endswith(offer) for m in refused), refused
        assert not [m for m in messages if m.startswith("pool: b could not borrow")]
        assert bool(ca.views["attn"][:, :10].eq(3).all())  # type: ignore[call-overload]
        del cb.borrow
        assert [d.action for d in a.request(8)] == ["recall"]
        b.serve()
        a.serve()
        assert ca.committed_blocks == 32 and pool.snapshot().loans == {}
        b.leave()
        a.leave()
    assert pool.snapshot().engines == {}


def test_memory_an_idle_borrower_holds_moves_on_to_the_next_needy_engine(tmp_path: Path) -> None:
    """a lends to b; b's load ends; c needs memory and the device has none: c recalls b's
    loans for a, b gives them back, a takes them back, then lends to c. Each step at the
    member's next serve, the ledger consistent throughout."""
    pool = Pool("test", directory=tmp_path)
    pool.set_cap("cpu", 40 * 2 * 4096)
    used = {"a": 0, "b": 0, "c": 0}
    with cache() as ca, cache() as cb, cache() as cc:
        members = members_of(pool, {"a": ca, "b": cb, "c": cc}, used, max_blocks=40)
        a, b, c = members.values()
        for member in members.values():
            member.join()
        top = a.grow(40)  # the whole share
        assert [d.action for d in b.request(20)] == ["ask"]
        a.serve()  # lends
        b.serve(busy=True)  # borrows
        assert cb.committed_blocks == 20 and ca.committed_blocks == top - 20
        b.serve(busy=False)  # its load ended: every block free
        decisions = c.request(16)
        assert [(d.action, d.peer) for d in decisions] == [("recall", "b")] * len(decisions)
        assert decisions
        b.serve(busy=False)  # gives the loans back
        assert cb.committed_blocks == 0
        a.serve()  # takes them back
        assert ca.committed_blocks == top
        assert [d.action for d in c.request(16)] == ["ask"]
        a.serve()  # lends
        c.serve()  # borrows
        assert cc.committed_blocks >= 16
        assert rules.check(pool.snapshot()) == []
        assert {d.action for d in a.request(20)} == {"recall"}  # a wants its memory back
        c.serve()
        a.serve()
        assert ca.committed_blocks == top and pool.snapshot().loans == {}
        for member in members.values():
            member.leave()
        assert pool.snapshot().engines == {}


def test_a_lender_given_its_loans_back_is_asked_at_once_and_lends_as_it_reclaims(
    tmp_path: Path,
) -> None:
    """As above, but c asks again as soon as b gave the loans back, before a took them back:
    a is asked at once, and one serve of a's takes them back and lends them to c (before,
    c waited for a's reclaim to ask: a round trip of both more). A lender whose reclaim is
    not done yet at that serve, and that could answer nothing without it, leaves the
    request asked (a refusal would keep c from asking it for a second), and answers it at a
    later serve."""
    for reclaim_late in (False, True):
        pool = Pool(f"test-{reclaim_late}", directory=tmp_path)
        pool.set_cap("cpu", 40 * 2 * 4096)
        used = {"a": 0, "b": 0, "c": 0}
        with cache() as ca, cache() as cb, cache() as cc:
            members = members_of(pool, {"a": ca, "b": cb, "c": cc}, used, max_blocks=40)
            a, b, c = members.values()
            for member in members.values():
                member.join()
            top = a.grow(40)
            used["a"] = top - 20  # all it keeps is live
            assert [d.action for d in b.request(20)] == ["ask"]
            a.serve()
            b.serve(busy=True)
            b.serve(busy=False)
            assert {d.action for d in c.request(16)} == {"recall"}
            b.serve(busy=False)  # gives the loans back
            assert cb.committed_blocks == 0
            decisions = c.request(16)
            assert [(d.action, d.peer) for d in decisions] == [("ask", "a")]
            assert "takes back" in decisions[0].reason
            if reclaim_late:
                real = a._reclaim
                a._reclaim = lambda entry: False  # type: ignore[method-assign]
                a.serve()  # nothing to lend without them: the request waits
                assert [x.state for x in pool.snapshot().loans.values() if x.borrower == "c"] == [
                    "asked"
                ]
                a._reclaim = real  # type: ignore[method-assign]
            a.serve()  # takes them back and lends
            c.serve()  # borrows
            assert cc.committed_blocks >= 16
            assert rules.check(pool.snapshot()) == []
            assert {d.action for d in a.request(20)} == {"recall"}
            c.serve()
            a.serve()
            assert pool.snapshot().loans == {}
            for member in members.values():
                member.leave()
            assert pool.snapshot().engines == {}


def test_an_idle_borrower_gives_its_loans_back_after_give_back_idle_s(tmp_path: Path) -> None:
    """A borrower whose load ended keeps its loans for `give_back_idle_s` (its next burst may
    come soon), then gives them back to their lenders, where the next needy engine is asked
    for them in one step. Busy again before that, it keeps them; `None` keeps them for
    good (until recalled)."""
    for idle_s in (0.05, None):
        pool = Pool(f"test-{idle_s}", directory=tmp_path)
        pool.set_cap("cpu", 32 * 2 * 4096)
        used = {"a": 0, "b": 0}
        with cache() as ca, cache() as cb:
            a, b = members_of(
                pool, {"a": ca, "b": cb}, used, max_blocks=64, give_back_idle_s=idle_s
            ).values()
            a.join()
            b.join()
            assert a.grow(32) == 32
            used["a"] = 10
            assert ("ask", "a") in [(d.action, d.peer) for d in b.request(16)]
            a.serve()
            b.serve(busy=True)
            borrowed = cb.committed_blocks
            assert borrowed >= 16
            b.serve(busy=False)
            time.sleep(0.03)
            b.serve(busy=True)  # busy again within the bound: kept
            b.serve(busy=False)
            time.sleep(0.03)
            b.serve(busy=False)
            assert cb.committed_blocks == borrowed
            time.sleep(0.05)
            b.serve(busy=False)
            if idle_s is None:
                assert cb.committed_blocks == borrowed
                assert {d.action for d in a.request(32)} == {"recall"}
                b.serve()
            else:
                assert cb.committed_blocks == 0
                (loan,) = pool.snapshot().loans.values()
                assert loan.state == "returned" and "idle for" in loan.reason
            a.serve()
            assert ca.committed_blocks == 32 and pool.snapshot().loans == {}
            b.leave()
            a.leave()
    with pytest.raises(ValueError, match="give_back_idle_s"):
        with cache() as c:
            PoolMember(pool, "x", c, free_tail_blocks=lambda: 0, give_back_idle_s=-1.0)


def test_an_idle_engine_waiting_for_memory_keeps_what_it_borrows(tmp_path: Path) -> None:
    """Idle means no request holds a block, not that none waits: an engine idle for long that
    asks (its first request cannot be placed) keeps what it borrows for `give_back_idle_s`
    from its ask and its borrow. Before, it gave the loan back at its next serve and asked
    again: the host trace's engine looped 72 times, ask waits up to 1.2 s."""
    pool = Pool("test", directory=tmp_path)
    pool.set_cap("cpu", 32 * 2 * 4096)
    used = {"a": 0, "b": 0}
    with cache() as ca, cache() as cb:
        a, b = members_of(
            pool, {"a": ca, "b": cb}, used, max_blocks=64, give_back_idle_s=0.05
        ).values()
        a.join()
        b.join()
        assert a.grow(32) == 32
        used["a"] = 10
        b.serve(busy=False)
        time.sleep(0.1)  # idle for long
        assert ("ask", "a") in [(d.action, d.peer) for d in b.request(16)]
        a.serve()
        b.serve(busy=False)  # borrows
        borrowed = cb.committed_blocks
        assert borrowed >= 16
        b.serve(busy=False)
        assert cb.committed_blocks == borrowed  # kept: it asked just now
        time.sleep(0.06)
        b.serve(busy=False)
        assert cb.committed_blocks == 0  # idle past the bound since its borrow: back
        a.serve()
        assert ca.committed_blocks == 32
        b.leave()
        a.leave()


def test_a_member_with_nothing_to_do_serves_without_a_transaction(tmp_path: Path) -> None:
    """An engine serves between every two of its steps; most rounds find nothing to do. Such a
    round reads the ledger's file and takes no lock (a transaction costs ~1 ms against a
    step of a few): nothing that concerns the member changed, nor what it would post. It
    still heartbeats every `QUIET_BEAT_S`, and acts at its next serve on a request to it, a
    change of its limits, and a change of its own numbers."""
    from extensible_kv.pool.base import QUIET_BEAT_S

    pool = Pool("test", directory=tmp_path)
    pool.set_cap("cpu", 32 * 2 * 4096)  # a's 32 blocks: b borrows
    used = {"a": 0, "b": 0}
    transactions = []
    real = pool.transaction

    def counted(*args: Any, **kw: Any) -> Any:
        transactions.append(time.monotonic())
        return real(*args, **kw)

    with cache() as ca, cache() as cb:
        a, b = lender_and_borrower(pool, ca, cb, used)
        a.serve()
        b.serve()  # b's heartbeat: no concern of a's
        pool.transaction = counted  # type: ignore[method-assign]
        start = time.monotonic()
        rounds = 0
        while time.monotonic() - start < QUIET_BEAT_S / 2:
            a.serve()
            rounds += 1
        assert rounds > 10 and transactions == []
        beat = pool.snapshot().engines["a"].heartbeat
        transactions.clear()
        time.sleep(QUIET_BEAT_S)
        a.serve()  # its heartbeat
        assert len(transactions) >= 1
        assert pool.snapshot().engines["a"].heartbeat > beat
        # A request to it: answered at its next serve, however recent its heartbeat.
        assert [d.action for d in b.request(8)] == ["ask"]
        a.serve()
        b.serve()
        assert cb.committed_blocks >= 8
        # Its own numbers: busy, or blocks freed.
        transactions.clear()
        a.serve(busy=True)
        assert transactions and pool.snapshot().engines["a"].busy
        transactions.clear()
        used["a"] = 4
        a.serve(busy=True)
        assert transactions
        # Its limits.
        pool.set_limits("a", max_blocks=20)
        transactions.clear()
        a.serve(busy=True)
        assert transactions
        pool.transaction = real  # type: ignore[method-assign]
        pool.set_limits("a", max_blocks=64)
        assert {d.action for d in a.request(8)} == {"recall"}
        b.serve()
        a.serve()
        b.leave()
        a.leave()


def test_a_donor_with_move_moves_live_blocks_down_and_lends_the_free_ones_above(
    tmp_path: Path,
) -> None:
    """A donor whose top blocks are live refuses without `move=True`; with it, its live
    blocks above the cut are copied into free ones below (their bytes kept) and it lends
    every free block above its minimum, at a handle boundary. Through the driver, it moves
    them the same way before it releases the blocks above the cut."""
    for move, via in ((False, "loan"), (True, "loan"), (True, "driver")):
        pool = Pool(f"test-{move}-{via}", directory=tmp_path)
        pool.set_cap("cpu", 32 * 2 * 4096)  # the donor's 32 blocks take all of it
        with cache() as inner, cache() as cn:
            cd = Moving(inner)
            d = cd.member(pool, "d", move=move, via=via)
            (n,) = members_of(pool, {"n": cn}, {"n": 0}, max_blocks=64, via=via).values()
            d.join()
            n.join()
            assert d.grow(32) == 32
            cd.hold({0, 1, 2, 3, 29, 30})
            d.serve()
            asked = n.request(16)
            if not move:  # its top blocks are live: no surplus to ask for
                assert [x.action for x in asked] == ["wait"]
                d.leave()
                n.leave()
                continue
            assert [(x.action, x.peer, x.blocks) for x in asked] == [("ask", "d", 16)]
            d.serve()  # moves 29 and 30 down to 4 and 5, lends (or releases) blocks 16..31
            assert cd.moves == [(29, 4), (30, 5)]
            assert inner.committed_blocks == 16
            for old, new in ((0, 0), (3, 3), (29, 4), (30, 5)):
                kept = inner.views["attn"][:, new].eq(old + 1)  # type: ignore[call-overload]
                assert bool(kept.all()), (old, new)
            if via == "driver":  # the device has them free now: the next request commits them
                assert n.request(16)[0].action == "commit"
                assert cn.committed_blocks == 16
                n.leave()
                d.leave()
                continue
            n.serve()
            assert cn.committed_blocks == 16
            assert rules.check(pool.snapshot()) == []
            assert [x.action for x in d.request(16)] == ["recall"]  # wants it back
            n.serve()
            d.serve()
            assert inner.committed_blocks == 32 and pool.snapshot().loans == {}
            n.leave()
            d.leave()
            assert pool.snapshot().engines == {}


def test_a_borrower_with_move_gives_a_recalled_loan_back_at_once_keeping_its_live_blocks(
    tmp_path: Path,
) -> None:
    """A busy borrower whose live blocks lie in a recalled loan keeps it until they are free;
    with `move=True` it moves them below the loan (their bytes kept) and gives it back at its
    next serve, and the lender posts it in the ledger as coming back."""
    for move in (False, True):
        pool = Pool(f"test-{move}", directory=tmp_path)
        pool.set_cap("cpu", 32 * 2 * 4096)
        with cache() as ca, cache() as inner:
            cb = Moving(inner)
            (a,) = members_of(pool, {"a": ca}, {"a": 0}, max_blocks=64).values()
            b = cb.member(pool, "b", move=move)
            a.join()
            b.join()
            assert a.grow(24) == 24 and b.grow(8) == 8  # the whole share
            assert [d.action for d in b.request(16)] == ["ask"]
            a.serve()
            b.serve(busy=True)
            assert inner.committed_blocks == 24  # blocks 8..23 are a's
            cb.hold({0, 1, 20, 21})  # a request grew into the loan
            b.serve(busy=True)  # posts its free top blocks
            (loan,) = pool.snapshot().loans.values()
            spare = pool.snapshot().engines["b"].spare_blocks
            assert spare == (20 if move else 2)  # 24 - 4 live, or the two above block 21
            assert [d.action for d in a.request(16)] == ["recall"]
            b.serve(busy=True)
            state = pool.snapshot().loans[loan.loan_id].state
            if not move:
                assert state == "borrowed" and inner.committed_blocks == 24  # live blocks in it
                cb.live = {0, 1}  # the request ended
                b.serve(busy=True)
            else:
                assert cb.moves == [(20, 2), (21, 3)]
                for old, new in ((0, 0), (1, 1), (20, 2), (21, 3)):
                    kept = inner.views["attn"][:, new].eq(old + 1)  # type: ignore[call-overload]
                    assert bool(kept.all()), (old, new)
            assert pool.snapshot().loans[loan.loan_id].state == "returned"
            assert inner.committed_blocks == 8
            a.serve()
            assert ca.committed_blocks == 24 and pool.snapshot().loans == {}
            assert rules.check(pool.snapshot()) == []
            b.leave()
            a.leave()


def test_an_idle_member_exports_its_handles_ahead_of_a_loan(tmp_path: Path) -> None:
    """A first loan of 60 GiB spent half its time exporting handles: a member with nothing to
    answer exports a few a round, again after it grew; through the driver it exports none."""
    pool = Pool("test", directory=tmp_path)
    pool.set_cap("cpu", 64 * 2 * 4096)
    with cache() as ca, cache() as cd:
        a = PoolMember(pool, "a", ca, min_blocks=0, max_blocks=64, free_tail_blocks=lambda: 0)
        d = PoolMember(
            pool, "d", cd, min_blocks=0, max_blocks=64, free_tail_blocks=lambda: 0, via="driver"
        )
        a.join()
        d.join()
        (ta,), (td,) = ca.buffers, cd.buffers
        for blocks in (8, 24):
            ca.commit(blocks)
            left = ta._export_ahead(0)
            assert left > 0, "a grow makes handles not exported yet"
            for _ in range(100):
                a.serve()
                now = ta._export_ahead(0)
                assert now == max(0, left - EXPORT_AHEAD_HANDLES), (left, now)
                left = now
                if not left:
                    break
            assert left == 0
        cd.commit(24)
        for _ in range(8):
            d.serve()
        assert td._export_ahead(0) == td.num_handles > 0
        a.leave()
        d.leave()


@pytest.mark.timeout(60)
def test_a_cache_that_commits_whole_granules_only_ends_a_request_short_of_a_granule(
    tmp_path: Path,
) -> None:
    """transformers' pooled cache commits whole granules only (a borrow maps at a boundary):
    when the pool's share leaves less than a granule past them, `request` commits the whole
    granules that fit and returns. It called the cache's commit again and again without
    progress, for ever: the host pool bench hung in CI with its engines in that loop."""
    pool = Pool("test", directory=tmp_path)
    pool.set_cap("cpu", 10 * 2 * 4096)  # 10 blocks: 2 and a half granules of 4
    with cache() as c:
        commit = c.commit
        rounded: list[int] = []

        def commit_whole_granules(num_blocks: int) -> None:
            rounded.append(num_blocks)
            commit(num_blocks // 4 * 4)

        c.commit = commit_whole_granules  # type: ignore[method-assign]
        (m,) = members_of(pool, {"a": c}, {"a": 0}, max_blocks=64).values()
        m.join()
        decisions = m.request(16)
        assert (decisions[0].action, decisions[0].blocks) == ("commit", 10)
        assert c.committed_blocks == 8
        assert rounded[-1] == 10, rounded  # it tried the last 2 blocks once, and stopped
        with pool.transaction() as ledger:
            assert ledger.engines["a"].committed_blocks == 8  # what it has, not what it planned
        m.leave()


def test_via_the_driver_a_donor_releases_and_the_needy_engine_commits(tmp_path: Path) -> None:
    """`via="driver"`, kvcached's way: asked for blocks, the donor gives its free top blocks
    back to the driver (at a handle boundary, its used blocks kept) instead of lending them,
    the request ends with no loan, and the needy engine's next request commits them from the
    device's free memory. Same policy and ledger: the pool never holds more than its share."""
    pool = Pool("test", directory=tmp_path)
    share = 48 * 2 * 4096
    pool.set_cap("cpu", share)
    used = {"a": 0, "b": 0}
    with cache(export_handle_types=0) as ca, cache(export_handle_types=0) as cb:
        members = members_of(pool, {"a": ca, "b": cb}, used, max_blocks=64, via="driver")
        a, b = members["a"], members["b"]
        a.join()
        b.join()
        assert a.grow(32) == 32
        used["a"] = 10
        ca.views["attn"][:, :10].fill_(3)  # type: ignore[call-overload]
        a.serve()
        plan = [(d.action, d.peer, d.blocks) for d in b.request(40)]
        assert plan == [("commit", "", 16), ("ask", "a", 20), ("wait", "", 4)]
        assert rules.used_bytes(pool.snapshot(), "cpu") == share
        a.serve()  # releases 20 blocks: 10 used + 2 free kept (a handle boundary)
        assert ca.committed_blocks == 12 and ca.physical_bytes == 12 * 2 * 4096
        assert ca.buffers[0].lent_bytes == 0 and ca.buffers[0].pending_release_bytes == 0
        assert bool(ca.views["attn"][:, :10].eq(3).all())  # type: ignore[call-overload]
        ledger = pool.snapshot()
        (answer,) = ledger.loans.values()
        assert (answer.state, answer.lent_blocks, answer.num_bytes) == ("released", 20, 0)
        assert rules.check(ledger) == []
        events = [e.text for e in ledger.events]
        assert "loan 1: a released 20 blocks to the driver for b" in events
        assert rules.used_bytes(ledger, "cpu") == share - 20 * 2 * 4096
        # b reads the answer at its next serve and commits what its ask still lacks at once:
        # the device has the memory free.
        b.serve()
        assert cb.committed_blocks == 36 and cb.buffers[0].borrowed_bytes == 0
        ledger = pool.snapshot()
        assert ledger.loans == {}
        assert rules.check(ledger) == [] and rules.used_bytes(ledger, "cpu") == share
        (ask,) = b.asks
        assert (ask.asked_blocks, ask.got_blocks, ask.committed_blocks) == (40, 36, 36)
        # A donor whose top blocks are live releases nothing, and says why.
        used["b"] = 36
        assert [(d.action, d.peer) for d in a.request(8)] == [("ask", "b")]
        b.serve()
        assert cb.committed_blocks == 36
        a.serve()
        (refused,) = [e.text for e in pool.snapshot().events if "refuses" in e.text]
        assert "its top 32 blocks above its minimum are live" in refused
        b.leave()
        a.leave()
        assert pool.snapshot().engines == {}


# ---------------------------------------------------------------------------------------------
# across models, in bytes


def spec_of(tokens: int) -> tuple[KVCacheTensorSpec, ...]:
    """FLASH_ATTN, K and V: `tokens` x 2 heads x 32 bf16 a block in each segment."""
    layer = AttentionLayerSpec("FLASH_ATTN", tokens, 2, 32, torch.bfloat16)
    return (KVCacheTensorSpec(2 * tokens * 2 * 32 * 2, {"attn": layer}),)


def model_cache(tokens: int, capacity: int = 64) -> ExtensibleKVCache:
    return ExtensibleKVCache(
        spec_of(tokens), capacity, "cpu", granularity=GRANULE, export_handle_types="posix_fd"
    )


def test_engines_of_different_models_lend_to_each_other_counted_in_bytes(
    tmp_path: Path,
) -> None:
    """An engine of 8 KiB blocks lends to one of 12 KiB blocks (one and a half granules a
    segment) and back: the borrower grows by the blocks the memory holds in its own layout,
    the lender lends only whole handles that give it what it asked, and the ledger counts
    the bytes, each engine's own blocks beside them."""
    pool = Pool("test", directory=tmp_path)
    pool.set_cap("cpu", 48 * 2 * GRANULE)
    used = {"small": 0, "big": 0}
    with model_cache(32) as cs, model_cache(48) as cb:
        small, big = members_of(pool, {"small": cs, "big": cb}, used, max_blocks=64).values()
        small.join()
        big.join()
        assert (small.block_bytes, big.block_bytes) == (2 * GRANULE, 3 * GRANULE)
        assert small.grow(32) == 32  # 32 x 8 KiB: 256 KiB of the 384 KiB cap
        used["small"] = 10
        cs.views["attn"][:, :10].fill_(3)  # type: ignore[call-overload]
        small.serve()
        ledger = pool.snapshot()
        assert ledger.engines["small"].lendable_blocks == 20  # above its 10 used, whole handles
        plan = [(d.action, d.peer, d.blocks) for d in big.request(20)]
        # 128 KiB free: 10 of its 12 KiB blocks; the rest (10 blocks, 120 KiB) from small.
        assert plan == [("commit", "", 10), ("ask", "small", 10)]
        small.serve()  # lends the fewest handles that give big its 10 blocks: 16 of its own
        assert cs.committed_blocks == 16
        big.serve()
        # 16 granules a segment hold 10 of its blocks of 1.5 (12 would hold 8): the rest is
        # slack its next block starts in.
        assert cb.committed_blocks == 20
        ledger = pool.snapshot()
        (loan,) = ledger.loans.values()
        assert (loan.state, loan.lent_blocks, loan.num_bytes) == ("borrowed", 16, 16 * 8192)
        assert (loan.blocks, loan.start_block, loan.kept_blocks) == (10, 10, 16)
        assert loan.mapped_bytes == loan.num_bytes and loan.asked_bytes == 10 * 3 * GRANULE
        check_holdings(ledger, {"small": small, "big": big})
        assert rules.used_bytes(ledger, "cpu") == cs.physical_bytes + cb.physical_bytes
        assert bool(cs.views["attn"][:, :10].eq(3).all())  # type: ignore[call-overload]
        # small wants its memory back: recalled, given back, reclaimed whole.
        assert [d.action for d in small.request(8)] == ["recall"]
        big.serve()
        small.serve()
        assert (cs.committed_blocks, cb.committed_blocks) == (32, 10)
        assert pool.snapshot().loans == {} and rules.check(pool.snapshot()) == []
        # The other way: big lends to small (12 KiB blocks of 3 granules to 8 KiB ones).
        used["small"], used["big"] = 32, 0
        big.serve()
        small.serve()
        plan = [(d.action, d.peer, d.blocks) for d in small.request(6)]
        assert plan == [("commit", "", 1), ("ask", "big", 5)]  # 8 KiB left under the cap
        big.serve()
        small.serve()
        ledger = pool.snapshot()
        (loan,) = ledger.loans.values()
        # big cuts at its handles (3 granules a segment after its commits of 4 blocks, the
        # 16 given back): the most of the 5 asked that a cut gives, 2 of its blocks for 3.
        assert (loan.state, loan.lent_blocks, loan.blocks) == ("borrowed", 2, 3)
        assert cs.committed_blocks == 33 + 3
        check_holdings(ledger, {"small": small, "big": big})
        assert rules.used_bytes(ledger, "cpu") == cs.physical_bytes + cb.physical_bytes
        assert [d.action for d in big.request(2)] == ["recall"]
        small.serve()
        big.serve()
        assert cs.committed_blocks == 33 and pool.snapshot().loans == {}
        small.leave()
        big.leave()
        assert pool.snapshot().engines == {}


def test_a_borrower_that_cannot_use_every_handle_maps_the_rest_and_the_ledger_says_so(
    tmp_path: Path,
) -> None:
    """Handles the borrower's layout cannot use (here: its reservation has room for one 4
    granule handle a segment) go back to the lender at once, unmapped: the loan says what the
    borrower maps (`mapped_bytes`), the lender holds the rest until its reclaim, and the pool
    counts both."""
    pool = Pool("test", directory=tmp_path)
    used = {"a": 0, "b": 0}
    with model_cache(32) as ca, model_cache(48, capacity=5) as cb:
        a, b = members_of(pool, {"a": ca, "b": cb}, used, max_blocks=None).values()
        a.join()
        b.join()
        assert a.grow(16) == 16
        pool.set_cap("cpu", ca.physical_bytes)  # no free memory: b borrows
        a.serve()
        b.request(5)
        a.serve()
        b.serve()
        ledger = pool.snapshot()
        (loan,) = ledger.loans.values()
        assert loan.state == "borrowed" and 0 < loan.mapped_bytes <= loan.num_bytes
        assert loan.mapped_bytes == sum(t.borrowed_bytes for t in cb.buffers)
        assert loan.blocks == cb.committed_blocks
        check_holdings(ledger, {"a": a, "b": b})
        declined = loan.num_bytes - loan.mapped_bytes
        held = ca.physical_bytes + cb.physical_bytes + declined
        assert rules.used_bytes(ledger, "cpu") == held
        a.request(4)  # recalls
        b.serve()
        a.serve()
        assert ca.committed_blocks == 16 and pool.snapshot().loans == {}
        b.leave()
        a.leave()


def test_limits_may_be_given_in_bytes(tmp_path: Path) -> None:
    pool = Pool("test", directory=tmp_path)
    with model_cache(48) as c:  # 12 KiB a block
        m = PoolMember(
            pool, "m", c, min_bytes=100_000, max_bytes=500_000, free_tail_blocks=lambda: 0
        )
        assert (m.min_blocks, m.max_blocks) == (9, 40)  # at least 100 kB; at most 500 kB
        assert PoolMember(pool, "m", c, free_tail_blocks=lambda: 0).max_blocks == 64
        for kw, message in [
            ({"min_blocks": 1, "min_bytes": 1}, "give min_blocks or min_bytes, not both"),
            ({"max_bytes": 1.5}, "max_bytes must be an int, not float"),
            ({"max_bytes": 65 * 3 * GRANULE}, r"capacity \(64 blocks, 786432 B\)"),
        ]:
            with pytest.raises((TypeError, ValueError), match=message):
                PoolMember(pool, "m", c, free_tail_blocks=lambda: 0, **kw)
        m.join()
        pool.set_limits("m", min_bytes=0, max_bytes=3 * 12 * 1024)
        assert pool.snapshot().engines["m"].max_blocks == 3
        m.leave()


# ---------------------------------------------------------------------------------------------
# a burst: one move


def test_a_burst_asks_for_its_queues_need_and_gets_it_from_free_memory_and_every_donor(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The needy engine asks for what its waiting requests need (in bytes here), up to its
    maximum: the free memory is committed and both idle donors are asked in the same round,
    each answering at its next serve, and the ask is logged with its wait, from the first
    waiting request to the last of its memory mapped."""
    clock = Clock()
    pool = Pool("test", directory=tmp_path, clock=clock)
    pool.set_cap("cpu", 56 * 2 * GRANULE)
    used = {"n": 0, "d1": 0, "d2": 0}
    caplog.set_level(logging.INFO, logger="extensible_kv.pool")
    with cache() as cn, cache() as c1, cache() as c2:
        members = members_of(pool, {"n": cn, "d1": c1, "d2": c2}, used, max_blocks=64)
        n, d1, d2 = members.values()
        for m in members.values():
            m.join()
        assert d1.grow(24) == 24 and d2.grow(24) == 24  # 48 of the cap's 56 blocks
        used["d1"] = used["d2"] = 8
        d1.serve()
        d2.serve()
        first_waiting = clock.now - 0.030  # the queue's first request came 30 ms ago
        plan = n.request_bytes(40 * 2 * GRANULE - 1, since=first_waiting)
        assert [(d.action, d.peer, d.blocks) for d in plan] == [
            ("commit", "", 8),
            ("ask", "d1", 16),
            ("ask", "d2", 16),
        ]
        assert n.asks == []  # open: loans on their way
        clock.now += 0.004
        d1.serve()
        d2.serve()
        clock.now += 0.002
        n.serve()
        assert cn.committed_blocks == 40
        (ask,) = n.asks
        assert (ask.asked_blocks, ask.got_blocks, ask.asked_bytes, ask.got_bytes) == (
            40,
            40,
            40 * 2 * GRANULE,
            40 * 2 * GRANULE,
        )
        assert (ask.committed_blocks, ask.borrowed_blocks, ask.lenders) == (8, 32, ("d1", "d2"))
        assert ask.met and ask.wait_s == pytest.approx(0.036)
        (line,) = [r for r in caplog.records if r.getMessage().startswith("pool ask: engine=n")]
        assert line.getMessage().startswith(
            f"pool ask: engine=n asked_bytes={40 * 8192} got_bytes={40 * 8192} asked_blocks=40 "
            "got_blocks=40 committed_blocks=8 borrowed_blocks=32 lenders=d1,d2 wait_ms=36.000"
        )
        assert line.ask is ask  # type: ignore[attr-defined]
        # An ask nothing more can answer ends short, with what it got.
        n.request(30)
        (_, short) = n.asks
        assert (short.asked_blocks, short.got_blocks, short.met) == (24, 0, False)
        for donor in (d1, d2):
            assert [d.action for d in donor.request(16)] == ["recall"]
        n.serve()
        d1.serve()
        d2.serve()
        assert pool.snapshot().loans == {}
        for m in members.values():
            m.leave()


def test_the_readmes_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (example,) = re.findall(r"```py pool\n(.*?)```", readme, flags=re.S)
    monkeypatch.setenv("EXTENSIBLE_KV_POOL_DIR", str(tmp_path))
    sizes: list[int] = []

    class Engine:
        def free_tail_blocks(self) -> int:
            return c.committed_blocks

        free_top_blocks = free_tail_blocks  # the README's older name for it

        def set_num_blocks(self, n: int) -> None:
            sizes.append(n)

    with cache() as c:
        exec(compile(example, "README.md", "exec"), {"cache": c, "engine": Engine()})
        assert c.committed_blocks == 32 and sizes[-1] == 32
    assert Pool("node").snapshot().engines == {}
    assert Path(tmp_path, "extensible_kv-pool-node").exists()
