"""A Ctrl-C in the pool (issue 51, item 9): every wait ends on it, and none leaves a move
half-posted.

- **A Ctrl-C during a memory move** (here sent by the cache's own method, right after it moved
  the memory: where it lands worst) is held until the member has noted the move, then raised:
  the ledger stays consistent, and the next transaction posts the move. Before, the
  `KeyboardInterrupt` fell between the move and its note: a lend's loans were lost for good, a
  reclaim's post never came and the next reclaim of the same loan failed.
- **A Ctrl-C in a wait** (`grow` for memory that never comes, `settle` for a borrower that does
  not serve, the pool's lock held by another process) ends it with a `KeyboardInterrupt` long
  before its timeout, each loan as the ledger says; the process then carries on. Real
  processes, sent SIGINT.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from extensible_kv import ExtensibleKVCache
from extensible_kv.pool import Pool, PoolMember, rules
from support.pool_members import BLOCK_BYTES, cache, check_holdings, member

TESTS = str(Path(__file__).resolve().parent)
WAIT_S = 60.0  # the waits' timeout: a Ctrl-C ends them long before


@pytest.fixture
def pair(
    tmp_path: Path,
) -> Iterator[tuple[Pool, dict[str, ExtensibleKVCache], dict[str, PoolMember], dict[str, int]]]:
    pool = Pool("test", directory=tmp_path)
    pool.set_cap("cpu", 48 * BLOCK_BYTES)
    caches = {"a": cache(), "b": cache()}
    used = {"a": 0, "b": 0}
    members = {n: member(pool, n, c, used) for n, c in caches.items()}
    for m in members.values():
        m.join()
    yield pool, caches, members, used
    for c in caches.values():
        c.close()


def interrupt_after(c: ExtensibleKVCache, method: str) -> None:
    """A Ctrl-C (SIGINT to this process) right after `c.method` next moved memory, once."""
    original = getattr(c, method)

    def moved_then_interrupted(*args: Any, **kw: Any) -> Any:
        result = original(*args, **kw)
        setattr(c, method, original)
        os.kill(os.getpid(), signal.SIGINT)  # Python raises it at its next look
        return result

    setattr(c, method, moved_then_interrupted)


@pytest.mark.parametrize(
    ("who", "method", "before"),
    [
        ("a", "lend", []),
        ("b", "borrow", ["a"]),
        ("b", "give_back", ["a", "b", "recall"]),
        ("a", "reclaim", ["a", "b", "recall", "b"]),
    ],
)
def test_a_ctrl_c_during_a_move_waits_for_its_note_and_the_move_is_posted(
    pair: Any, who: str, method: str, before: list[str]
) -> None:
    pool, caches, members, used = pair
    a, b = members["a"], members["b"]
    assert a.grow(32) == 32
    used["a"] = 10
    caches["a"].views["attn"][:, :10].fill_(3)  # type: ignore[call-overload]
    b.request(40)
    for step in before:
        if step == "recall":
            assert [d.action for d in a.request(8)] == ["recall"]
        else:
            members[step].serve()
    interrupt_after(caches[who], method)
    with pytest.raises(KeyboardInterrupt):
        members[who].serve()
    ledger = pool.snapshot()
    assert rules.check(ledger) == []  # no half-posted state: the move is not posted yet
    members[who].serve()  # its next transaction posts what moved
    check_holdings(pool.snapshot(), {who: members[who]})
    for _ in range(10):  # and everything comes home
        ledger = pool.snapshot()
        if not ledger.loans and caches["a"].committed_blocks == 32:
            break
        if any(x.lender == "a" and not x.recall for x in ledger.loans.values()):
            a.request(8)
        b.serve()
        a.serve()
    assert pool.snapshot().loans == {}
    assert caches["a"].committed_blocks == 32, "the lender lost blocks for good"
    assert bool(caches["a"].views["attn"][:, :10].eq(3).all())  # type: ignore[call-overload]
    check_holdings(pool.snapshot(), members)
    b.leave()
    a.leave()


# ---------------------------------------------------------------------------------------------
# waits, in a process of their own


def start(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
        },
    )


def expect(process: subprocess.Popen[str], line: str) -> str:
    assert process.stdout is not None
    got = process.stdout.readline()
    if not got.startswith(line):
        process.kill()
        _, err = process.communicate()
        raise AssertionError(f"expected {line!r}, got {got!r}; stderr: {err[-3000:]}")
    return got


def interrupt(process: subprocess.Popen[str]) -> float:
    """SIGINT, once the process is in its wait (it said so, and a moment passed); the
    seconds it says the wait lasted after that."""
    time.sleep(0.3)
    os.kill(process.pid, signal.SIGINT)
    return float(expect(process, "interrupted").split()[1])


GROW = """
import sys, time
from extensible_kv.pool import Pool, rules
from support.pool_members import cache, member
pool = Pool("t", directory=sys.argv[1])
pool.set_cap("cpu", 0)  # no memory will come, and there is no donor
m = member(pool, "m", cache(), {"m": 0})
m.join()
print("waiting", flush=True)
started = time.monotonic()
try:
    m.grow(8, timeout_s=float(sys.argv[2]))
except KeyboardInterrupt:
    print("interrupted", time.monotonic() - started, flush=True)
assert rules.check(pool.snapshot()) == []
m.leave()
print("left", flush=True)
"""


def test_a_ctrl_c_ends_a_grow_waiting_for_memory(tmp_path: Path) -> None:
    with start(GROW, str(tmp_path), str(WAIT_S)) as process:
        expect(process, "waiting")
        waited = interrupt(process)
        assert waited < WAIT_S / 4, f"the grow ended {waited:.1f} s in, its timeout {WAIT_S} s"
        expect(process, "left")
        assert process.wait(timeout=60) == 0


LOCK = """
import sys, time
from extensible_kv.pool import Pool
pool = Pool("t", directory=sys.argv[1], lock_timeout_s=float(sys.argv[2]))
print("waiting", flush=True)
started = time.monotonic()
try:
    pool.snapshot()
except KeyboardInterrupt:
    print("interrupted", time.monotonic() - started, flush=True)
sys.stdin.readline()  # the lock is free now
assert pool.snapshot().engines == {}
print("read", flush=True)
"""


def test_a_ctrl_c_ends_a_wait_for_the_pools_lock(tmp_path: Path) -> None:
    pool = Pool("t", directory=tmp_path)
    pool.snapshot()
    holder = os.open(pool.lock_path, os.O_RDONLY)  # another process's hold on the lock
    fcntl.flock(holder, fcntl.LOCK_EX)
    with start(LOCK, str(tmp_path), str(WAIT_S)) as process:
        try:
            expect(process, "waiting")
            waited = interrupt(process)
            assert waited < WAIT_S / 4
        finally:
            os.close(holder)
        assert process.stdin is not None
        process.stdin.write("\n")
        process.stdin.flush()
        expect(process, "read")
        assert process.wait(timeout=60) == 0


SETTLE = """
import sys, time
from extensible_kv.pool import Pool, rules
from support.pool_members import cache, member
pool = Pool("t", directory=sys.argv[1])
c = cache()
used = {"a": 0}
a = member(pool, "a", c, used)
a.join()
a.grow(32)
used["a"] = 10
print("ready", flush=True)
sys.stdin.readline()  # b asked
a.serve()  # lends
print("lent", flush=True)
sys.stdin.readline()  # b borrowed
print("waiting", flush=True)
started = time.monotonic()
try:
    a.settle(timeout_s=float(sys.argv[2]))  # b never serves: a waits for it
except KeyboardInterrupt:
    print("interrupted", time.monotonic() - started, flush=True)
assert rules.check(pool.snapshot()) == []
print("checked", flush=True)
sys.stdin.readline()  # b gave it back
a.settle(timeout_s=30.0)
assert c.committed_blocks == 32 and pool.snapshot().loans == {}
a.leave()
print("left", flush=True)
"""


def test_a_ctrl_c_ends_a_settle_waiting_for_a_borrower(tmp_path: Path) -> None:
    pool = Pool("t", directory=tmp_path)
    pool.set_cap("cpu", 48 * BLOCK_BYTES)
    with start(SETTLE, str(tmp_path), str(WAIT_S)) as process:
        settle_interrupted(pool, process)
    assert pool.snapshot().engines == {}


def settle_interrupted(pool: Pool, process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None

    def say() -> None:
        assert process.stdin is not None
        process.stdin.write("\n")
        process.stdin.flush()

    used = {"b": 0}
    with cache() as cb:
        b = member(pool, "b", cb, used)
        b.join()
        expect(process, "ready")
        assert ("ask", "a") in [(d.action, d.peer) for d in b.request(40)]
        say()
        expect(process, "lent")
        b.serve()  # borrows
        assert any(x.state == "borrowed" for x in pool.snapshot().loans.values())
        say()
        expect(process, "waiting")
        waited = interrupt(process)
        assert waited < WAIT_S / 4
        expect(process, "checked")
        (loan,) = pool.snapshot().loans.values()
        assert (loan.state, loan.recall) == ("borrowed", True)  # as it stood: recalled
        b.serve()  # gives it back
        say()
        expect(process, "left")
        assert process.wait(timeout=60) == 0
        b.leave()
