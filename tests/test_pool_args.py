"""Every public argument of the pool is checked at the door (issue 51, items 8, 10 and 11): a
value its ledger's readers would refuse never gets in, however it comes (a call, the command
line, a member's timeouts), and the store refuses to write one that gets past a check; a bad
flag on the command line is one line on stderr and exit status 2; a wait's timeout is a
finite number of seconds.

Each refused call leaves the ledger readable: before these checks, one such value stopped every
engine of the pool until `pool reset`.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from extensible_kv.__main__ import main
from extensible_kv.pool import Ledger, Pool, PoolMember, rules
from support.pool_members import cache, member

NAN, INF = math.nan, math.inf
MAX_INT = 2**128  # the ledger's readers refuse integers from here up


@pytest.fixture
def pool(tmp_path: Path) -> Pool:
    p = Pool("test", directory=tmp_path)
    with p.transaction() as ledger:  # an engine to set limits of
        rules.join(ledger, _engine(), p.clock())
    return p


def _engine() -> Any:
    """Engine a, of this process (so that the recovery step keeps it)."""
    from extensible_kv.pool import Engine, _proc
    from support.pool_ledgers import shape

    return Engine("a", os.getpid(), _proc.own_start_time(), shape(8192), 0, 8, 16)


def readable(pool: Pool) -> Ledger:
    """The ledger as every engine reads it (a `LedgerCorruptError` if a refused value got in)."""
    return pool.snapshot()


# ---------------------------------------------------------------------------------------------
# caps and limits


@pytest.mark.parametrize(
    ("device", "num_bytes", "error", "message"),
    [
        ("cuda", 5, ValueError, "cpu or cuda:N"),
        ("gpu0", 5, ValueError, "cpu or cuda:N"),
        ("cuda:1000", 5, ValueError, "cpu or cuda:N"),
        (0, 5, TypeError, "device must be a str"),
        ("cpu", 1.5, TypeError, "must be an int, not float"),
        ("cpu", 1e39, TypeError, "must be an int, not float"),
        ("cpu", 2**128, ValueError, "at most"),
        ("cpu", True, TypeError, "must be an int, not bool"),
        ("cpu", -1, ValueError, "a number of bytes"),
        ("cpu", "1GiB", TypeError, "must be an int, not str"),
    ],
)
def test_a_cap_the_readers_would_refuse_is_refused(
    pool: Pool, device: Any, num_bytes: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        pool.set_cap(device, num_bytes)
    assert readable(pool).caps == {}


def test_the_largest_cap_the_readers_take_is_taken(pool: Pool) -> None:
    pool.set_cap("cuda:999", MAX_INT - 1)
    assert readable(pool).caps == {"cuda:999": MAX_INT - 1}


@pytest.mark.parametrize(
    ("limits", "error", "message"),
    [
        ({"min_blocks": 1.5}, TypeError, "min_blocks must be an int, not float"),
        ({"max_blocks": 8.0}, TypeError, "max_blocks must be an int, not float"),
        ({"max_blocks": True}, TypeError, "max_blocks must be an int, not bool"),
        ({"min_blocks": False}, TypeError, "min_blocks must be an int, not bool"),
        ({"max_blocks": 2**200}, ValueError, "max_blocks must be at most"),
        ({"min_blocks": NAN}, TypeError, "min_blocks must be an int, not float"),
    ],
)
def test_limits_that_are_not_ints_are_refused(
    pool: Pool, limits: dict[str, Any], error: type[Exception], message: str
) -> None:
    args = {"min_blocks": None, "max_blocks": None, **limits}
    with pytest.raises(error, match=message):
        pool.set_limits("a", **args)
    engine = readable(pool).engines["a"]
    assert (engine.min_blocks, engine.max_blocks) == (0, 8)


def test_the_rules_check_what_they_write_too(pool: Pool) -> None:
    """`rules` is the one author of the ledger: called directly, it checks as `Pool` does."""
    with pytest.raises(TypeError), pool.transaction() as ledger:
        rules.set_limits(ledger, "a", 0.0, 1.5, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError), pool.transaction() as ledger:
        rules.set_cap(ledger, "cuda", 5, 0.0)
    assert readable(pool).caps == {}


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda ledger: ledger.caps.update(cpu=1.5), "caps"),
        (lambda ledger: ledger.caps.update(cuda=5), "a cap's device"),
        (lambda ledger: setattr(ledger.engines["a"], "min_blocks", True), "min_blocks"),
        (lambda ledger: setattr(ledger.engines["a"], "heartbeat", NAN), "heartbeat"),
        (lambda ledger: setattr(ledger.engines["a"], "capacity_blocks", 2), "capacity"),
        (lambda ledger: setattr(ledger.engines["a"], "lendable_blocks", -1), "lendable_blocks"),
        (lambda ledger: setattr(ledger, "next_loan_id", 2**130), "next_loan_id"),
    ],
)
def test_the_store_never_writes_what_its_readers_refuse(
    pool: Pool, damage: Any, message: str
) -> None:
    """The general guard: whatever gets past the checks at the door (a rule, a future field),
    the write decodes what it would write first and refuses it, the file as it was."""
    before = Path(pool.path).read_bytes()
    with pytest.raises(ValueError, match=f"not written.*{message}"), pool.transaction() as ledger:
        damage(ledger)
    assert Path(pool.path).read_bytes() == before
    assert set(pool.snapshot().engines) == {"a"}


# ---------------------------------------------------------------------------------------------
# a member's arguments


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"answer_timeout_s": NAN}, ValueError, "answer_timeout_s must be a finite"),
        ({"answer_timeout_s": 1e13}, ValueError, "answer_timeout_s must be a finite"),
        ({"answer_timeout_s": INF}, ValueError, "answer_timeout_s must be a finite"),
        ({"answer_timeout_s": 0}, ValueError, "answer_timeout_s must be a finite"),
        ({"answer_timeout_s": None}, TypeError, "answer_timeout_s must be a number"),
        ({"answer_timeout_s": "1"}, TypeError, "answer_timeout_s must be a number"),
        ({"take_timeout_s": -1.0}, ValueError, "take_timeout_s must be a finite"),
        ({"take_timeout_s": True}, TypeError, "take_timeout_s must be a number"),
        ({"max_blocks": 8.0}, TypeError, "max_blocks must be an int"),
        ({"min_blocks": True}, TypeError, "min_blocks must be an int"),
        ({"name": 5}, TypeError, "engine name must be a str"),
        ({"name": "a/b"}, ValueError, "engine name 'a/b'"),
        ({"name": "x" * 65}, ValueError, "engine name"),
        ({"free_tail_blocks": 3}, TypeError, "free_tail_blocks must be callable"),
        ({"on_resize": 3}, TypeError, "on_resize must be callable"),
        ({"pool": 3}, TypeError, "pool must be a Pool"),
        ({"pool": "a b"}, ValueError, "pool name"),
    ],
)
def test_a_members_arguments_are_checked_before_it_joins(
    pool: Pool, kw: dict[str, Any], error: type[Exception], message: str
) -> None:
    args: dict[str, Any] = {
        "pool": pool,
        "name": "m",
        "min_blocks": 0,
        "max_blocks": 8,
        "free_tail_blocks": lambda: 0,
        **kw,
    }
    with cache() as c, pytest.raises(error, match=message):
        PoolMember(args.pop("pool"), args.pop("name"), c, **args).join()
    assert set(readable(pool).engines) == {"a"}


def test_a_member_whose_timeouts_were_nan_left_the_ledger_unreadable(pool: Pool) -> None:
    """The issue's case end to end: a member's request posts a deadline of now plus its
    answer timeout; with NaN (or 1e13) every reader refused the ledger."""
    used = {"m": 0, "n": 0}
    with cache() as cm, cache() as cn:
        m = member(pool, "m", cm, used)
        m.join()
        m.grow(8)
        m.serve()
        for bad in (NAN, 1e13):
            with pytest.raises(ValueError, match="answer_timeout_s"):
                member(pool, "n", cn, used, answer_timeout_s=bad)
        readable(pool)
        m.leave()


# ---------------------------------------------------------------------------------------------
# waits: grow, settle, leave


@pytest.mark.parametrize(
    ("timeout", "error"),
    [
        (NAN, ValueError),
        (INF, ValueError),
        (-1.0, ValueError),
        (1e13, ValueError),
        (None, TypeError),
        ("5", TypeError),
    ],
)
@pytest.mark.parametrize("call", ["grow", "settle", "leave"])
def test_a_waits_timeout_is_a_finite_number_of_seconds(
    pool: Pool, call: str, timeout: Any, error: type[Exception]
) -> None:
    """`grow(timeout_s=nan)` looped for ever when no memory came (NaN is never past a
    deadline), and None was a bare TypeError: each is refused, naming the argument, before
    anything is asked. Run on a thread with a bound, so that a loop for ever fails the test."""
    pool.set_cap("cpu", 0)  # no memory will come
    used = {"m": 0}
    outcome: list[BaseException | None] = []
    with cache() as c:
        m = member(pool, "m", c, used)
        m.join()

        def run() -> None:
            try:
                if call == "grow":
                    m.grow(8, timeout_s=timeout)
                else:
                    getattr(m, call)(timeout_s=timeout)
                outcome.append(None)
            except BaseException as e:  # reported to the test's thread
                outcome.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive(), f"{call}(timeout_s={timeout!r}) still waits"
        assert isinstance(outcome[0], error), outcome
        assert "timeout_s" in str(outcome[0])
        assert "m" in readable(pool).engines
        m.leave()


def test_a_wait_of_zero_seconds_is_one_round(pool: Pool) -> None:
    pool.set_cap("cpu", 0)
    used = {"m": 0}
    with cache() as c:
        m = member(pool, "m", c, used)
        m.join()
        assert m.grow(8, timeout_s=0) == 0
        m.settle(timeout_s=0)
        m.leave(timeout_s=0)


# ---------------------------------------------------------------------------------------------
# the command line: one line on stderr, exit status 2


def run_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    try:
        code = main(["pool", "--dir", str(tmp_path), *args])
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err


NOT_A_LIMIT = "must be a number of blocks (an integer >= 0) or a size like 2GiB"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--pool", "bad/name", "status"), "pool name 'bad/name'"),
        (("--pool", "", "reset"), "pool name ''"),
        (("--pool", "x" * 65, "watch", "--count", "1"), "pool name"),
        (("--group", "no-such-group-here", "status"), "no group named"),
        (("--group", "-5", "status"), "no group named"),
        (("status", "--bogus"), "unrecognized arguments: --bogus"),
        (("nothing",), "invalid choice: 'nothing'"),
        (("limit", "a b", "--max", "3"), "engine name 'a b'"),
        (("limit", "a", "--min", "x"), f"argument --min: {NOT_A_LIMIT}"),
        (("limit", "a", "--max", "-1"), f"argument --max: {NOT_A_LIMIT}"),
        (("limit", "a", "--max", "1.5"), f"argument --max: {NOT_A_LIMIT}"),
        (("limit", "a", "--max", "9" * 50), f"argument --max: {NOT_A_LIMIT}"),
        (("cap", "cpu", "1e39"), "a size like 40GiB"),
        (("cap", "cpu", "9" * 40), "more bytes than the pool counts"),
        (("cap", "cpu", "1" + "0" * 36 + "TiB"), "more bytes than the pool counts"),
        (("cap", "cpu", "lots"), "a size like 40GiB"),
        (("cap", "cuda", "1"), "cpu or cuda:N"),
        (("cap", "cuda:1000", "1"), "cpu or cuda:N"),
        (("share", "cpu", "lots"), "a size like 40GiB"),
        (("limit", "a", "--min", "2.5"), "or a size like 2GiB, got '2.5'"),
        (("limit", "a", "--min", "1e3GiB"), "or a size like 2GiB, got '1e3GiB'"),
        (("limit", "a", "--max", "9" * 40 + "TiB"), "more bytes than the pool counts"),
        (("watch", "--interval", "inf", "--count", "2"), "argument --interval"),
        (("watch", "--interval", "nan", "--count", "2"), "argument --interval"),
        (("watch", "--interval", "0", "--count", "2"), "argument --interval"),
        (("watch", "--interval", "-1", "--count", "2"), "argument --interval"),
        (("watch", "--interval", "1e300", "--count", "2"), "argument --interval"),
        (("watch", "--count", "-1"), "argument --count"),
        (("reset", "now"), "unrecognized arguments: now"),
    ],
)
def test_every_bad_flag_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    code, err = run_cli(tmp_path, capsys, *args)
    assert code == 2, err
    assert err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err


def test_a_directory_that_cannot_be_used_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "file"
    file.write_text("")
    code = main(["pool", "--dir", str(file), "status"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "is not a directory" in err, err


def test_sizes_are_exact_and_a_good_command_line_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(tmp_path, capsys, "cap", "cpu", "1.5GiB")[0] == 0
    assert readable(Pool("default", directory=tmp_path)).caps == {"cpu": 3 << 29}
    assert run_cli(tmp_path, capsys, "cap", "cpu", "0.1B")[0] == 0  # a tenth of a byte: 0
    assert run_cli(tmp_path, capsys, "watch", "--interval", "0.001", "--count", "2")[0] == 0


def test_the_command_line_as_a_process_prints_no_traceback(tmp_path: Path) -> None:
    for args in (["--pool", "bad/name", "status"], ["watch", "--interval", "inf", "--count", "2"]):
        done = subprocess.run(
            [sys.executable, "-m", "extensible_kv", "pool", "--dir", str(tmp_path), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
