"""The pool's ledger in one process (docs/design.md §11): its file format (format 2: bytes
across models, each engine's cache shape, a loan's `Loan`s in their JSON form) and every check
on what it reads; a ledger of format 1 refused with the way out; and the store's lock (a
killed holder frees it; a live one times out) and writes (one that fails half-way leaves the
ledger whole).

The engines' processes are real in `test_pool_processes.py`; here pids are made up and the
clock is the test's (`support.pool_ledgers`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from extensible_kv.pool import (
    Ledger,
    LedgerCorruptError,
    LedgerVersionError,
    Pool,
    PoolLockTimeout,
    rules,
)
from extensible_kv.pool.ledger import decode, encode
from support.pool_ledgers import NOW, World, engine, sample_ledger

# ---------------------------------------------------------------------------------------------
# the file format


def test_a_ledger_round_trips_through_its_file_format() -> None:
    ledger = sample_ledger()
    data = encode(ledger)
    assert data.startswith(b"EKVPOOL 2 ")
    back = decode(data)
    assert back == ledger
    assert rules.check(back) == []
    assert back.engines["a"].shape == ledger.engines["a"].shape
    assert back.loans[1].loans == ledger.loans[1].loans  # `Loan`s, not tuples


def reframe(body: bytes, version: int = 2) -> bytes:
    """`body` behind a header with the right length and checksum: only the checks on the
    fields can refuse it."""
    return f"EKVPOOL {version} {len(body)} {hashlib.sha256(body).hexdigest()}\n".encode() + body


def body_of(ledger: Ledger) -> dict[str, Any]:
    return json.loads(encode(ledger).partition(b"\n")[2])  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d[:-1], "the header says"),
        (lambda d: d.replace(b'"hello"', b'"hellO"'), "checksum"),
        (lambda d: b"", "no EKVPOOL header"),
        (lambda d: b"EKVPOOL x" + d[9:], "format version"),
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


def test_a_ledger_of_format_1_is_refused_with_the_way_out(tmp_path: Path) -> None:
    """An older library's ledger (blocks of one layout) cannot be read as bytes across
    models, nor can its engines read this one: refused, by type, saying to reset it once
    they are gone; `pool reset` then starts a format-2 ledger."""
    v1 = reframe(b'{"generation":3,"shares":{},"engines":[],"loans":[],"events":[]}', 1)
    with pytest.raises(LedgerVersionError, match="is of format 1, and this library reads format 2"):
        decode(v1)
    pool = Pool("test", directory=tmp_path)
    pool.snapshot()
    Path(pool.path).write_bytes(v1)
    with pytest.raises(LedgerVersionError, match="pool reset` starts a new one"):
        pool.snapshot()
    pool.reset()
    assert Path(pool.path).exists() is False or Path(pool.path).read_bytes() == b""
    pool.snapshot()
    assert Path(pool.path).read_bytes().startswith(b"EKVPOOL 2 ")


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
        (["engines", 0, "shape", "device"], "cuda:x", "'cpu' or 'cuda:N'"),
        (["engines", 0, "shape", "device"], "cuda:1000", "not a device"),
        (["engines", 0, "shape", "granularity"], 0, "shape"),
        (["engines", 0, "shape"], [], "shape is a list"),
        (["engines", 0, "extra"], 1, "unknown keys ['extra']"),
        (["engines", 0, "shape"], KeyError, "missing keys ['shape']"),
        (["engines", 1, "name"], "a", "listed twice"),
        (["loans", 0, "borrower"], "zed", "not an engine of the pool"),
        (["loans", 0, "lender"], "b", "to itself"),
        (["loans", 1, "lender"], "", "not an engine name"),  # only a borrowed loan's may be
        (["loans", 0, "state"], "lost", "not one of"),
        (["loans", 0, "state"], 3, "state is a int"),
        (["loans", 0, "loan_id"], 9, "never handed out"),
        (["loans", 0, "loans"], [], "describe memory exactly when"),
        (["loans", 1, "num_bytes"], 5, "describe memory exactly when"),
        (["loans", 0, "num_bytes"], 5, "is not what its loans describe"),
        (["loans", 0, "asked_bytes"], -1, "out of range"),
        (["loans", 0, "mapped_bytes"], 0, "maps some of its 32768 B exactly when borrowed"),
        (["loans", 0, "mapped_bytes"], 40000, "maps some of its"),
        (["loans", 1, "mapped_bytes"], 1, "exactly when borrowed"),
        (["loans", 0, "loans", 0, "handles", 0], [1, 2, 3], "not 4 integers"),
        (["loans", 0, "loans", 0, "epoch"], -1, "out of range"),
        (["loans", 0, "loans", 0, "tensor_id"], 2**200, "out of range"),
        (["loans", 0, "loans", 0, "version"], 2, "a loan of format '2'"),
        (["loans", 0, "loans", 0], [1], "a loan is a JSON object"),
        (["caps", "cpu"], -5, "out of range"),
        (["caps", "gpu0"], 5, "not a device"),
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
        for e in ledger.engines.values():
            assert e.block_bytes > 0 and e.device
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
    Path(pool.path).write_bytes(b"EKVPOOL 2 5 00\nhello")
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
        pool.set_cap("cpu", -1)
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


def test_the_old_names_work_and_say_they_are_deprecated(tmp_path: Path) -> None:
    """`share` became `cap` (a device's byte cap, not IPC's sharing) and `LoanEntry` became
    `PoolLoan` (the Rust loan board has rows of that name): the old names work, with a
    `DeprecationWarning`."""
    import extensible_kv.pool as pool_package
    from extensible_kv.pool import PoolLoan

    pool = World().pool(tmp_path)
    with pytest.deprecated_call(match="use Pool.set_cap"):
        pool.set_share("cpu", 1 << 20)
    ledger = pool.snapshot()
    assert ledger.caps == {"cpu": 1 << 20}
    with pytest.deprecated_call(match="use Ledger.caps"):
        assert ledger.shares == {"cpu": 1 << 20}
    with pytest.deprecated_call(match="it is PoolLoan"):
        assert pool_package.LoanEntry is PoolLoan
    with pytest.deprecated_call(match="use set_cap"), pool.transaction() as ledger:
        rules.set_share(ledger, "cpu", None, NOW)
    assert pool.snapshot().caps == {}
