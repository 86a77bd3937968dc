"""`python -m extensible_kv pool`: status in bytes across models with each engine's own
blocks beside them, limits in blocks or bytes, caps (and the deprecated `share`), watch,
reset; errors are one line and exit status 2 (the flags one by one: `test_pool_args.py`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from extensible_kv.__main__ import main
from extensible_kv.pool import Pool, rules
from support.pool_ledgers import BB, engine, own_start


def cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of the command (argparse's refusals exit)."""
    try:
        code = main(["pool", "--pool", "test", "--dir", str(tmp_path), *args])
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_status_limit_cap_watch_and_reset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pool = Pool("test", directory=tmp_path)
    with pool.transaction() as ledger:
        now = pool.clock()
        rules.join(ledger, engine("a", os.getpid(), 20), now)
        rules.join(ledger, engine("b", os.getpid(), 8, busy=True, block_bytes=3 * BB), now)
        rules.record(ledger, "a", now, {"start_time": own_start()})
        rules.record(ledger, "b", now, {"start_time": own_start()})
        rules.ask(ledger, "b", "a", 4, now + 3, now, "test")
    assert cli(tmp_path, capsys, "cap", "cpu", "1.5GiB")[0] == 0
    code, out, _ = cli(tmp_path, capsys, "status")
    assert code == 0
    assert "cpu: cap 1.5 GiB, held 352.0 KiB" in out  # 20 x 8 KiB + 8 x 24 KiB
    row = next(line for line in out.splitlines() if line.startswith("b "))
    assert row.split()[:10] == [
        "b",
        str(os.getpid()),
        "cpu",
        "busy",
        "192.0",  # KiB held
        "KiB",
        "8",  # its own blocks
        "24.0",  # KiB a block
        "KiB",
        "0",  # its minimum, 0 B
    ]
    assert "0 B..1.5 MiB (0..64)" in row
    loan_row = next(line for line in out.splitlines() if line.startswith("1 "))
    assert loan_row.split()[:8] == ["1", "a", "b", "asked", "96.0", "KiB", "4", "asked"]
    assert "loan 1: b asks a for 4 blocks (98304 B): test" in out
    code, out, _ = cli(tmp_path, capsys, "limit", "a", "--min", "2", "--max", "30")
    assert (code, out) == (0, "a: 2..30 blocks (16.0 KiB..240.0 KiB)\n")
    # In bytes: a minimum holds them (rounded up to its blocks), a maximum fits in them.
    code, out, _ = cli(tmp_path, capsys, "limit", "b", "--min", "50KiB", "--max", "1MiB")
    assert (code, out) == (0, "b: 3..42 blocks (72.0 KiB..1008.0 KiB)\n")
    code, out, _ = cli(tmp_path, capsys, "status", "--json")
    status = json.loads(out)
    assert [(e["name"], e["min_blocks"], e["max_blocks"]) for e in status["engines"]] == [
        ("a", 2, 30),
        ("b", 3, 42),
    ]
    assert [e["block_bytes"] for e in status["engines"]] == [BB, 3 * BB]
    assert status["engines"][1]["shape"]["buffers"] == [[1, 3 * BB]]
    assert status["caps"] == {"cpu": 3 << 29}
    assert status["loans"][0]["asked_bytes"] == 4 * 3 * BB and "loans" not in status["loans"][0]
    code, out, _ = cli(tmp_path, capsys, "watch", "--count", "2", "--interval", "0.01")
    assert code == 0 and out.count("generation") == 2
    for args, message in [
        (("limit", "a"), "give --min, --max or both"),
        (("limit", "z", "--max", "3"), "no engine 'z' in the pool"),
        (("limit", "a", "--max", "1"), "need 0 <= min <= max <= capacity, got min 2, max 1"),
        (("limit", "a", "--max", "200"), "max 200, capacity 128"),
        (("limit", "a", "--max", "2GiB"), "capacity 128 (blocks of 8192 B"),
        (("limit", "a", "--max", "lots"), "or a size like 2GiB, got 'lots'"),
        (("cap", "gpu", "1"), "device 'gpu': cpu or cuda:N"),
        (("cap", "cpu", "lots"), "a size like 40GiB"),
    ]:
        code, _, err = cli(tmp_path, capsys, *args)
        assert (code, message in err) == (2, True), err
    Path(pool.path).write_bytes(b"junk\n")
    code, _, err = cli(tmp_path, capsys, "status")
    assert code == 2 and "is corrupt: no EKVPOOL header line" in err
    assert cli(tmp_path, capsys, "reset")[0] == 0
    assert "no engines" in cli(tmp_path, capsys, "status")[1]


def test_share_is_the_deprecated_name_of_cap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(tmp_path, capsys, "share", "cpu", "1GiB")
    assert code == 0 and "pool share is deprecated: use pool cap" in err
    assert Pool("test", directory=tmp_path).snapshot().caps == {"cpu": 1 << 30}
    code, out, _ = cli(tmp_path, capsys, "--help")
    assert "deprecated: `pool cap`" in out
