"""`python -m extensible_kv pool status|limit|cap|watch|reset`: read and change a pool's ledger
while its engines run. Errors (a bad flag, a corrupt ledger, an unknown engine, a lock held too
long, another user's pool) are one line on stderr and exit status 2.

`status` counts in bytes across engines (what each holds, lends, borrows, its limits, the
loans), with each engine's own blocks beside them; `limit` takes blocks (a bare number) or
bytes (a size with a unit: `--min 2GiB`); `cap DEVICE SIZE` caps the bytes the pool may hold
on a device (`share`, its old name, is deprecated and says so)."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from extensible_kv import _args
from extensible_kv.pool import rules
from extensible_kv.pool.ledger import Ledger, LoanState, check_device, check_name
from extensible_kv.pool.policy import unresponsive
from extensible_kv.pool.store import GROUP_ENV, Pool, PoolLockTimeout

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds `pool` and its subcommands to the subcommands of `python -m extensible_kv`."""
    pool = commands.add_parser(
        "pool",
        help="show and change a node-local memory pool: engines, limits, loans, caps",
        description="Shows and changes a node-local memory pool's ledger (extensible_kv.pool) "
        "while its engines run.",
    )
    pool.add_argument(
        "--pool",
        default="default",
        type=_checked(check_name, "a pool name"),
        help="the pool's name (default: default)",
    )
    pool.add_argument(
        "--dir", help="the ledger's directory (default: $EXTENSIBLE_KV_POOL_DIR, else /dev/shm)"
    )
    pool.add_argument(
        "--group",
        help=f"the group of a pool shared by several users (default: ${GROUP_ENV}, else none: "
        "the pool is this user's alone)",
    )
    pool.set_defaults(run=run)
    actions = pool.add_subparsers(dest="action", required=True)
    status = actions.add_parser("status", help="each engine's holdings, limits and loans")
    status.add_argument(
        "--json", action="store_true", dest="as_json", help="the whole ledger, as JSON"
    )
    status.set_defaults(pool_run=_status)
    limit = actions.add_parser(
        "limit",
        help="change an engine's minimum and maximum while it runs, in its blocks or in bytes",
    )
    limit.add_argument("engine", type=_checked(check_name, "an engine name"))
    limit.add_argument(
        "--min", type=parse_limit, dest="low", help="its blocks (N) or bytes (2GiB) never lent"
    )
    limit.add_argument(
        "--max", type=parse_limit, dest="high", help="its blocks (N) or bytes (10GiB) at most"
    )
    limit.set_defaults(pool_run=_limit)
    cap = actions.add_parser("cap", help="cap the bytes the pool may hold on a device")
    cap.add_argument("device", type=_checked(check_device, "a device"), help="cpu or cuda:N")
    cap.add_argument("size", type=_size, help="bytes (units B, KiB, MiB, GiB, TiB) or none")
    cap.set_defaults(pool_run=_cap)
    share = actions.add_parser("share", help="deprecated: `pool cap` (the same command)")
    share.add_argument("device", type=_checked(check_device, "a device"), help="cpu or cuda:N")
    share.add_argument("size", type=_size, help="bytes (units B, KiB, MiB, GiB, TiB) or none")
    share.set_defaults(pool_run=_share)
    watch = actions.add_parser("watch", help="status, refreshed")
    watch.add_argument("--interval", type=_interval, default=1.0, help="seconds (default: 1)")
    watch.add_argument("--count", type=_blocks, help="refreshes, then exit (default: until ^C)")
    watch.set_defaults(pool_run=_watch)
    reset = actions.add_parser("reset", help="remove the ledger (a corrupt one too)")
    reset.set_defaults(pool_run=_reset)


def _checked(check: Callable[[str, str], str], what: str) -> Callable[[str], str]:
    """An argparse type that refuses what `check` refuses, with its reason."""

    def parse(text: str) -> str:
        try:
            return check(text, what)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse


def _blocks(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= rules.MAX_BLOCKS:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def parse_limit(text: str) -> tuple[str, int]:
    """A limit: the engine's blocks (a bare integer) or bytes (a size with a unit: 2GiB), as
    `("blocks", n)` or `("bytes", n)`; else an `argparse.ArgumentTypeError` saying what it
    must be. The command line's `--min`/`--max`, and the vLLM engine's
    `EXTENSIBLE_KV_POOL_MIN`/`_MAX`."""
    if re.fullmatch(r"\s*\d{1,40}\s*", text) and int(text) <= rules.MAX_BLOCKS:
        return ("blocks", int(text))
    if re.fullmatch(r"\s*\d{1,40}(\.\d{1,40})?\s*[a-zA-Z]+\s*", text):
        size = _size(text)
        if size is not None:
            return ("bytes", size)
    raise argparse.ArgumentTypeError(
        f"must be a number of blocks (an integer >= 0) or a size like 2GiB, got {text!r}"
    )


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    try:
        return _args.duration(value, "the interval")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds > 0 and <= {_args.MAX_SECONDS:g}, got {text!r}"
        ) from None


def _size(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    match = re.fullmatch(r"\s*(\d{1,40})(?:\.(\d{1,40}))?\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(3).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"a size like 40GiB, 512MiB or 1048576, got {text!r}")
    # In integers: a float would round a large size, and 1e39 is no size at all.
    whole, fraction = match.group(1), match.group(2) or ""
    unit = _UNITS[match.group(3).lower()]
    num_bytes: int = (int(whole + fraction) * unit) // 10 ** len(fraction)
    if num_bytes > rules.MAX_BLOCKS:
        raise argparse.ArgumentTypeError(f"{text!r} is more bytes than the pool counts")
    return num_bytes


def run(options: dict[str, Any]) -> int:
    """`python -m extensible_kv pool ...`: the exit status."""
    action = options.pop("action")
    command = options.pop("pool_run")
    try:
        pool = Pool(options.pop("pool"), directory=options.pop("dir"), group=options.pop("group"))
        return int(command(pool, **options))
    except (ValueError, TypeError, PoolLockTimeout, OSError) as error:
        print(f"pool {action}: {error}", file=sys.stderr)
        return 2


def _status(pool: Pool, as_json: bool) -> int:
    ledger = pool.snapshot()
    print(_as_json(ledger) if as_json else format_status(pool, ledger, pool.clock()))
    return 0


def _limit(
    pool: Pool, engine: str, low: tuple[str, int] | None, high: tuple[str, int] | None
) -> int:
    if low is None and high is None:
        raise ValueError("give --min, --max or both")
    limits = {f"min_{low[0]}": low[1]} if low else {}
    limits |= {f"max_{high[0]}": high[1]} if high else {}
    pool.set_limits(engine, **limits)
    e = pool.snapshot().engines[engine]
    print(
        f"{engine}: {e.min_blocks}..{e.max_blocks} blocks "
        f"({_bytes(e.min_bytes)}..{_bytes(e.max_bytes)})"
    )
    return 0


def _cap(pool: Pool, device: str, size: int | None) -> int:
    pool.set_cap(device, size)
    return 0


def _share(pool: Pool, device: str, size: int | None) -> int:
    print("pool share is deprecated: use pool cap (the same command)", file=sys.stderr)
    return _cap(pool, device, size)


def _watch(pool: Pool, interval: float, count: int | None) -> int:
    shown = 0
    clear = "\033[H\033[J" if sys.stdout.isatty() else ""
    try:
        while count is None or shown < count:
            if shown:
                time.sleep(interval)
            text = format_status(pool, pool.snapshot(), pool.clock())
            print(f"{clear}{text}", flush=True)
            shown += 1
    except KeyboardInterrupt:
        pass
    return 0


def _reset(pool: Pool) -> int:
    pool.reset()
    print(f"removed {pool.path}")
    return 0


def _as_json(ledger: Ledger) -> str:
    """The ledger as JSON, its loans without their handles."""
    body = ledger.to_json()
    del body["next_loan_id"], body["stale_after_s"]
    for engine, raw in zip(ledger.engines.values(), body["engines"], strict=True):
        raw["block_bytes"] = engine.block_bytes
    for raw in body["loans"]:
        del raw["loans"]
    return json.dumps(body, indent=1)


def _bytes(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def format_status(pool: Pool, ledger: Ledger, now: float) -> str:
    """The text `pool status` prints: bytes across engines, each engine's own blocks beside."""
    lines = [f"pool {pool.name} ({pool.path}), generation {ledger.generation}"]
    devices = sorted({e.device for e in ledger.engines.values()} | set(ledger.caps))
    for device in devices:
        cap = ledger.caps.get(device)
        said = "no cap (its free memory)" if cap is None else f"cap {_bytes(cap)}"
        lines.append(f"{device}: {said}, held {_bytes(rules.used_bytes(ledger, device))}")
    if ledger.engines:
        rows = [
            [
                "ENGINE",
                "PID",
                "DEVICE",
                "STATE",
                "HELD",
                "BLOCKS",
                "BLOCK",
                "MIN..MAX",
                "LENT",
                "BORROWED",
                "LENDABLE",
                "HEARTBEAT",
            ]
        ]
        for e in sorted(ledger.engines.values(), key=lambda e: e.name):
            state = "busy" if e.busy else "idle"
            if unresponsive(e, ledger, now):
                state = "stuck" if e.stuck else "stale"
            rows.append(
                [
                    e.name,
                    str(e.pid),
                    e.device,
                    state,
                    _bytes(e.physical_bytes),
                    str(e.committed_blocks),
                    _bytes(e.block_bytes),
                    f"{_bytes(e.min_bytes)}..{_bytes(e.max_bytes)} "
                    f"({e.min_blocks}..{e.max_blocks})",
                    _bytes(e.lent_bytes),
                    _bytes(e.borrowed_bytes),
                    f"{_bytes(e.lendable_bytes)} ({e.lendable_blocks})",
                    f"{max(now - e.heartbeat, 0):.1f} s ago",
                ]
            )
        lines += ["", *_table(rows)]
    else:
        lines += ["", "no engines"]
    if ledger.loans:
        rows = [["LOAN", "LENDER", "BORROWER", "STATE", "BYTES", "BLOCKS", "NOTE"]]
        for x in sorted(ledger.loans.values(), key=lambda x: x.loan_id):
            note = x.reason
            if x.state in (LoanState.ASKED, LoanState.OFFERED):
                note = f"due in {x.deadline - now:.2f} s"
            if x.recall:
                note = f"recalled; {note}" if note else "recalled"
            # The lender's blocks lent, and what they give the borrower in its own.
            blocks = f"{x.lent_blocks}->{x.blocks}" if x.lent_blocks else f"{x.blocks} asked"
            rows.append(
                [
                    str(x.loan_id),
                    x.lender or "(died)",
                    x.borrower or "(gone)",
                    x.state,
                    _bytes(x.num_bytes or x.asked_bytes),
                    blocks,
                    note,
                ]
            )
        lines += ["", *_table(rows)]
    problems = rules.check(ledger)
    if problems:
        lines += ["", "INCONSISTENT:", *(f"  {p}" for p in problems)]
    if ledger.events:
        lines += ["", "recent events:"]
        lines += [f"  {max(now - e.time, 0):7.1f} s ago  {e.text}" for e in ledger.events[-10:]]
    return "\n".join(lines)
