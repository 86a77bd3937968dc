"""The pool with real engine processes on the host backend (`pool_engine.py`): three engines
(of one model, or of three different models) borrow and give back under a seeded random
schedule (taking the fds by pid, or over the lenders' sockets) while engines are killed with
SIGKILL at random steps (some in the middle of a command), limits changed at run time from the
command line, and a donor stopped with SIGSTOP.

After every step the ledger is consistent (`rules.check`), says what each engine's process
holds (its own numbers, and the bytes of memory `/proc/<pid>/maps` shows it mapping), and the
pool holds no more than its share. At the end every engine settles its loans: then each
process maps and holds only memory it created, no loan board is open, its other fds are what
they were after it joined, and the ledger has no loan left.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from extensible_kv.pool import Ledger, Pool, _proc, rules
from pool_engine import (
    BLOCK_BYTES,
    MEMFD,
    Proc,
    context,
    joined,
    mapped_bytes,
    memfds,
    start,
)

POOL = "t"
NUMBERS = ("committed_blocks", "physical_bytes", "lent_bytes", "borrowed_bytes")


@pytest.fixture
def ctx() -> Any:
    return context()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Every engine process a test starts; stopped (or reaped) at the end."""
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.stop()


def other_fds(pid: int) -> int:
    """Fds of process `pid` that are not the host backend's memory or a loan board."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        count += not target.startswith(("/memfd:extensible-kv:", "/memfd:extensible-kv-loan:"))
    return count


def check_consistent(
    pool: Pool, live: dict[str, Proc], numbers: dict[str, dict[str, int]], share: int
) -> Ledger:
    """The ledger now, checked against what the engines say and what their processes map."""
    ledger = pool.snapshot()
    assert rules.check(ledger) == [], "\n".join(
        [*map(str, ledger.loans.values()), *(e.text for e in ledger.events)]
    )
    assert set(ledger.engines) == set(live), (set(ledger.engines), set(live))
    for name, proc in live.items():
        entry = ledger.engines[name]
        for key in NUMBERS:
            assert getattr(entry, key) == numbers[name][key], (name, key, entry, numbers[name])
        assert mapped_bytes(proc.pid) == numbers[name]["physical_bytes"], f"{name} counted once"
    assert rules.used_bytes(ledger, "cpu") <= share, "\n".join(
        [
            f"the pool holds {rules.used_bytes(ledger, 'cpu')} B, its cap is {share} B",
            *(
                f"{e.name}: {e.committed_blocks} blocks of {e.block_bytes} B, "
                f"{e.physical_bytes} B mapped, lent {e.lent_bytes}, borrowed {e.borrowed_bytes}"
                for e in ledger.engines.values()
            ),
            *map(str, ledger.loans.values()),
            *(e.text for e in ledger.events[-12:]),
        ]
    )
    return ledger


def check_settled(
    pool: Pool,
    live: dict[str, Proc],
    numbers: dict[str, dict[str, int]],
    fds_after_join: dict[str, int],
) -> None:
    ledger = pool.snapshot()
    assert ledger.loans == {}, ledger.loans
    assert rules.check(ledger) == []
    assert rules.used_bytes(ledger, "cpu") == sum(n["physical_bytes"] for n in numbers.values())
    for name, proc in live.items():
        held = memfds(proc.pid)
        assert held["boards"] == set(), f"{name} keeps a loan board open"
        assert held["held"] <= held["mapped"], f"{name} holds fds of memory it does not map"
        own = f"{MEMFD}{proc.pid}:"
        with open(f"/proc/{proc.pid}/maps") as maps:
            foreign = [line for line in maps if MEMFD in line and own not in line]
        assert foreign == [], f"{name} maps memory of another process: {foreign}"
        assert other_fds(proc.pid) == fds_after_join[name], f"{name} leaked an fd"


@pytest.mark.parametrize(
    ("seed", "refuse_by_pid"),
    [(0, False), (1, False), pytest.param(2, True, id="2-over-sockets")],
)
def test_three_engines_borrow_and_give_back_through_kill_9s(
    tmp_path: Path, ctx: Any, procs: list[Proc], seed: int, refuse_by_pid: bool
) -> None:
    """With `refuse_by_pid`, no engine may take another's fds by pid (Yama's ptrace_scope,
    stood in for): every loan's fds go over its lender's socket, and a kill in the middle of
    a command may fall in such a hand-off, on either side."""
    run_schedule(tmp_path, ctx, procs, seed, refuse_by_pid, ["kv2"] * 3)


@pytest.mark.parametrize(
    ("seed", "refuse_by_pid"),
    [(3, False), pytest.param(4, True, id="4-over-sockets")],
)
def test_three_models_lend_and_borrow_through_kill_9s(
    tmp_path: Path, ctx: Any, procs: list[Proc], seed: int, refuse_by_pid: bool
) -> None:
    """Issue 52: engines of three different tiny models (`pool_engine.LAYOUTS`: a K/V split
    of 8,192 bytes a block in 2 segments, a flat cache of 12,288 in 1, a cache of 6 layer
    segments of 24,576) under the same random schedule and kill -9s, with the same checks
    after every step; a killed engine comes back as its model. Memory moves between different
    models: loans are borrowed across models, in both directions of at least two pairs."""
    moved = run_schedule(tmp_path, ctx, procs, seed, refuse_by_pid, ["kv2", "flat", "layers6"])
    cross = {pair: n for pair, n in moved.items() if pair[0] != pair[1]}
    print(f"loans borrowed between models (lender, borrower): {cross}")
    assert sum(cross.values()) >= 3, f"hardly any memory moved between models: {moved}"
    assert len(cross) >= 2, f"memory moved between one pair of models only: {moved}"


def run_schedule(
    tmp_path: Path,
    ctx: Any,
    procs: list[Proc],
    seed: int,
    refuse_by_pid: bool,
    layouts: list[str],
) -> Counter[tuple[str, str]]:
    """Engines of `layouts` (`pool_engine.LAYOUTS`, one engine each) borrow and give back
    under a seeded random schedule of 160 steps with four kill -9s (a killed engine is
    started again with its layout), checked after every step; at the end they settle and
    leave, and nothing is left. Returns the loans seen borrowed, by (lender's layout,
    borrower's layout)."""
    rng = random.Random(seed)
    pool = Pool(POOL, directory=tmp_path)
    share = 96 * BLOCK_BYTES  # 32 kv2 blocks an engine on average: they must borrow to grow
    pool.set_cap("cpu", share)
    live: dict[str, Proc] = {}
    numbers: dict[str, dict[str, int]] = {}
    fds_after_join: dict[str, int] = {}
    layout_of: dict[str, str] = {}
    serial = 0

    def add(kinds: list[str]) -> None:
        nonlocal serial
        new = []
        for layout in kinds:
            name = f"e{serial}"
            layout_of[name] = layout
            new.append(
                start(
                    ctx,
                    str(tmp_path),
                    POOL,
                    name,
                    seed * 100 + serial,
                    refuse_by_pid=refuse_by_pid,
                    layout=layout,
                )
            )
            serial += 1
        procs.extend(new)
        for proc in new:
            joined(proc)
            live[proc.name] = proc
            _, numbers[proc.name] = proc("serve")
            fds_after_join[proc.name] = other_fds(proc.pid)

    add(layouts)
    steps = 160
    kills = set(rng.sample(range(5, steps - 10), 4))
    borrowed: dict[int, tuple[str, str]] = {}  # loans seen borrowed: their parties' layouts
    killed_with_loans = 0
    over_socket: dict[str, int] = {}  # loans each engine took over a lender's socket
    ledger = pool.snapshot()
    for step in range(steps):
        if step in kills:
            lending = sorted(name for name in live if ledger.loans_of(name))
            victim = live.pop(
                rng.choice(lending if lending and rng.random() < 0.75 else sorted(live))
            )
            killed_with_loans += bool(ledger.loans_of(victim.name))
            if rng.random() < 0.5:  # in the middle of a command
                victim.send(*rng.choice([("serve",), ("request", rng.randint(1, 24))]))
                time.sleep(rng.uniform(0, 0.004))
            killed = time.monotonic()
            victim.kill()  # never reaped here: a zombie, which is dead too
            del numbers[victim.name]
            # Whoever takes the lock next recovers the ledger, once the kernel has ended the
            # process (a SIGKILL is delivered asynchronously, and a loaded machine may take a
            # while to tear the process down): the first transaction after its death does.
            # The 100 ms of the kill to recovery is a benchmark's figure (bench_pool's kill
            # setup), not a bound a shared 2-core machine can promise.
            while _proc.start_time(victim.pid) is not None:
                assert time.monotonic() - killed < 10, "the kernel did not end the process"
                time.sleep(0.001)
            ledger = pool.snapshot()
            assert victim.name not in ledger.engines, "the first transaction did not recover it"
            assert not ledger.loans_of(victim.name) or all(
                loan.state == "returned" for loan in ledger.loans_of(victim.name)
            )
            add([layout_of[victim.name]])
        else:
            name = rng.choice(sorted(live))
            proc = live[name]
            action = rng.choices(["request", "serve", "use", "all"], [3, 2, 2, 3])[0]
            if action == "request":
                _, numbers[name] = proc("request", rng.randint(4, 32))
            elif action == "serve":
                _, numbers[name] = proc("serve")
            elif action == "use":
                # Idle (a donor) or using what it has (its requests are live blocks).
                target = rng.choice([0, rng.randint(0, numbers[name]["committed_blocks"])])
                _, numbers[name] = proc("use", target)
            else:
                for other in live.values():
                    _, numbers[other.name] = other("serve")
        ledger = check_consistent(pool, live, numbers, share)
        for loan in ledger.loans.values():
            if loan.state == "borrowed" and loan.loan_id not in borrowed:
                lender = layout_of.get(loan.lender, "?")  # a dead lender's name is kept
                borrowed[loan.loan_id] = (lender, layout_of[loan.borrower])
        over_socket.update((n, numbers[n]["over_socket"]) for n in live)

    print(f"{len(borrowed)} loans borrowed, {killed_with_loans} of 4 killed with loans")
    assert len(borrowed) >= 5, "the schedule hardly lent anything"
    if refuse_by_pid:
        assert sum(over_socket.values()) >= 5, f"hardly anything went over sockets: {over_socket}"
    else:
        assert sum(over_socket.values()) == 0, over_socket
    assert killed_with_loans >= 1, "no engine was killed with loans in flight"
    for proc in live.values():
        proc.send("settle", 30.0)
    for proc in live.values():
        _, numbers[proc.name] = proc.reply()
    check_settled(pool, live, numbers, fds_after_join)
    for proc in live.values():
        proc.send("leave", 10.0)
    for proc in live.values():
        proc.reply()
    assert pool.snapshot().engines == {}
    return Counter(borrowed.values())


def test_a_stopped_donor_is_passed_over_within_the_bound(
    tmp_path: Path, ctx: Any, procs: list[Proc]
) -> None:
    """The most attractive donor is stopped (SIGSTOP): the request to it expires within the
    answer bound, it is marked stuck and not asked again, and the needy engine gets its blocks
    from the other donor. Once resumed, it heartbeats and is a donor again."""
    bound = 0.3
    pool = Pool(POOL, directory=tmp_path)
    pool.set_cap("cpu", 72 * BLOCK_BYTES)
    stuck, other, needy = (
        start(ctx, str(tmp_path), POOL, n, i, answer_timeout_s=bound)
        for i, n in enumerate(["stuck", "other", "needy"])
    )
    procs.extend([stuck, other, needy])
    for proc in procs:
        joined(proc)
    stuck("grow", 40, 5.0)  # the largest surplus, idle: asked first
    other("grow", 24, 5.0)
    other("use", 4)  # busy, so asked after the idle one
    needy("serve")
    os.kill(stuck.pid, signal.SIGSTOP)
    try:
        other.send("serve_for", 3.0)
        started = time.monotonic()
        got, numbers = needy("grow", 16, 3.0)
        took = time.monotonic() - started
        other.reply()
        assert got >= 16, numbers
        assert took < bound + 1.0, f"the needy engine waited {took:.2f} s"
        ledger = pool.snapshot()
        assert ledger.engines["stuck"].stuck
        assert any("stuck did not answer within the bound" in e.text for e in ledger.events)
        assert [loan.lender for loan in ledger.loans.values()] == ["other"] * len(ledger.loans)
        assert rules.check(ledger) == []
    finally:
        os.kill(stuck.pid, signal.SIGCONT)
    _, numbers = stuck("serve")
    ledger = pool.snapshot()
    assert not ledger.engines["stuck"].stuck
    assert ledger.engines["stuck"].committed_blocks == numbers["committed_blocks"] == 40
    assert rules.check(ledger) == []


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "extensible_kv",
            "pool",
            "--pool",
            POOL,
            "--dir",
            str(tmp_path),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_limits_changed_from_the_command_line_while_engines_run(
    tmp_path: Path, ctx: Any, procs: list[Proc]
) -> None:
    pool = Pool(POOL, directory=tmp_path)
    pool.set_cap("cpu", 64 * BLOCK_BYTES)
    a, b = (start(ctx, str(tmp_path), POOL, n, i) for i, n in enumerate(["a", "b"]))
    procs.extend([a, b])
    for proc in procs:
        joined(proc)
    a("grow", 40, 5.0)
    a("use", 10)
    # A lowered maximum: a gives back what lies past it, but never its used blocks.
    result = run_cli(tmp_path, "limit", "a", "--max", "8")
    assert result.returncode == 0, result.stderr
    assert "a: 4..8 blocks" in result.stdout
    _, numbers = a("serve")
    assert numbers["committed_blocks"] == 12  # 10 used, cut at a handle boundary (steps of 4)
    a("use", 2)
    _, numbers = a("serve")
    assert numbers["committed_blocks"] == 8
    # A raised minimum: a is not asked below it, so b gets only the free memory.
    assert run_cli(tmp_path, "limit", "a", "--min", "8").returncode == 0
    got, _ = b("grow", 64, 0.5)
    assert got == 56  # the share less a's 8 blocks
    assert pool.snapshot().loans == {}
    # The limits are the ledger's: status shows them.
    status = run_cli(tmp_path, "status")
    assert status.returncode == 0, status.stderr
    line = next(line for line in status.stdout.splitlines() if line.startswith("a "))
    assert "8..8" in line
    refused = run_cli(tmp_path, "limit", "a", "--min", "9")
    assert refused.returncode == 2
    assert "need 0 <= min <= max <= capacity, got min 9, max 8" in refused.stderr
