"""The pool's ledger in one process (docs/design.md §11): its file format and every check on
what it reads, the lock (a killed holder frees it; a live one times out), a write that fails
half-way, the rules for a dead engine's loans, the policy's decisions and reasons, the command
line, `PoolMember` in one process, and 10,000 random steps against a model with the totals
checked after each.

The engines' processes are real in `test_pool_processes.py`; here pids are made up and the
clock is the test's (`Pool(clock=..., alive=...)`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from extensible_kv import AttentionLayerSpec, ExtensibleKVCache, KVCacheTensorSpec
from extensible_kv.__main__ import main
from extensible_kv.pool import (
    Engine,
    Ledger,
    LedgerCorruptError,
    LoanEntry,
    Pool,
    PoolLockTimeout,
    PoolMember,
    rules,
)
from extensible_kv.pool.ledger import MAX_EVENTS, decode, encode
from extensible_kv.pool.member import EXPORT_AHEAD_HANDLES
from extensible_kv.pool.policy import plan_answer, plan_grow, plan_release

BB = 8192  # bytes a block
NOW = 100.0


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@dataclass
class World:
    """Made-up processes: `dead` pids are gone."""

    clock: Clock = field(default_factory=Clock)
    dead: set[int] = field(default_factory=set)

    def alive(self, pid: int, start_time: int) -> bool:
        return pid not in self.dead

    def pool(self, directory: Path, **kw: Any) -> Pool:
        return Pool("test", directory=directory, clock=self.clock, alive=self.alive, **kw)


def engine(
    name: str,
    pid: int,
    committed: int = 0,
    *,
    lo: int = 0,
    hi: int = 64,
    lendable: int | None = None,
    busy: bool = False,
) -> Engine:
    return Engine(
        name,
        pid,
        1000 + pid,
        "cpu",
        "L",
        BB,
        lo,
        hi,
        capacity_blocks=128,
        committed_blocks=committed,
        physical_bytes=committed * BB,
        busy=busy,
        heartbeat=NOW,
        lendable_blocks=committed - lo if lendable is None else lendable,
    )


def sample_ledger() -> Ledger:
    ledger = Ledger(next_loan_id=4, shares={"cpu": 1 << 20})
    ledger.engines = {"a": engine("a", 11, 20), "b": engine("b", 12, 8)}
    ledger.engines["a"].lent_bytes = 4 * BB
    ledger.engines["b"].borrowed_bytes = 4 * BB
    native = ["cpu", 4096, 11, 2**100, 1, 7, 9, [[10, 4, 1, 12]]]
    ledger.loans = {
        1: LoanEntry(1, "a", "b", 4, "borrowed", NOW + 1, 4 * BB, 8, 16, loans=[native]),
        3: LoanEntry(3, "b", "a", 2, "asked", NOW + 1),
    }
    ledger.log(NOW, "hello")
    return ledger


# ---------------------------------------------------------------------------------------------
# the file format


def test_a_ledger_round_trips_through_its_file_format() -> None:
    ledger = sample_ledger()
    data = encode(ledger)
    assert data.startswith(b"EKVPOOL 1 ")
    back = decode(data)
    assert back == ledger
    assert rules.check(back) == []


def reframe(body: bytes) -> bytes:
    """`body` behind a header with the right length and checksum: only the checks on the
    fields can refuse it."""
    import hashlib

    return f"EKVPOOL 1 {len(body)} {hashlib.sha256(body).hexdigest()}\n".encode() + body


def body_of(ledger: Ledger) -> dict[str, Any]:
    return json.loads(encode(ledger).partition(b"\n")[2])  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d[:-1], "the header says"),
        (lambda d: d.replace(b'"hello"', b'"hellO"'), "checksum"),
        (lambda d: b"", "no EKVPOOL header"),
        (lambda d: b"EKVPOOL 2" + d[9:], "format version"),
        (lambda d: b"\x00" * 64, "no EKVPOOL header"),
        (lambda d: reframe(b"{not json"), "not JSON"),
        (lambda d: reframe(b"[" * 100000 + b"]" * 100000), "not JSON"),
        (lambda d: reframe(b"[]"), "not an object"),
    ],
)
def test_a_damaged_file_is_a_clear_error(damage: Any, message: str) -> None:
    with pytest.raises(LedgerCorruptError, match=message) as error:
        decode(damage(encode(sample_ledger())), "the file")
    assert "pool reset" in str(error.value)
    assert isinstance(error.value, ValueError)


def edit(path: list[Any], value: Any) -> dict[str, Any]:
    body = body_of(sample_ledger())
    target: Any = body
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return body


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["engines", 0, "pid"], "11", "pid is a str"),
        (["engines", 0, "pid"], 0, "pid is 0"),
        (["engines", 0, "busy"], 1, "busy is a int"),
        (["engines", 0, "min_blocks"], 99, "min_blocks 99 > max_blocks 64"),
        (["engines", 0, "capacity_blocks"], 10, "max_blocks 64 > capacity 10"),
        (["engines", 0, "heartbeat"], float("nan"), "out of range"),
        (["engines", 0, "name"], "../etc", "not an engine name"),
        (["engines", 0, "device"], "cuda:x", "not a device"),
        (["engines", 0, "extra"], 1, "unknown keys ['extra']"),
        (["engines", 0, "layout"], KeyError, "missing keys ['layout']"),
        (["engines", 1, "name"], "a", "listed twice"),
        (["loans", 0, "borrower"], "zed", "not an engine of the pool"),
        (["loans", 0, "lender"], "b", "to itself"),
        (["loans", 1, "lender"], "", "not an engine name"),  # only a borrowed loan's may be
        (["loans", 0, "state"], "lost", "not one of"),
        (["loans", 0, "loan_id"], 9, "never handed out"),
        (["loans", 0, "loans"], [], "describe memory exactly when"),
        (["loans", 1, "num_bytes"], 5, "describe memory exactly when"),
        (["loans", 0, "loans", 0, 7, 0], [1, 2, 3], "not 4 integers"),
        (["loans", 0, "loans", 0, 3], -1, "out of range"),
        (["loans", 0, "loans", 0, 3], 2**200, "out of range"),
        (["shares", "cpu"], -5, "out of range"),
        (["shares", "gpu0"], 5, "not a device"),
        (["next_loan_id"], True, "next_loan_id is a bool"),
    ],
)
def test_every_field_is_checked(path: list[Any], value: Any, message: str) -> None:
    data = reframe(json.dumps(edit(path, value)).encode())
    with pytest.raises(LedgerCorruptError, match=re.escape(message)):
        decode(data)


def test_random_damage_is_refused_or_read_never_a_crash() -> None:
    """Values swapped for values of other types, keys dropped: with a right checksum, so the
    field checks alone stand between them and the code that uses the ledger."""
    rng = random.Random(7)
    values: list[Any] = [None, True, -1, 0, 2**70, 1.5, "", "a", "cuda:0", [], {}, [1], {"a": 1}]
    read = 0
    for _ in range(1500):
        body = body_of(sample_ledger())
        for _ in range(rng.randint(1, 3)):
            target: Any = body
            while True:
                keys = list(target) if isinstance(target, dict) else list(range(len(target)))
                if not keys:
                    break
                key = rng.choice(keys)
                if isinstance(target[key], dict | list) and rng.random() < 0.7:
                    target = target[key]
                    continue
                if isinstance(target, dict) and rng.random() < 0.1:
                    del target[key]
                else:
                    target[key] = copy.deepcopy(rng.choice(values))
                break
        try:
            ledger = decode(reframe(json.dumps(body).encode()))
        except LedgerCorruptError:
            continue
        read += 1
        rules.check(ledger)  # what was read is usable
        assert decode(encode(ledger)) == ledger
    assert read < 1500


# ---------------------------------------------------------------------------------------------
# the store: the lock, the atomic write


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def test_a_live_holder_times_out_others_and_a_killed_one_frees_the_lock(tmp_path: Path) -> None:
    pool = Pool("test", directory=tmp_path, lock_timeout_s=0.2)
    pool.snapshot()  # the pool's directory and lock file
    with subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, pool.lock_path], stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
            started = time.monotonic()
            with pytest.raises(PoolLockTimeout, match=r"held for more than 0\.2 s"):
                pool.snapshot()
            assert 0.2 <= time.monotonic() - started < 1.0
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait()
            started = time.monotonic()
            assert pool.snapshot().engines == {}
            assert time.monotonic() - started < 0.1
        finally:
            holder.kill()


def test_a_write_that_fails_half_way_leaves_the_ledger_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    world = World()
    pool = world.pool(tmp_path)
    with pool.transaction() as ledger:
        rules.join(ledger, engine("a", 1), NOW)
    before = Path(pool.path).read_bytes()
    Path(pool.pool_directory, "ledger.tmp-dead").write_bytes(b"a torn write of a writer that died")

    def crash(src: object, dst: object, **dir_fds: int) -> None:
        raise OSError("killed before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="before the rename"), pool.transaction() as ledger:
        rules.join(ledger, engine("b", 2), NOW)
    monkeypatch.undo()
    assert Path(pool.path).read_bytes() == before
    assert set(pool.snapshot().engines) == {"a"}
    # The next writer removed the dead one's temporary file.
    assert sorted(os.listdir(pool.pool_directory)) == ["ledger", "lock"]


def test_a_body_that_raises_writes_only_the_recovery(tmp_path: Path) -> None:
    world = World()
    pool = world.pool(tmp_path)
    with pool.transaction() as ledger:
        rules.join(ledger, engine("a", 1), NOW)
        rules.join(ledger, engine("b", 2), NOW)
    world.dead.add(1)
    with pytest.raises(RuntimeError), pool.transaction() as ledger:
        assert "a" not in ledger.engines  # recovered first
        rules.leave(ledger, "b", NOW)
        raise RuntimeError
    world.dead.clear()  # the recovery was written: a is gone for good
    assert set(pool.snapshot().engines) == {"b"}


def test_a_corrupt_ledger_stops_every_transaction_until_reset(tmp_path: Path) -> None:
    pool = Pool("test", directory=tmp_path)
    pool.snapshot()
    Path(pool.path).write_bytes(b"EKVPOOL 1 5 00\nhello")
    with pytest.raises(LedgerCorruptError, match="is corrupt"):
        pool.snapshot()
    Path(pool.path).write_bytes(b"")
    with pytest.raises(LedgerCorruptError, match="is empty"):
        pool.snapshot()
    pool.reset()
    assert pool.snapshot() == Ledger(generation=1)


def test_names_and_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pool name"):
        Pool("../x", directory=tmp_path)
    with pytest.raises(ValueError, match="lock_timeout_s"):
        Pool("x", directory=tmp_path, lock_timeout_s=0)
    pool = World().pool(tmp_path)
    with pytest.raises(ValueError, match="a number of bytes"):
        pool.set_share("cpu", -1)
    with pool.transaction() as ledger:
        with pytest.raises(ValueError, match="engine name"):
            rules.join(ledger, engine("a b", 1), NOW)
        rules.join(ledger, engine("a", 1), NOW)
        with pytest.raises(ValueError, match="in the pool already"):
            rules.join(ledger, engine("a", 2), NOW)
        with pytest.raises(ValueError, match="no engine 'z' in the pool"):
            rules.set_limits(ledger, "z", NOW, 1, 2)


def test_the_default_directory_is_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EXTENSIBLE_KV_POOL_DIR", raising=False)
    assert Pool("x").path == "/dev/shm/extensible_kv-pool-x/ledger"
    monkeypatch.setenv("EXTENSIBLE_KV_POOL_DIR", "/run/x")
    assert Pool("x").directory == "/run/x"


# ---------------------------------------------------------------------------------------------
# the rules for a dead engine's loans

MEMORY = [["cpu", 4096, 1, 5, 1, 7, 9, [[10, 2, 1, 12]]]]


@pytest.mark.parametrize(
    ("state", "dies", "after"),
    [
        ("asked", "lender", None),
        ("offered", "lender", None),  # the kernel freed the lender's memory
        ("borrowed", "lender", ("borrowed", "", "b")),  # the borrower holds it: an orphan
        ("returned", "lender", None),
        ("refused", "lender", None),
        ("asked", "borrower", None),
        ("offered", "borrower", ("returned", "a", "")),  # the lender reclaims it
        ("borrowed", "borrower", ("returned", "a", "")),
        ("returned", "borrower", ("returned", "a", "")),
        ("expired", "borrower", None),
    ],
)
def test_a_dead_engines_loans_follow_the_rules(
    tmp_path: Path, state: str, dies: str, after: tuple[str, str, str] | None
) -> None:
    world = World()
    pool = world.pool(tmp_path)
    with pool.transaction() as ledger:
        rules.join(ledger, engine("a", 1, 8), NOW)
        rules.join(ledger, engine("b", 2, 8), NOW)
        memory = state in ("offered", "borrowed", "returned")
        ledger.loans[1] = LoanEntry(
            1, "a", "b", 2, state, NOW + 5, 2 * BB if memory else 0, loans=MEMORY if memory else []
        )
        ledger.next_loan_id = 2
    world.dead.add(1 if dies == "lender" else 2)
    ledger = pool.snapshot()
    assert ("a" if dies == "lender" else "b") not in ledger.engines
    loan = ledger.loans.get(1)
    assert (None if loan is None else (loan.state, loan.lender, loan.borrower)) == after
    assert any("died: its entry goes" in e.text for e in ledger.events)


def test_a_request_not_answered_in_time_expires_and_marks_the_lender_stuck(
    tmp_path: Path,
) -> None:
    world = World()
    pool = world.pool(tmp_path)
    with pool.transaction() as ledger:
        rules.join(ledger, engine("a", 1, 8), NOW)
        rules.join(ledger, engine("b", 2, 8), NOW)
        loan_id = rules.ask(ledger, "b", "a", 2, NOW + 0.5, NOW, "test")
    world.clock.now = NOW + 0.4
    assert pool.snapshot().loans[loan_id].state == "asked"
    world.clock.now = NOW + 0.6
    ledger = pool.snapshot()
    assert ledger.loans[loan_id].state == "expired"
    assert ledger.loans[loan_id].reason == "a did not answer within the bound"
    assert ledger.engines["a"].stuck
    with pool.transaction() as ledger:  # a late answer finds it expired: the lender reclaims
        assert not rules.offer(ledger, loan_id, 6, 2, 2 * BB, MEMORY, NOW + 2, NOW)
        rules.record(ledger, "a", NOW, {})
    assert not pool.snapshot().engines["a"].stuck


# ---------------------------------------------------------------------------------------------
# the policy


def test_free_memory_first_within_the_share_then_idle_donors_first() -> None:
    ledger = Ledger(shares={"cpu": 100 * BB})
    ledger.engines = {
        "needy": engine("needy", 1, 10),
        "busy": engine("busy", 2, 40, lo=4, busy=True),  # 36 above its minimum
        "idle": engine("idle", 3, 30, lo=20),  # 10 above its minimum
        "stale": engine("stale", 4, 10),
    }
    ledger.engines["stale"].heartbeat = NOW - 60
    decisions = plan_grow(ledger, "needy", 40, free_bytes=1 << 40, now=NOW)
    assert [(d.action, d.peer, d.blocks) for d in decisions] == [
        ("commit", "", 10),  # the share less 90 blocks held
        ("ask", "idle", 10),
        ("ask", "busy", 20),
    ]
    assert "10 blocks free for the pool" in decisions[0].reason
    assert decisions[1].reason == "idle is idle and can lend 10 blocks"
    # The device's own free memory caps it too; a donor asked already is asked for the rest.
    ledger.shares = {}
    decisions = plan_grow(ledger, "needy", 40, free_bytes=5 * BB + 100, now=NOW)
    assert decisions[0] == plan_grow(ledger, "needy", 5, free_bytes=5 * BB, now=NOW)[0]


def test_grows_stop_at_the_maximum_and_count_what_is_on_its_way() -> None:
    ledger = Ledger()
    ledger.engines = {"a": engine("a", 1, 10, hi=20), "b": engine("b", 2, 30)}
    ledger.loans[1] = LoanEntry(1, "b", "a", 4, "asked", NOW + 1)
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
        "other-layout": engine("other-layout", 3, 30),
        "borrower": engine("borrower", 4, 30),
        "refused-me": engine("refused-me", 5, 30),
        "live": engine("live", 6, 30, lendable=0),  # its top blocks are live
    }
    ledger.engines["stuck"].stuck = True
    ledger.engines["other-layout"].layout = "M"
    ledger.loans[1] = LoanEntry(1, "live", "borrower", 4, "asked", NOW + 1)
    ledger.next_loan_id = 2
    decisions = plan_grow(ledger, "needy", 8, free_bytes=0, now=NOW, exclude={"refused-me"})
    assert [d.action for d in decisions] == ["wait"]
    assert decisions[0].reason == "no free memory and no donor for the rest"


def test_a_lender_recalls_its_loans_newest_first_before_anything_else() -> None:
    ledger = Ledger()
    ledger.engines = {"a": engine("a", 1, 8), "b": engine("b", 2, 8), "c": engine("c", 3, 8)}
    ledger.loans = {
        1: LoanEntry(1, "a", "b", 4, "borrowed", 0, BB, kept_blocks=12, loans=MEMORY),
        2: LoanEntry(2, "a", "c", 4, "borrowed", 0, BB, kept_blocks=8, loans=MEMORY),
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
        1: LoanEntry(1, "lender", "other", 8, "borrowed", 0, BB, 18, kept_blocks=28, loans=MEMORY),
        2: LoanEntry(2, "lender", "other", 4, "borrowed", 0, BB, 26, kept_blocks=20, loans=MEMORY),
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
    ledger.engines["other"].free_top_blocks = 4
    assert plan() == [("recall", "other", 4), ("wait", "", 6)]
    # Recalled already: it waits for them, and still does not ask the lender.
    ledger.loans[2].recall = True
    assert plan() == [("wait", "", 4), ("wait", "", 6)]
    # Its top block in use: the lender lends what it has.
    ledger.loans[2].recall = False
    ledger.engines["other"].free_top_blocks = 3
    assert plan() == [("ask", "lender", 10)]
    # So does a lender whose newest loan the needy engine holds (recalled or not): it cannot
    # take back the rest before that one.
    ledger.engines["other"].busy = False
    ledger.loans[3] = LoanEntry(
        3, "lender", "needy", 2, "borrowed", 0, BB, 8, kept_blocks=18, loans=MEMORY
    )
    assert plan() == [("ask", "lender", 10)]
    ledger.loans[3].recall = True
    assert plan() == [("ask", "lender", 10)]


def test_a_donor_lends_free_top_blocks_above_its_minimum_and_says_why_not() -> None:
    ledger = Ledger()
    ledger.engines = {"d": engine("d", 1, 20, lo=8), "n": engine("n", 2, 0)}
    ledger.loans[1] = LoanEntry(1, "d", "n", 10, "asked", NOW + 1)
    ledger.next_loan_id = 2
    lend = plan_answer(ledger, "d", 1, free_tail_blocks=20)
    assert (lend.action, lend.blocks) == ("lend", 10)
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
    ledger.loans[1] = LoanEntry(1, "d", "n", 2, "asked", NOW + 1)
    ledger.next_loan_id = 2
    # Handles start at blocks 12 and 16: a loan is 4 or 8 blocks, never the 2 asked.
    lend = plan_answer(ledger, "d", 1, free_tail_blocks=12, lend_points={12, 16})
    assert (lend.action, lend.blocks) == ("lend", 4)
    assert "the fewest whole handles that cover the ask" in lend.reason
    ledger.loans[1].blocks = 6  # the most of the ask that ends at a handle
    assert plan_answer(ledger, "d", 1, free_tail_blocks=12, lend_points={12, 16}).blocks == 4
    ledger.loans[1].blocks = 2
    # Not free (the top 3 blocks only), or no room under the borrower's maximum: refused.
    refused = plan_answer(ledger, "d", 1, free_tail_blocks=3, lend_points={12, 16})
    assert (refused.action, refused.blocks) == ("refuse", 0)
    assert "no handle starts within its 2 free top blocks" in refused.reason
    ledger.engines["n"].max_blocks = 7
    refused = plan_answer(ledger, "d", 1, free_tail_blocks=12, lend_points={12, 16})
    assert refused.action == "refuse" and "than n has room for" in refused.reason


def test_an_engine_gives_back_recalled_and_orphaned_loans_top_first_once_free() -> None:
    ledger = Ledger()
    ledger.engines = {"a": engine("a", 1, 8), "b": engine("b", 2, 24, hi=64)}
    ledger.loans = {
        1: LoanEntry(1, "a", "b", 4, "borrowed", 0, BB, 12, loans=MEMORY),
        2: LoanEntry(2, "a", "b", 8, "borrowed", 0, BB, 16, recall=True, loans=MEMORY),
    }
    ledger.next_loan_id = 3
    ledger.engines["b"].borrowed_bytes = 2 * BB
    # The recalled loan is on top: back once its blocks are free; the other one stays.
    assert plan_release(ledger, "b", free_tail_blocks=2) == []
    (back,) = plan_release(ledger, "b", free_tail_blocks=8)
    assert (back.action, back.loan_id, back.reason) == ("give_back", 2, "a recalled it")
    # A loan below a kept one cannot go back before it.
    ledger.loans[1].recall, ledger.loans[2].recall = True, False
    assert plan_release(ledger, "b", free_tail_blocks=24) == []
    ledger.loans[2].lender = ""  # its lender died: giving it back frees it
    assert [d.loan_id for d in plan_release(ledger, "b", free_tail_blocks=24)] == [2, 1]


def test_an_engine_past_a_lowered_maximum_shrinks_to_its_used_blocks() -> None:
    ledger = Ledger()
    ledger.engines = {"a": engine("a", 1, 40, hi=8)}
    (shrink,) = plan_release(ledger, "a", free_tail_blocks=30)
    assert (shrink.action, shrink.blocks) == ("shrink", 30)  # 10 used: it keeps them
    assert shrink.reason == "past its maximum (8 blocks)"
    (shrink,) = plan_release(ledger, "a", free_tail_blocks=40)
    assert shrink.blocks == 32


# ---------------------------------------------------------------------------------------------
# the command line


def cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of the command (argparse's refusals exit)."""
    try:
        code = main(["pool", "--pool", "test", "--dir", str(tmp_path), *args])
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_status_limit_share_watch_and_reset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pool = Pool("test", directory=tmp_path)
    with pool.transaction() as ledger:
        now = pool.clock()
        rules.join(ledger, engine("a", os.getpid(), 20), now)
        rules.join(ledger, engine("b", os.getpid(), 8, busy=True), now)
        rules.record(ledger, "a", now, {"start_time": _own_start()})
        rules.record(ledger, "b", now, {"start_time": _own_start()})
        rules.ask(ledger, "b", "a", 4, now + 3, now, "test")
    assert cli(tmp_path, capsys, "share", "cpu", "1.5GiB")[0] == 0
    code, out, _ = cli(tmp_path, capsys, "status")
    assert code == 0
    assert "cpu: share 1.5 GiB, held 224.0 KiB" in out
    row = next(line for line in out.splitlines() if line.startswith("b "))
    assert row.split()[:6] == ["b", str(os.getpid()), "cpu", "busy", "8", "0..64"]
    assert any(line.split()[:5] == ["1", "a", "b", "asked", "4"] for line in out.splitlines())
    assert "loan 1: b asks a for 4 blocks: test" in out
    code, out, _ = cli(tmp_path, capsys, "limit", "a", "--min", "2", "--max", "30")
    assert (code, out) == (0, "a: 2..30 blocks\n")
    code, out, _ = cli(tmp_path, capsys, "status", "--json")
    status = json.loads(out)
    assert [(e["name"], e["min_blocks"], e["max_blocks"]) for e in status["engines"]] == [
        ("a", 2, 30),
        ("b", 0, 64),
    ]
    assert status["shares"] == {"cpu": 3 << 29}
    code, out, _ = cli(tmp_path, capsys, "watch", "--count", "2", "--interval", "0.01")
    assert code == 0 and out.count("generation") == 2
    for args, message in [
        (("limit", "a"), "give --min, --max or both"),
        (("limit", "z", "--max", "3"), "no engine 'z' in the pool"),
        (("limit", "a", "--max", "1"), "need 0 <= min <= max <= capacity, got min 2, max 1"),
        (("limit", "a", "--max", "200"), "max 200, capacity 128"),
        (("share", "gpu", "1"), "device 'gpu': cpu or cuda:N"),
        (("share", "cpu", "lots"), "a size like 40GiB"),
    ]:
        code, _, err = cli(tmp_path, capsys, *args)
        assert (code, message in err) == (2, True), err
    Path(pool.path).write_bytes(b"junk\n")
    code, _, err = cli(tmp_path, capsys, "status")
    assert code == 2 and "is corrupt: no EKVPOOL header line" in err
    assert cli(tmp_path, capsys, "reset")[0] == 0
    assert "no engines" in cli(tmp_path, capsys, "status")[1]


def _own_start() -> int:
    from extensible_kv.pool import _proc

    return _proc.own_start_time()


# ---------------------------------------------------------------------------------------------
# PoolMember in one process (the cross-process behaviour is test_pool_processes.py's)

SPEC = (
    KVCacheTensorSpec(
        2 * 4096, {"attn": AttentionLayerSpec("FLASH_ATTN", 32, 2, 32, torch.bfloat16)}
    ),
)


def cache(**kw: Any) -> ExtensibleKVCache:
    kw = {"export_handle_types": "posix_fd", **kw}
    return ExtensibleKVCache(SPEC, 64, "cpu", granularity=4096, **kw)


def members_of(
    pool: Pool, caches: dict[str, ExtensibleKVCache], used: dict[str, int], **kw: Any
) -> dict[str, PoolMember]:
    """A member over each cache, named as in `caches`, minimum 4 blocks, committing 4 at a
    time, its top blocks past `used[name]` free."""
    return {
        name: PoolMember(
            pool,
            name,
            c,
            min_blocks=4,
            commit_step_blocks=4,
            free_tail_blocks=lambda name=name, c=c: c.committed_blocks - used[name],
            **kw,
        )
        for name, c in caches.items()
    }


def lender_and_borrower(
    pool: Pool, ca: ExtensibleKVCache, cb: ExtensibleKVCache, used: dict[str, int]
) -> tuple[PoolMember, PoolMember]:
    """Members a and b joined (up to 64 blocks each), a at 32 blocks of which its first 10
    are live and hold 3s."""
    a, b = members_of(pool, {"a": ca, "b": cb}, used, max_blocks=64).values()
    a.join()
    b.join()
    assert a.grow(32) == 32
    used["a"] = 10
    ca.views["attn"][:, :10].fill_(3)  # type: ignore[call-overload]
    return a, b


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
    pool.set_share("cpu", 48 * 2 * 4096)
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
    pool.set_share("cpu", 48 * 2 * 4096)
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
    pool.set_share("cpu", 48 * 2 * 4096)
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
    pool.set_share("cpu", 40 * 2 * 4096)
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


class Moving:
    """An `ExtensibleKVCache` with the engine's part of a `MovingCache`: the blocks in `live`
    are the ones requests hold; `move_below` copies each at or past the cut into the lowest
    free block below it, as transformers' pooled cache does, and renames it in `live`."""

    def __init__(self, inner: ExtensibleKVCache) -> None:
        self.inner = inner
        self.live: set[int] = set()
        self.moves: list[tuple[int, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def member(self, pool: Pool, name: str, **kw: Any) -> PoolMember:
        """A member over it, as `members_of`'s (minimum 4 blocks, committing 4 at a time),
        its free top what `live` leaves."""
        return PoolMember(
            pool,
            name,
            self,  # type: ignore[arg-type]
            min_blocks=4,
            max_blocks=64,
            commit_step_blocks=4,
            free_tail_blocks=self.free_tail,
            **kw,
        )

    def hold(self, live: set[int]) -> None:
        """Requests hold blocks `live` now, each block marked with its number plus one."""
        self.live = set(live)
        for block in live:
            self.inner.views["attn"][:, block].fill_(block + 1)  # type: ignore[call-overload]

    def free_tail(self) -> int:
        return self.inner.committed_blocks - (max(self.live, default=-1) + 1)

    def free_blocks(self) -> int:
        return self.inner.committed_blocks - len(self.live)

    def move_below(self, num_blocks: int) -> None:
        above = sorted(b for b in self.live if b >= num_blocks)
        free = [b for b in range(num_blocks) if b not in self.live]
        if len(free) < len(above):
            raise RuntimeError(f"only {len(free)} free blocks below {num_blocks}")
        view = self.inner.views["attn"]
        for old, new in zip(above, free, strict=False):
            view[:, new] = view[:, old]
            self.live = (self.live - {old}) | {new}
            self.moves.append((old, new))


def test_a_donor_with_move_moves_live_blocks_down_and_lends_the_free_ones_above(
    tmp_path: Path,
) -> None:
    """A donor whose top blocks are live refuses without `move=True`; with it, its live
    blocks above the cut are copied into free ones below (their bytes kept) and it lends
    every free block above its minimum, at a handle boundary. Through the driver, it moves
    them the same way before it releases the blocks above the cut."""
    for move, via in ((False, "loan"), (True, "loan"), (True, "driver")):
        pool = Pool(f"test-{move}-{via}", directory=tmp_path)
        pool.set_share("cpu", 32 * 2 * 4096)  # the donor's 32 blocks take all of it
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
        pool.set_share("cpu", 32 * 2 * 4096)
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
            free_top = pool.snapshot().engines["b"].free_top_blocks
            assert free_top == (20 if move else 2)  # 24 - 4 live, or the two above block 21
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
    pool.set_share("cpu", 64 * 2 * 4096)
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
    pool.set_share("cpu", 10 * 2 * 4096)  # 10 blocks: 2 and a half granules of 4
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
    pool.set_share("cpu", share)
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
        assert ledger.loans == {} and rules.check(ledger) == []
        events = [e.text for e in ledger.events]
        assert "loan 1: a released 20 blocks to the driver for b" in events
        assert rules.used_bytes(ledger, "cpu") == share - 20 * 2 * 4096
        # The next request finds them free on the device, and commits them.
        plan = [(d.action, d.peer, d.blocks) for d in b.request(24)]
        assert plan[0] == ("commit", "", 20)
        assert cb.committed_blocks == 36 and cb.buffers[0].borrowed_bytes == 0
        ledger = pool.snapshot()
        assert rules.check(ledger) == [] and rules.used_bytes(ledger, "cpu") == share
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
# 10,000 random steps against a model


@dataclass
class MEngine:
    pid: int
    committed: int = 0
    own: int = 0  # bytes it created and still owns, mapped or lent
    physical: int = 0
    lent: int = 0
    borrowed: int = 0
    stuck: bool = False


@dataclass
class MLoan:
    lender: str
    borrower: str
    state: str
    blocks: int
    deadline: float
    num_bytes: int = 0


class Model:
    """What the ledger must say, kept independently: engines, loans, and the bytes each
    engine owns (which only its own commits and shrinks change)."""

    def __init__(self) -> None:
        self.engines: dict[str, MEngine] = {}
        self.loans: dict[int, MLoan] = {}
        self.orphan_bytes = 0

    def recover(self, now: float, dead: set[int]) -> None:
        for name, e in list(self.engines.items()):
            if e.pid in dead:
                self.drop(name)
        for loan in self.loans.values():
            if loan.state == "asked" and loan.deadline < now:
                loan.state = "expired"
                self.engines[loan.lender].stuck = True

    def drop(self, name: str) -> None:
        for loan_id, loan in list(self.loans.items()):
            if loan.lender == name:
                if loan.state == "borrowed":
                    loan.lender = ""
                    self.orphan_bytes += loan.num_bytes
                else:
                    del self.loans[loan_id]
            elif loan.borrower == name:
                if loan.state in ("offered", "borrowed", "returned") and loan.lender:
                    loan.state, loan.borrower = "returned", ""
                else:
                    if not loan.lender:  # an orphan: the kernel freed it with its borrower
                        self.orphan_bytes -= loan.num_bytes
                    del self.loans[loan_id]
        del self.engines[name]

    def compare(self, ledger: Ledger) -> None:
        assert rules.check(ledger) == []
        assert set(ledger.engines) == set(self.engines)
        for name, e in self.engines.items():
            got = ledger.engines[name]
            assert (
                got.committed_blocks,
                got.physical_bytes,
                got.lent_bytes,
                got.borrowed_bytes,
                got.stuck,
            ) == (e.committed, e.physical, e.lent, e.borrowed, e.stuck), name
        assert {i: (x.lender, x.borrower, x.state, x.blocks) for i, x in ledger.loans.items()} == {
            i: (x.lender, x.borrower, x.state, x.blocks) for i, x in self.loans.items()
        }
        # Nothing lost or counted twice: the pool holds what its engines own, plus what a dead
        # lender left with its borrowers.
        own = sum(e.own for e in self.engines.values())
        assert rules.used_bytes(ledger, "cpu") == own + self.orphan_bytes


def test_ten_thousand_random_steps_against_a_model(tmp_path: Path) -> None:
    rng = random.Random(2024)
    world = World()
    pool = world.pool(tmp_path)
    model = Model()
    fds = len(os.listdir("/proc/self/fd"))
    serial = 0
    counts: dict[str, int] = {}

    def post(ledger: Ledger, name: str) -> None:
        e = model.engines[name]
        rules.record(
            ledger,
            name,
            world.clock.now,
            {
                "committed_blocks": e.committed,
                "physical_bytes": e.physical,
                "lent_bytes": e.lent,
                "borrowed_bytes": e.borrowed,
            },
        )
        e.stuck = False

    def of(states: tuple[str, ...], live_lender: bool = False) -> list[int]:
        return [
            i
            for i, x in model.loans.items()
            if x.state in states and (x.lender in model.engines or not live_lender)
        ]

    for _ in range(10_000):
        with pool.transaction() as ledger:
            model.recover(world.clock.now, world.dead)
            model.compare(ledger)
            now = world.clock.now
            names = sorted(model.engines)
            ops = ["tick", "join"] if len(names) < 6 else ["tick"]
            if names:
                ops += ["commit", "limits", "die", "ask", "leave"]
            ops += ["offer", "refuse"] * bool(of(("asked",)))
            ops += ["take"] * bool(of(("offered",))) + ["recall"] * bool(of(("borrowed",)))
            ops += ["give_back"] * bool(of(("borrowed",)))
            ops += ["reclaim"] * bool(of(("returned",), live_lender=True))
            ops += ["forget"] * bool(of(("refused", "expired")))
            op = rng.choice(ops)
            counts[op] = counts.get(op, 0) + 1
            if op == "tick":
                world.clock.now += rng.uniform(0, 0.3)
            elif op == "join":
                serial += 1
                name = f"e{serial}"
                committed = rng.randint(0, 40)
                model.engines[name] = MEngine(serial, committed, committed * BB, committed * BB)
                new = engine(name, serial, committed)
                rules.join(ledger, new, now)
            elif op == "die":
                world.dead.add(model.engines[rng.choice(names)].pid)
            elif op == "leave":
                name = rng.choice(names)
                busy = [
                    x
                    for x in model.loans.values()
                    if name in (x.lender, x.borrower) and x.state not in ("refused", "expired")
                ]
                if busy:
                    with pytest.raises(ValueError, match="loans in flight"):
                        rules.leave(ledger, name, now)
                else:
                    rules.leave(ledger, name, now)
                    model.drop(name)
            elif op == "commit":  # its own memory grows or shrinks (never below what it lent)
                name = rng.choice(names)
                e = model.engines[name]
                delta = rng.randint(-e.committed + e.borrowed // BB, 8)
                e.committed += delta
                e.physical += delta * BB
                e.own += delta * BB
                post(ledger, name)
            elif op == "limits":
                lo = rng.randint(0, 8)
                rules.set_limits(ledger, rng.choice(names), now, lo, lo + rng.randint(0, 64))
            elif op == "ask":
                borrower, lender = rng.choice(names), rng.choice(names)
                if borrower != lender:
                    blocks = rng.randint(1, 8)
                    deadline = now + rng.uniform(0.1, 1.0)
                    loan_id = rules.ask(ledger, borrower, lender, blocks, deadline, now, "t")
                    model.loans[loan_id] = MLoan(lender, borrower, "asked", blocks, deadline)
            elif op == "offer":
                loan_id = rng.choice(of(("asked",)))
                loan = model.loans[loan_id]
                e = model.engines[loan.lender]
                blocks = min(loan.blocks, e.committed - e.borrowed // BB)
                if blocks > 0:
                    e.committed -= blocks
                    e.physical -= blocks * BB
                    e.lent += blocks * BB
                    assert rules.offer(
                        ledger, loan_id, e.committed, blocks, blocks * BB, MEMORY, now + 1, now
                    )
                    loan.state, loan.blocks, loan.num_bytes = "offered", blocks, blocks * BB
                    post(ledger, loan.lender)
            elif op == "refuse":
                loan_id = rng.choice(of(("asked",)))
                rules.refuse(ledger, loan_id, "no", now)
                model.loans[loan_id].state = "refused"
            elif op == "take":
                loan_id = rng.choice(of(("offered",)))
                loan = model.loans[loan_id]
                e = model.engines[loan.borrower]
                rules.took(ledger, ledger.loans[loan_id], e.committed, now)
                e.committed += loan.blocks
                e.physical += loan.num_bytes
                e.borrowed += loan.num_bytes
                loan.state = "borrowed"
                post(ledger, loan.borrower)
            elif op == "recall":
                rules.recall(ledger, rng.choice(of(("borrowed",))), "r", now)
            elif op == "give_back":
                loan_id = rng.choice(of(("borrowed",)))
                loan = model.loans[loan_id]
                e = model.engines[loan.borrower]
                e.committed -= loan.blocks
                e.physical -= loan.num_bytes
                e.borrowed -= loan.num_bytes
                rules.returned(ledger, loan_id, "done", now)
                if loan.lender:
                    loan.state = "returned"
                else:
                    del model.loans[loan_id]
                    model.orphan_bytes -= loan.num_bytes
                post(ledger, loan.borrower)
            elif op == "reclaim":
                loan_id = rng.choice(of(("returned",), live_lender=True))
                loan = model.loans.pop(loan_id)
                e = model.engines[loan.lender]
                e.committed += loan.blocks
                e.physical += loan.num_bytes
                e.lent -= loan.num_bytes
                rules.reclaimed(ledger, loan_id, now)
                post(ledger, loan.lender)
            elif op == "forget":
                loan_id = rng.choice(of(("refused", "expired")))
                rules.forget(ledger, loan_id)
                del model.loans[loan_id]
            model.compare(ledger)
            assert len(ledger.events) <= MAX_EVENTS
    model.recover(world.clock.now, world.dead)
    model.compare(pool.snapshot())
    assert len(os.listdir("/proc/self/fd")) == fds, "the ledger leaked an fd"
    with open("/proc/self/maps") as maps:
        assert "extensible_kv-pool" not in maps.read()
    assert min(counts.values()) >= 50, counts  # every kind of step ran, many times


def test_the_readmes_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    (example,) = re.findall(r"```py pool\n(.*?)```", readme, flags=re.S)
    monkeypatch.setenv("EXTENSIBLE_KV_POOL_DIR", str(tmp_path))
    sizes: list[int] = []

    class Engine:
        def free_top_blocks(self) -> int:
            return c.committed_blocks

        def set_num_blocks(self, n: int) -> None:
            sizes.append(n)

    with cache() as c:
        exec(compile(example, "README.md", "exec"), {"cache": c, "engine": Engine()})
        assert c.committed_blocks == 32 and sizes[-1] == 32
    assert Pool("node").snapshot().engines == {}
    assert Path(tmp_path, "extensible_kv-pool-node").exists()
