"""The node pool bench's figures (`bench_pool.py`): the ledger read as it changes
(`LedgerWatcher`), each request for memory from its events, percentiles, each engine's and the
setup's summary, the tokens compared, and the report (Markdown). No torch here."""

from __future__ import annotations

import math
import re
import statistics
import threading
import time
from collections import Counter
from typing import Any

from common import GIB, MIB
from pool_models import Request

SETUPS = ("pool", "static", "oracle", "driver", "kill")
# Opt-in setups (`--setups ... move`): `pool` with `pool_move=True`.
MORE_SETUPS = ("move",)
KINDS = {
    "pool": "pool",
    "driver": "pool",
    "move": "pool",
    "kill": "pool",
    "static": "static",
    "oracle": "oracle",
}
VIAS = {"pool": "loan", "driver": "driver", "move": "loan", "kill": "loan"}
LEDGER_POLL_S = 0.005
RECOVERY_S = 0.1  # the bound on a kill's recovery (issue 52)
# The ledger's events of a request for memory (`extensible_kv.pool.rules`' wording): the ask,
# and its answer: borrowed (a loan, the memory mapped by the borrower), released (through the
# driver: the donor gave it back, the needy engine commits it next), refused or expired.
LOAN_EVENT = re.compile(r"^loan (\d+): (.*)$")
ASKS = re.compile(r"^(\S+) asks (\S+) for (\d+) blocks")
ANSWERS = {
    "borrowed": re.compile(r"^\S+ borrowed (\d+) blocks from "),
    "released": re.compile(r"^\S+ released (\d+) blocks to the driver"),
    "refused": re.compile(r"^\S+ refuses"),
    "expired": re.compile(r"expired|is stuck"),
}


class LedgerWatcher:
    """Reads the pool's ledger file every `LEDGER_POLL_S` (no lock: a write is a rename) and
    keeps every event it has not seen, and each engine's name and pid."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.events: list[tuple[float, str]] = []
        self.seen: set[tuple[float, str]] = set()
        self.engines: dict[str, dict[str, int]] = {}
        self.latest: Any = None  # the ledger as last read
        self.reads = 0
        self.maybe_lost = 0
        self.running = True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        from extensible_kv.pool.ledger import MAX_EVENTS, LedgerCorruptError, decode

        try:
            with open(self.pool.path, "rb") as file:
                data = file.read()
            ledger = decode(data, self.pool.path)
        except (FileNotFoundError, LedgerCorruptError):
            return
        self.reads += 1
        self.latest = ledger
        events = [(e.time, e.text) for e in ledger.events]
        if events and self.seen and events[0] not in self.seen and len(events) >= MAX_EVENTS:
            self.maybe_lost += 1
        for event in events:
            if event not in self.seen:
                self.seen.add(event)
                self.events.append(event)
        for name, engine in ledger.engines.items():
            self.engines[name] = {"pid": engine.pid, "block_bytes": engine.block_bytes}

    def _loop(self) -> None:
        while self.running:
            self._read()
            time.sleep(LEDGER_POLL_S)

    def stop(self) -> None:
        self.running = False
        self.thread.join()
        self._read()


def loans_from_events(
    events: list[tuple[float, str]], block_bytes: dict[str, int], default_block: int, t0: float
) -> list[dict[str, Any]]:
    """Each request for memory from the ledger's events: who asked whom for how many blocks,
    when (`asked_s`, from `t0`), its answer and how long after the ask it was posted
    (`answered_ms`), and the bytes it moved (its blocks times the block of the engine they
    came from: `block_bytes`, the ledger's, else `default_block`). `latency_ms`, from the ask
    to the memory being the needy engine's, is `answered_ms` for a borrowed loan; through the
    driver the needy engine commits after the release, which no event records (`seen_ms`,
    set from the memory samples, stands in)."""
    by_loan: dict[int, list[tuple[float, str]]] = {}
    for t, text in sorted(events):
        match = LOAN_EVENT.match(text)
        if match:
            by_loan.setdefault(int(match.group(1)), []).append((t, match.group(2)))
    loans = []
    for loan_id, timeline in sorted(by_loan.items()):
        asked = next(((t, m) for t, x in timeline if (m := ASKS.match(x))), None)
        if asked is None:
            continue  # asked before the watcher's first read, or its event was lost
        t_ask, match = asked
        row: dict[str, Any] = {
            "loan_id": loan_id,
            "borrower": match.group(1),
            "lender": match.group(2),
            "asked_blocks": int(match.group(3)),
            "asked_s": t_ask - t0,
            "answer": None,
            "answered_ms": None,
            "blocks": 0,
            "bytes": 0,
            "latency_ms": None,
            "seen_ms": None,
            "timeline": [[round((t - t_ask) * 1e3, 3), x] for t, x in timeline],
        }
        for t, text in timeline:
            answer = next(((a, m) for a, r in ANSWERS.items() if (m := r.match(text))), None)
            if t < t_ask or answer is None:
                continue
            row["answer"], row["answered_ms"] = answer[0], (t - t_ask) * 1e3
            if answer[0] in ("borrowed", "released"):
                row["blocks"] = int(answer[1].group(1))
                row["bytes"] = row["blocks"] * block_bytes.get(row["lender"], default_block)
            if answer[0] == "borrowed":
                row["latency_ms"] = row["answered_ms"]
            break
        loans.append(row)
    return loans


def seen_in_memory(
    loans: list[dict[str, Any]], memory: dict[str, dict[str, Any]], t0: float
) -> None:
    """Sets each answered loan's `seen_ms`: from its ask to the first sample of the needy
    engine's memory (`memory`: by engine name, times from `t0`) that grew, at or after the
    answer; through the driver, also its `latency_ms`. An upper bound, by up to a sample."""
    for loan in loans:
        series = memory.get(loan["borrower"])
        if loan["answer"] not in ("borrowed", "released") or series is None:
            continue
        asked = loan["asked_s"]
        answered = asked + loan["answered_ms"] / 1e3
        times, values = series["t"], series["bytes"]
        grew = next(
            (t for i, t in enumerate(times) if i and t >= answered and values[i] > values[i - 1]),
            None,
        )
        if grew is None:
            continue
        loan["seen_ms"] = (grew - asked) * 1e3
        if loan["answer"] == "released":
            loan["latency_ms"] = loan["seen_ms"]


def percentiles(values: list[float]) -> dict[str, float | int]:
    ordered = sorted(values)
    if not ordered:
        return {"n": 0, "p50": math.nan, "p99": math.nan, "max": math.nan, "mean": math.nan}

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "n": len(ordered),
        "p50": at(0.50),
        "p99": at(0.99),
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
    }


def _growth(memory: dict[str, Any], t0: float) -> int:
    """The sum of the increases of an engine's memory after `t0`."""
    grown, values, times = 0, memory["bytes"], memory["t"]
    for i in range(1, len(values)):
        if times[i] >= t0 and values[i] > values[i - 1]:
            grown += values[i] - values[i - 1]
    return grown


def engine_summary(
    index: int,
    model: str,
    rows: dict[str, dict[str, Any]],
    reply: dict[str, Any],
    mine: list[Request],
    t0: float,
    unit: int,
    shift: float = 0.0,
) -> dict[str, Any]:
    """One engine's figures in one setup (see the module's docstring). `rows`: its requests'
    first token and finish, as streamed; `shift`: how much earlier its requests were sent than
    the trace says (an oracle engine alone in turn)."""
    ttft, e2e, tokens, finishes = [], [], 0, []
    completed = 0
    errors = []
    for request in mine:
        row = rows.get(request.rid, {})
        arrival = t0 + request.arrival_s - shift
        if row.get("error"):
            errors.append(row["error"])
        if row.get("finish") is None or row.get("error"):
            continue
        completed += 1
        tokens += row["n_tokens"]
        finishes.append(row["finish"])
        e2e.append((row["finish"] - arrival) * 1e3)
        if row.get("first") is not None:
            ttft.append((row["first"] - arrival) * 1e3)
    memory = reply.get("memory") or {"t": [], "bytes": []}
    trace = [(t, b) for t, b in zip(memory["t"], memory["bytes"], strict=True) if t >= t0]
    levels = [b for _, b in trace] or memory["bytes"][-1:] or [0]
    busy = (max(finishes) - (t0 + mine[0].arrival_s - shift)) if finishes and mine else 0.0
    asks = [{**ask, "since": round(ask["since"] - t0, 4)} for ask in reply.get("asks", []) or []]
    return {
        "engine": index,
        "model": model,
        "requests": len(mine),
        "completed": completed,
        "errors": errors[:5],
        "ttft_ms": percentiles(ttft),
        "e2e_ms": percentiles(e2e),
        "tokens": tokens,
        "tokens_per_s": tokens / busy if busy > 0 else 0.0,
        "busy_s": busy,
        "kv_peak": max(levels) / unit,
        "kv_mean": _time_mean(memory, t0) / unit if memory["t"] else 0.0,
        "grown_bytes": _growth(memory, t0) if memory["t"] else 0,
        "memory": {
            "t": [round(t - t0, 4) for t in memory["t"]],
            "bytes": memory["bytes"],
            "samples": memory.get("samples", 0),
        },
        "asks": asks,
        "ask_wait_ms": percentiles([a["wait_ms"] for a in asks]),
        "asks_met": sum(a["met"] for a in asks),
        "startup": reply.get("startup"),
        "memfds_after": reply.get("memfds_after"),
        "torch_after": reply.get("torch_after"),
        "log": [[round(t - t0, 4), name, text] for t, name, text in reply.get("log", [])],
        "log_dropped": reply.get("log_dropped", 0),
        "error": reply.get("error"),
    }


def _total(rows: list[dict[str, Any]], per_request: dict[str, Any]) -> dict[str, Any]:
    """The setup's figures over every engine (`per_request`: each request's arrival, first
    token and finish in the engines' clock, already shifted)."""
    ttft, e2e, finishes, arrivals = [], [], [], []
    for row in per_request.values():
        arrivals.append(row["arrival"])
        if row.get("finish") is None or row.get("error"):
            continue
        finishes.append(row["finish"])
        e2e.append((row["finish"] - row["arrival"]) * 1e3)
        if row.get("first") is not None:
            ttft.append((row["first"] - row["arrival"]) * 1e3)
    tokens = sum(r["tokens"] for r in rows)
    busy = sum(r["busy_s"] for r in rows) if per_request and _in_turn(rows) else 0.0
    if not busy and finishes:
        busy = max(finishes) - min(arrivals)
    asks = [a for r in rows for a in r["asks"]]
    return {
        "requests": sum(r["requests"] for r in rows),
        "completed": sum(r["completed"] for r in rows),
        "ttft_ms": percentiles(ttft),
        "e2e_ms": percentiles(e2e),
        "tokens": tokens,
        "tokens_per_s": tokens / busy if busy > 0 else 0.0,
        "ask_wait_ms": percentiles([a["wait_ms"] for a in asks]),
        "asks": len(asks),
        "asks_met": sum(a["met"] for a in asks),
    }


def _in_turn(rows: list[dict[str, Any]]) -> bool:
    return any(r.get("in_turn") for r in rows)


def peak_of_sum(series: list[dict[str, Any]]) -> int:
    """The most the engines held together: the peak of the sum of their step series."""
    changes = sorted(
        (t, i, value)
        for i, memory in enumerate(series)
        for t, value in zip(memory["t"], memory["bytes"], strict=True)
    )
    levels = [0] * len(series)
    peak = 0
    for _, i, value in changes:
        levels[i] = value
        peak = max(peak, sum(levels))
    return peak


def _time_mean(memory: dict[str, Any], t0: float) -> float:
    """The time-weighted mean of a step series from `t0` to its last sample."""
    times, values = memory["t"], memory["bytes"]
    if not times or times[-1] <= t0:
        return float(values[-1]) if values else 0.0
    area, level, last = 0.0, None, t0
    for t, value in zip(times, values, strict=True):
        if t <= t0:
            level = value
            continue
        if level is not None:
            area += level * (t - last)
        level, last = value, t
    return area / (times[-1] - t0)


def compare_tokens(results: dict[str, Any], alone: dict[str, list[int]] | None) -> dict[str, Any]:
    """Each setup's tokens against the alone run's, and the setups against each other."""
    out: dict[str, Any] = {"alone": {}, "cross": {}}
    setups = {k: v for k, v in results.items() if "tokens" in v}
    for name, res in setups.items():
        if alone is None:
            break
        kept = res["kept_tokens"]
        compared = [rid for rid in alone if rid in kept]
        differ = [rid for rid in compared if kept[rid] != alone[rid]]
        out["alone"][name] = {
            "sample": len(alone),
            "compared": len(compared),
            "identical": len(compared) - len(differ),
            "differ": differ[:50],
            "first_difference": {
                rid: _first_difference(kept[rid], alone[rid]) for rid in differ[:50]
            },
        }
    names = list(setups)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ta, tb = setups[a]["tokens"], setups[b]["tokens"]
            both = sorted(set(ta) & set(tb))
            differ = [rid for rid in both if ta[rid] != tb[rid]]
            out["cross"][f"{a} vs {b}"] = {
                "compared": len(both),
                "identical": len(both) - len(differ),
                "differ": differ[:20],
            }
    return out


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _ms(p: dict[str, Any], key: str) -> str:
    value = p.get(key)
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _last_line(error: str | None) -> str:
    lines = [line for line in (error or "").splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if not a or not b or not a["ttft_ms"]["n"] or not b["ttft_ms"]["n"]:
        return None
    return float(a["ttft_ms"]["p99"] / b["ttft_ms"]["p99"])


def report(results: dict[str, Any]) -> str:
    settings, setups = results["settings"], results["setups"]
    unit, per = settings["unit_name"], GIB if settings["unit_name"] == "GiB" else MIB
    env = results["environment"]
    lines = [
        f"### {len(settings['models'])} engines of different models, bursty trace "
        f"({env.get('device', settings['device'])}, {settings['dtype']})",
        "",
        f"Models ({settings['models_note']}): "
        + "; ".join(f"{i}: {m}" for i, m in enumerate(env.get("shapes", settings["models"]))),
    ]
    for model, why in settings.get("left_out", {}).items():
        lines.append(f"Left out: {model}: {why}")
    lines += [
        "",
        f"KV memory in all: {settings['total_kv']:.2f} {unit} (static: "
        f"{settings['static_kv']:.2f} each; pool: from {settings['min_gib']} {unit} an engine, "
        f"cap {settings['share_kv']:.2f}; oracle: {settings['total_kv']:.2f} each, "
        f"{settings['oracle_mode']}"
        + (f": {settings['oracle_why']}" if settings.get("oracle_why") else "")
        + f"); {settings['requests']} requests, bursts of {settings['burst_range']} in "
        f"{settings['burst_s']} s every {settings['period_s']} s, {settings['new_tokens']} "
        "tokens each",
        "",
        f"| setup | engine | completed | TTFT p50 (ms) | TTFT p99 (ms) | e2e p50 (ms) | "
        f"e2e p99 (ms) | tokens/s | KV mean ({unit}) | KV peak ({unit}) | asks (met) | "
        "ask wait p50 / p99 (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, res in setups.items():
        if "engines" not in res:
            why = res.get("skipped") or f"failed: {_last_line(res.get('error'))}"
            lines.append(f"| {name} | {why} | | | | | | | | | | |")
            continue
        total = res["total"]
        for row in [*res["engines"], {**total, "engine": "all"}]:
            mean = row.get("kv_mean", sum(e["kv_mean"] for e in res["engines"]))
            peak = row.get("kv_peak")
            if peak is None:
                peak = (total["kv_total_peak_bytes"] or 0) / per
            who = row["engine"] if row["engine"] == "all" else f"{row['engine']} {row['model']}"
            asks = row["asks"] if isinstance(row["asks"], int) else len(row["asks"])
            wait = row["ask_wait_ms"]
            lines.append(
                f"| {name} | {who} | {row['completed']}/{row['requests']} | "
                f"{_ms(row['ttft_ms'], 'p50')} | {_ms(row['ttft_ms'], 'p99')} | "
                f"{_ms(row['e2e_ms'], 'p50')} | {_ms(row['e2e_ms'], 'p99')} | "
                f"{row['tokens_per_s']:.0f} | {mean:.2f} | {peak:.2f} | "
                f"{asks} ({row['asks_met']}) | {_ms(wait, 'p50')} / {_ms(wait, 'p99')} |"
            )
    lines += [
        "",
        f"| setup | memory moved in ({unit}) | asked | borrowed / released / refused | "
        f"across models | moved by the pool ({unit}) | ask to the needy engine p50 / p99 / max "
        "(ms) | seen in its memory p50 / p99 (ms) | ledger problems | left in ledger | "
        "agreement (checks, mismatches) | memfds after |",
        "|---|---:|---:|---|---:|---:|---|---|---:|---|---|---|",
    ]
    for name, res in setups.items():
        if "engines" not in res or res["kind"] != "pool":
            continue
        lat, seen, ledger = res["loan_latency_ms"], res["loan_seen_ms"], res.get("ledger")
        answers = Counter(loan["answer"] for loan in res["loans"])
        problems = len(res.get("ledger_problems_before_stop", [])) if ledger else "-"
        left = (
            f"{len(ledger['engines_left'])} engines, {ledger['loans_left']} loans"
            if ledger
            else "-"
        )
        checks = res.get("checks", [])
        bad = sum(bool(c["mismatch"] or c["ledger_problems"]) for c in checks)
        lines.append(
            f"| {name} | {res['grown_bytes'] / per:.3f} | {len(res['loans'])} | "
            f"{answers['borrowed']} / {answers['released']} / {answers['refused']} | "
            f"{res['cross_model_loans']} | {res['pool_moved_bytes'] / per:.3f} | "
            f"{_ms(lat, 'p50')} / {_ms(lat, 'p99')} / {_ms(lat, 'max')} | "
            f"{_ms(seen, 'p50')} / {_ms(seen, 'p99')} | {problems} | {left} | "
            f"{len(checks)}, {bad} | {[e['memfds_after'] for e in res['engines']]} |"
        )
    device_rows = [
        (name, c)
        for name, res in setups.items()
        for c in res.get("checks", [])
        if "device_minus_pool_bytes" in c
    ]
    if device_rows:
        worst = max(device_rows, key=lambda nc: abs(nc[1]["device_minus_pool_bytes"]))
        lines.append(
            f"\nDevice memory (mem_get_info's used, less the processes' contexts and torch's "
            f"allocators) against the pool's holdings, {len(device_rows)} checks: largest "
            f"difference "
            f"{worst[1]['device_minus_pool_bytes'] / MIB:+.1f} MiB ({worst[0]}, "
            f"{worst[1]['label']})"
        )
    kill = setups.get("kill", {})
    if kill.get("kills"):
        lines += [
            "",
            "| kill | engine | role | at the moment | at (s) | loans | recovered (ms) | ledger "
            "problems | requests lost | checks before / after | back in (s) |",
            "|---:|---|---|---|---:|---:|---:|---:|---:|---|---:|",
        ]
        for k in kill["kills"]:
            flags = [
                "ok" if not (c["mismatch"] or c["ledger_problems"]) else "MISMATCH"
                for c in (k["before"], k["after"])
            ]
            lines.append(
                f"| {k['kill']} | {k['engine']} {settings['models'][k['engine']]} | {k['role']} | "
                f"{'yes' if k['while'] else 'no'} | {k['at_s']:.2f} | {k['loans_at_kill']} | "
                f"{k['recovered_ms']:.1f} | {len(k['ledger_problems'])} | {k['lost']} | "
                f"{' / '.join(flags)} | {k.get('restart_s', math.nan):.1f} |"
            )
        bound = RECOVERY_S * 1e3
        within = all(k["recovered"] and k["recovered_ms"] <= bound for k in kill["kills"])
        lines.append(
            f"kill: the survivors completed {kill.get('survivors_completed')}/"
            f"{kill.get('survivors_requests')} requests; every recovery within "
            f"{bound:.0f} ms: {within}"
        )
    lines.append("")
    identical = results.get("identical", {})
    for name, row in identical.get("alone", {}).items():
        lines.append(
            f"tokens identical to the same requests run alone, {name}: {row['identical']}/"
            f"{row['compared']} (of {row['sample']})"
        )
    scores = (results.get("alone") or {}).get("scores")
    if scores:
        lines += [
            "",
            "Each sampled request's tokens scored by its model (one forward over prompt and "
            "tokens, no KV cache): where each token ranks among the logits for its prefix "
            "(`control`: the reference's tokens after another request's prompt)",
            "",
            "| tokens of | tokens | argmax | in the top 5 | largest gap (logits) | worst rank |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, row in scores.items():
            if not row["tokens"]:
                continue
            lines.append(
                f"| {name} | {row['tokens']} | {row['argmax']:.1%} | {row['top5']:.1%} | "
                f"{row['max_gap']:.3f} | {row['max_rank']} |"
            )
    static = setups.get("static", {}).get("total")
    oracle = setups.get("oracle", {}).get("total")
    for name in VIAS:
        other = setups.get(name, {}).get("total")
        ratio = _ratio(static, other)
        if ratio is not None:
            lines.append(
                f"TTFT p99 static / {name}: {ratio:.2f} (completed {static['completed']} vs "  # type: ignore[index]
                f"{other['completed']})"  # type: ignore[index]
            )
        ratio = _ratio(other, oracle)
        if ratio is not None and name != "kill":
            lines.append(f"TTFT p99 {name} / oracle: {ratio:.2f}")
    for name, res in setups.items():
        if res.get("error"):
            lines.append(f"{name} failed: {_last_line(res['error'])}")
    return "\n".join(lines)
