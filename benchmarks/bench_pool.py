"""Engines of different models on one device, each bursting in turn: the node pool against a
static split of the same KV memory, the pool through the driver, and an oracle that gives every
engine all of the memory (issues 37 and 52).

    python3 benchmarks/bench_pool.py --out DIR [--device cuda:0] [--setups pool static ...]

**The engines** (`pool_engines.py`, `pool_models.py`): one process each, each a transformers
continuous-batching manager (CUDA graphs on a GPU) over a model of its own, built from its
published shape with random weights: on an H200 (120 GiB or more) seven, `pool_models.H200_SET`
(Llama-3-8B, Qwen3-4B, Llama-3.2-1B, Qwen2.5-0.5B, a sliding-window model with Gemma-3-1B's
attention, Qwen3-0.6B, SmolLM2-360M), on an H100 the first five (`H100_SET`); a model whose
weights the card cannot hold beside the engines' overhead and the setups' KV is left out,
largest first, and the report says which and why. `--models` names them; `--small` runs small
float32 models instead (`--dtype float32 --small`: the tokens' identity run on a GPU). On the
host backend (`--device cpu`) three tiny float32 models of different block bytes, with sizes in
MiB where the GPU's are GiB: a smoke run of seconds.

**The trace** (seeded, `--seed`; `pool_models.make_trace`): `--rounds` rounds in which each
engine bursts in turn, one burst every `--period-s`, each burst's size drawn from
`--burst-requests` (one value, or LOW HIGH), arrivals uniform within `--burst-s`, prompts
log-uniform in `--min-prompt`..`--max-prompt`, `--new-tokens` greedy tokens each (no EOS).
Outside its bursts an engine gets a Poisson trickle of `--trickle-per-s` requests a second. The
same requests at the same times in every setup. The driver sends each engine its requests at
their arrival times over its pipe; an engine adds each to its running manager on receipt.

**The setups**, each a fresh manager per engine (reserved, warmed up, graphs captured), sized
in bytes (each model's block differs): `--kv-gib` of KV in all (MiB on the host; `auto`: what
the device has free once the models are loaded, less `--headroom-gib` an engine):
- `pool`: `extensible_kv.transformers.enable(pool=..., pool_via="loan")`; each engine starts at
  `--min-gib` and may grow to the total less the others' minimums; the pool's cap is the total.
- `static`: each engine an equal share of the bytes (`enable(budget_bytes=...)`), no pool.
- `driver`: as `pool`, `pool_via="driver"` (a donor releases to the driver, kvcached's way).
- `oracle`: the bound no pool can beat: every engine at once, each given all of the KV memory,
  no pool: the same compute contention, no memory contention. Run together where the device
  holds the total once per engine (`--oracle auto`, or `together`); where it cannot, each
  engine alone in turn with all of it, serving its own requests at their times (`in-turn`),
  and the report says so.
- `kill` (issue 52 item 5): `pool`, while a seeded schedule (`--kills`) kills engines with
  SIGKILL, alternately a donor mid-loan (an engine whose memory the bursting engine holds) and
  a borrower mid-burst, and starts each again (its model loaded anew, the setup started again,
  the requests that arrived meanwhile sent once it is ready). Per kill: the ledger recovered
  (the dead engine's entry gone, by a `Pool.snapshot` every millisecond) and consistent, in
  ms; the requests the kill took; and the agreement checks below, before the kill, after the
  recovery and at the end. Every request of an engine never killed must complete.
- `move` (opt-in): `pool` with `pool_move=True`.
A setup that fails to start is reported with its error, and the run exits 1. `--budget-s`
skips the setups left once the next would end past it (the report says so).

**What each number measures** (all times `time.monotonic()`, one clock for every process):
- TTFT: from a request's arrival in the trace to its first streamed token at the engine.
  End-to-end: arrival to the finished result. p50 / p99 over the completed requests (nearest
  rank); requests with no result are counted (`completed` of `requests`).
- tokens/s: tokens of completed requests over the engine's busy window (first arrival to last
  finish); in all, over the setup's.
- KV memory: each engine's `physical_bytes`, sampled every 10 ms (kept where it changed);
  mean over time from the trace's start, and peak. `plot_pool.py` draws it, a line per model.
- Asks (`PoolMember.asks`, issue 52 item 2): each ask of a pool engine, with its wait from the
  first waiting request to the last of its memory mapped; per engine p50 / p99 and how many
  were met. Requests for memory from the ledger's events as before (ask to borrow, or to the
  first sample that grew after a release to the driver).
- Agreement (pool setups, at the start, the end and around every kill): the ledger's entry
  of each engine says the `physical_bytes` its process reports, and on the host the memory
  its `/proc/<pid>/maps` shows (a mismatch must last 20 reads 10 ms apart: a move is posted
  just after it is made); on a GPU the device's used memory (`torch.cuda.mem_get_info`), less
  the processes' contexts (measured before the setup starts, with no KV) and what torch's
  allocators reserve, against the pool's holdings (`rules.used_bytes`). After the setup:
  nothing left in the ledger, no memfd.
- Tokens: each engine runs a seeded sample of its requests (`--check-requests` each; 0: every
  request) one at a time on transformers' own cache; each setup's tokens are compared with
  them (in float32: identical, every request; in bf16 the report says how many agree, and the
  model's own score of each token: its rank among the logits for its prefix).

Markdown on stdout, DIR/bench_pool.json with everything (written after each setup).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common import GIB, MIB, log
from pool_engines import Engines
from pool_figures import (  # noqa: F401 (the smoke tests read them here)
    KINDS,
    LEDGER_POLL_S,
    MORE_SETUPS,
    SETUPS,
    VIAS,
    LedgerWatcher,
    _growth,
    _time_mean,
    compare_tokens,
    engine_summary,
    loans_from_events,
    peak_of_sum,
    percentiles,
    report,
    seen_in_memory,
)
from pool_figures import _total as _total
from pool_models import (
    Burst,
    Request,
    burst_range,
    catalog,
    pick_models,
)
from pool_models import check_sample as _check_sample
from pool_models import make_trace as _make_trace


def make_trace(
    args: argparse.Namespace, vocab: int | list[int]
) -> tuple[list[Burst], list[Request]]:
    """`pool_models.make_trace`, with as many engines as `vocab` lists (three for one)."""
    return _make_trace(args, vocab)


def check_sample(
    requests: list[Request], per_engine: int, seed: int, engines: int = 3
) -> list[Request]:
    return _check_sample(requests, per_engine, seed, engines)


def engine_name(index: int) -> str:
    return f"engine{index}"


# ---------------------------------------------------------------------------------------------
# a setup


CHECK_TRIES = 20


class Checks:
    """The agreement checks of a pool setup: at each checkpoint, the ledger's entry of every
    live engine against what its process reports (its cache's `physical_bytes`; on the host
    the memory `/proc/<pid>/maps` shows), and on a GPU the device's used memory past the
    setup's start (less what torch's allocators grew by) against the pool's holdings."""

    def __init__(self, engines: Engines, pool: Any, device: str, gpu: bool) -> None:
        self.engines, self.pool, self.device, self.gpu = engines, pool, device, gpu
        self.base: dict[int, dict[str, Any]] = {}
        self.rows: list[dict[str, Any]] = []
        self.contexts: int | None = None

    def probe(self, indices: list[int]) -> dict[int, dict[str, Any]]:
        sent = [i for i in indices if self.engines.send(i, "probe")]
        return {i: p for i, (_, p) in self.engines.wait(("probe",), sent, 60).items()}

    def baseline(self, indices: list[int]) -> None:
        """Before any engine starts the setup: what the device holds beside torch's
        allocators, the processes' contexts (no KV yet)."""
        self.base.update(self.probe(indices))
        if self.gpu and len(indices) == len(self.engines):
            probes = [self.base[i] for i in indices]
            used = probes[0]["total"] - min(p["free"] for p in probes)
            self.contexts = used - sum(p["torch"]["reserved"] for p in probes)

    def check(self, label: str, indices: list[int]) -> dict[str, Any]:
        """One checkpoint. A move is posted in the transaction after it (the memory is mapped
        first), so a read may fall between the two: the check reads again, up to
        `CHECK_TRIES` times 10 ms apart, and a mismatch that lasts through them is one."""
        tries = 1
        row = self._check(label, indices)
        while row["mismatch"] and tries < CHECK_TRIES:
            time.sleep(0.01)
            tries += 1
            row = self._check(label, indices)
        row["tries"] = tries
        self.rows.append(row)
        return row

    def _check(self, label: str, indices: list[int]) -> dict[str, Any]:
        from extensible_kv.pool import rules

        for _ in range(5):  # a read between two transactions: the same generation around it
            before = self.pool.snapshot()
            probes = self.probe(indices)
            ledger = self.pool.snapshot()
            if ledger.generation == before.generation:
                break
        problems = rules.check(ledger)
        mismatch = []
        for i, probe in probes.items():
            entry = ledger.engines.get(engine_name(i))
            if entry is None:
                mismatch.append(f"{engine_name(i)} not in the ledger")
                continue
            if entry.physical_bytes != probe["physical_bytes"]:
                mismatch.append(
                    f"{engine_name(i)}: ledger {entry.physical_bytes} B, process "
                    f"{probe['physical_bytes']} B"
                )
            mapped = probe["mapped_bytes"]
            if mapped is not None and mapped != probe["physical_bytes"]:
                mismatch.append(
                    f"{engine_name(i)}: maps {mapped} B, holds {probe['physical_bytes']} B"
                )
        held = rules.used_bytes(ledger, self.device)
        row: dict[str, Any] = {
            "label": label,
            "ledger_problems": problems,
            "mismatch": mismatch,
            "pool_bytes": held,
            "processes_bytes": sum(p["physical_bytes"] for p in probes.values()),
            "cap_bytes": ledger.caps.get(self.device),
        }
        restarting = [i for i in self.engines.down if self.engines.processes[i].is_alive()]
        if self.gpu and probes and self.contexts is not None and not restarting:
            # What the device holds beside the KV: each process's context (measured at the
            # setup's start, the same for a process started again) and torch's allocator.
            probe = next(iter(probes.values()))
            used = probe["total"] - min(p["free"] for p in probes.values())
            beside = self.contexts * len(probes) / len(self.engines) + sum(
                p["torch"]["reserved"] for p in probes.values()
            )
            device_kv = int(used - beside)
            row.update(device_kv_bytes=device_kv, device_minus_pool_bytes=device_kv - held)
        elif self.gpu:
            row["device_check"] = "skipped: an engine is starting again"
        return row


class Killer(threading.Thread):
    """The `kill` setup's schedule, on a thread beside the trace: for each planned kill
    (`plan`: a role and a burst), from its burst's start, waits for its victim (a `donor`: an
    engine whose memory the bursting engine holds on loan; a `borrower`: the bursting engine
    once it holds a loan), kills it, times the ledger's recovery, checks, starts it again."""

    def __init__(
        self,
        engines: Engines,
        watcher: Any,
        checks: Checks,
        plan: list[tuple[str, int]],
        bursts: list[Burst],
        t0: float,
        setup: tuple[Any, ...],
        args: argparse.Namespace,
    ) -> None:
        super().__init__(daemon=True)
        self.engines, self.watcher, self.checks = engines, watcher, checks
        self.plan, self.bursts, self.t0, self.setup, self.args = plan, bursts, t0, setup, args
        self.kills: list[dict[str, Any]] = []
        self.error: str | None = None
        self.killed: set[int] = set()
        self.restarts: list[threading.Thread] = []

    def run(self) -> None:
        try:
            for number, (role, burst_index) in enumerate(self.plan):
                # A burst whose engine is down (killed, not back yet) is no one's: the next.
                index = burst_index
                while index + 1 < len(self.bursts) and self._down_at(self.bursts[index]):
                    index += 1
                self._kill(number, role, self.bursts[index])
        except BaseException:
            self.error = traceback.format_exc()
        for thread in self.restarts:
            thread.join()

    def _down_at(self, burst: Burst) -> bool:
        """Whether `burst`'s engine is down now, or was when the burst began."""
        if burst.engine in self.engines.down:
            return True
        began = self.t0 + burst.start_s
        return any(
            k["engine"] == burst.engine
            and self.t0 + k["at_s"] <= began + self.args.burst_s
            and "restart_s" not in k
            for k in self.kills
        )

    def _restart(self, victim: int, row: dict[str, Any]) -> None:
        """Engine `victim` again (on a thread of its own: the next kill keeps its time)."""
        try:
            restarted = time.monotonic()
            self.engines.restart(victim, self.args.ready_timeout_s)
            name, sizes, hints, keep = self.setup
            self.engines.send(victim, "setup", name, sizes, hints, keep)
            kind, payload = self.engines.wait(
                ("ready", "failed"), [victim], self.args.ready_timeout_s
            )[victim]
            if kind == "failed":
                raise RuntimeError(f"engine {victim} did not start again: {payload}")
            row["restart_s"] = time.monotonic() - restarted
            row["sent_after_restart"] = self.engines.up(victim)
            log(f"kill {row['kill']}: engine {victim} back in {row['restart_s']:.1f} s")
        except BaseException:
            self.error = (self.error or "") + traceback.format_exc()

    def _victim(self, role: str, needy: int) -> int | None:
        """The engine to kill now, if the moment is here: a `donor` lends memory a busy
        engine holds (the bursting one first); a `borrower` is busy and holds a loan."""
        ledger = self.watcher.latest
        if ledger is None:
            return None
        loans = sorted(
            (x for x in ledger.loans.values() if x.state == "borrowed"),
            key=lambda x: x.borrower != engine_name(needy),
        )
        for loan in loans:
            borrower = ledger.engines.get(loan.borrower)
            if borrower is None or not borrower.busy:
                continue
            who = loan.borrower if role == "borrower" else loan.lender
            if not who.startswith("engine"):
                continue  # a dead lender's loan
            index = int(who.removeprefix("engine"))
            if index not in self.engines.down:
                return index
        return None

    def _kill(self, number: int, role: str, burst: Burst) -> None:
        from extensible_kv.pool import rules

        live = lambda: [i for i in range(len(self.engines)) if i not in self.engines.down]  # noqa: E731
        start = self.t0 + burst.start_s
        time.sleep(max(0.0, start - time.monotonic()))
        # Until the next kill's burst (or the trace's end): a kill frees memory, and the
        # moment may come only once the pool has taken it up again.
        later = [b for b in self.bursts if b.start_s > burst.start_s]
        deadline = self.t0 + (later[0].start_s if later else burst.end_s + 0.6 * self.args.period_s)
        if self.plan and number + 1 < len(self.plan):
            deadline = self.t0 + self.bursts[self.plan[number + 1][1]].start_s
        victim = None
        while victim is None and time.monotonic() < deadline:
            victim = self._victim(role, burst.engine)
            time.sleep(0.002)
        met = victim is not None
        if victim is None:  # the moment never came: the bursting engine, or the one after it
            n = len(self.engines)
            first = burst.engine if role == "borrower" else (burst.engine + 1) % n
            order = [(first + k) % n for k in range(n)]
            victim = next((i for i in order if i not in self.engines.down), first)
        row: dict[str, Any] = {
            "kill": number,
            "role": role,
            "engine": victim,
            "burst_engine": burst.engine,
            "while": met,
            "at_s": time.monotonic() - self.t0,
        }
        row["before"] = self.checks.check(f"before kill {number}", live())
        ledger = self.watcher.latest
        row["loans_at_kill"] = 0 if ledger is None else len(ledger.loans_of(engine_name(victim)))
        with self.engines.lock:
            in_flight = [
                rid
                for rid, r in self.engines.sent.items()
                if r == victim and rid not in self.engines.done
            ]
        killed = self.engines.kill(victim)
        self.killed.add(victim)
        with self.engines.lock:  # what the kill took: never finished
            for rid in in_flight:
                if rid not in self.engines.done:
                    self.engines.done[rid] = {"finish": None, "error": "killed", "engine": victim}
        pool = self.checks.pool
        ledger = pool.snapshot()
        while engine_name(victim) in ledger.engines and time.monotonic() - killed < 5.0:
            time.sleep(0.001)
            ledger = pool.snapshot()
        row["recovered_ms"] = (time.monotonic() - killed) * 1e3
        row["recovered"] = engine_name(victim) not in ledger.engines
        row["ledger_problems"] = rules.check(ledger)
        row["lost"] = len(in_flight)
        row["after"] = self.checks.check(f"after kill {number}", live())
        self.kills.append(row)
        log(
            f"kill {number}: engine {victim} ({role}{'' if met else ', moment not met'}), "
            f"recovered in {row['recovered_ms']:.1f} ms"
        )
        thread = threading.Thread(target=self._restart, args=(victim, row), daemon=True)
        thread.start()
        self.restarts.append(thread)


def kill_plan(args: argparse.Namespace, bursts: list[Burst]) -> list[tuple[str, int]]:
    """`--kills` kills, seeded: roles alternate donor, borrower; each at a burst of its own,
    never the first (memory has moved by then), two bursts apart where the trace has room
    (a kill frees the dead engine's memory: the pool lends again once it is taken up)."""
    import random

    rng = random.Random(args.seed + 2)
    candidates = list(range(1, len(bursts))) or [0]
    gap = 2 if len(candidates) >= 2 * args.kills - 1 else 1
    start = rng.randint(0, max(0, len(candidates) - 1 - gap * (args.kills - 1)))
    chosen = candidates[start::gap][: args.kills]
    return [("donor" if k % 2 == 0 else "borrower", b) for k, b in enumerate(chosen)]


def run_setup(
    engines: Engines,
    name: str,
    sizes: dict[str, Any],
    bursts: list[Burst],
    requests: list[Request],
    keep: list[str],
    pids: dict[int, int],
    models: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One setup: managers started, the trace sent at its times, drained, stopped."""
    from extensible_kv.pool import Pool

    kind = KINDS[name]
    result: dict[str, Any] = {"ok": False, "error": None, "kind": kind}
    pool = watcher = None
    sizes = {**sizes, "kind": kind, "via": VIAS.get(name)}
    sizes["engines"] = [
        {
            **e,
            "cap_blocks": e[
                {"pool": "max_blocks", "static": "static_blocks"}.get(kind, "oracle_blocks")
            ],
        }
        for e in sizes["engines"]
    ]
    if kind == "pool":
        pool = Pool(f"bench-pool-{os.getpid()}-{name}")
        pool.destroy()
        pool.set_cap(args.device, sizes["share_bytes"])
        sizes["pool"] = pool.name
        watcher = LedgerWatcher(pool)
    n = len(engines)
    indices = list(range(n))
    in_turn = kind == "oracle" and sizes["oracle_mode"] == "in-turn"
    result["oracle_mode"] = sizes["oracle_mode"] if kind == "oracle" else None
    replies: dict[int, dict[str, Any]] = {}
    per_request: dict[str, dict[str, Any]] = {}
    shifts = [0.0] * n
    t0 = 0.0
    try:
        if in_turn:
            for i in indices:
                mine = [r for r in requests if r.engine == i]
                shifts[i] = mine[0].arrival_s - args.lead_s if mine else 0.0
                got, t0_i = _serve(
                    engines, name, sizes, bursts, mine, keep, args, result, None, [i], shifts[i]
                )
                replies.update(got)
                per_request.update(_per_request(engines, mine, t0_i, shifts[i]))
                result.setdefault("t0s", {})[i] = t0_i
            t0 = result["t0s"][0] if result.get("t0s") else time.monotonic()
        else:
            replies, t0 = _serve(
                engines,
                name,
                sizes,
                bursts,
                requests,
                keep,
                args,
                result,
                pool,
                indices,
                0.0,
                watcher,
            )
            per_request = _per_request(engines, requests, t0, 0.0)
        if watcher is not None and pool is not None:
            watcher.stop()
            left = pool.snapshot()
            result["ledger"] = {
                "reads": watcher.reads,
                "events_seen": len(watcher.events),
                "events_maybe_lost": watcher.maybe_lost,
                "engines_left": sorted(left.engines),
                "loans_left": len(left.loans),
                "engines": watcher.engines,
                "events": [[round(t - t0, 4), text] for t, text in watcher.events],
            }
    finally:
        if watcher is not None:
            watcher.stop()
        if pool is not None:
            pool.destroy()
    errors = {i: reply["error"] for i, reply in replies.items() if reply.get("error")}
    errors.update(result.pop("failed_to_start", {}))
    if result.get("killer_error"):
        errors[-1] = result["killer_error"]
    if errors:
        result["error"] = "\n".join(f"engine {i}: {e}" for i, e in sorted(errors.items()))
    t0s = result.get("t0s", {})
    result["engines"] = []
    for i in indices:
        mine = [r for r in requests if r.engine == i]
        rows = {r.rid: per_request.get(r.rid, {}) for r in mine}
        summary = engine_summary(
            i, models[i], rows, replies.get(i, {}), mine, t0s.get(i, t0), sizes["unit"], shifts[i]
        )
        summary["in_turn"] = in_turn
        result["engines"].append(summary)
    result["total"] = _total(result["engines"], per_request)
    result["total"]["kv_total_peak_bytes"] = (
        None
        if in_turn
        else peak_of_sum(
            [replies.get(i, {}).get("memory") or {"t": [], "bytes": []} for i in indices]
        )
    )
    ok_rows = [
        (rid, row) for rid, row in per_request.items() if row.get("sha") and not row.get("error")
    ]
    result["tokens"] = {rid: row["sha"] for rid, row in ok_rows}
    result["kept_tokens"] = {rid: row["tokens"] for rid, row in ok_rows if "tokens" in row}
    events = watcher.events if watcher is not None else []
    block_bytes = {n_: e["block_bytes"] for n_, e in watcher.engines.items()} if watcher else {}
    loans = loans_from_events(events, block_bytes, sizes["engines"][0]["block_bytes"], t0)
    by_pid = {pid: index for index, pid in pids.items()}
    names = watcher.engines if watcher is not None else {}
    seen_in_memory(
        loans,
        {
            n_: result["engines"][by_pid[e["pid"]]]["memory"]
            for n_, e in names.items()
            if e["pid"] in by_pid
        },
        t0,
    )
    result["loans"] = loans
    model_of = {engine_name(i): models[i] for i in indices}
    result["cross_model_loans"] = sum(
        1
        for loan in loans
        if loan["answer"] == "borrowed"
        and model_of.get(loan["lender"]) != model_of.get(loan["borrower"])
    )
    for key in ("latency_ms", "seen_ms"):
        result[f"loan_{key}"] = percentiles([loan[key] for loan in loans if loan[key] is not None])
    result["pool_moved_bytes"] = sum(loan["bytes"] for loan in loans)
    result["grown_bytes"] = sum(e["grown_bytes"] for e in result["engines"])
    if name == "kill":
        killed = {k["engine"] for k in result.get("kills", [])}
        survivors = [e for e in result["engines"] if e["engine"] not in killed]
        result["survivors_completed"] = sum(e["completed"] for e in survivors)
        result["survivors_requests"] = sum(e["requests"] for e in survivors)
    result["ok"] = not errors
    return result


def _per_request(
    engines: Engines, requests: list[Request], t0: float, shift: float
) -> dict[str, dict[str, Any]]:
    """Each request's arrival (as sent), first token and finish, as the engines streamed them."""
    with engines.lock:
        return {
            r.rid: {
                "arrival": t0 + r.arrival_s - shift,
                "first": engines.first.get(r.rid),
                **engines.done.get(r.rid, {}),
            }
            for r in requests
        }


def _serve(
    engines: Engines,
    name: str,
    sizes: dict[str, Any],
    bursts: list[Burst],
    requests: list[Request],
    keep: list[str],
    args: argparse.Namespace,
    result: dict[str, Any],
    pool: Any,
    indices: list[int],
    shift: float,
    watcher: Any = None,
) -> tuple[dict[int, dict[str, Any]], float]:
    """Starts the setup in engines `indices`, sends their requests (`shift` s earlier than
    the trace says), stops them: their replies, and the trace's start."""
    from extensible_kv.pool import rules

    hints = sizes["hints"]
    with engines.lock:
        for r in requests:
            engines.first.pop(r.rid, None)
            engines.done.pop(r.rid, None)
            engines.sent.pop(r.rid, None)
    checks = Checks(engines, pool, args.device, sizes["gpu"]) if pool is not None else None
    if checks is not None:
        checks.baseline(indices)
    # One engine at a time: transformers' warm-up holds transient memory (its largest
    # prefill's attention scores, sized by the cache it finds), which the next engine's commit
    # must not meet; each engine empties torch's cache once it serves.
    ready: dict[int, Any] = {}
    setup = (name, sizes, hints, keep)
    for i in indices:
        engines.send(i, "setup", *setup)
        ready.update(engines.wait(("ready", "failed"), [i], args.ready_timeout_s))
    failed = {i: p for i, (kind, p) in ready.items() if kind == "failed"}
    result.setdefault("failed_to_start", {}).update(failed)
    t0 = time.monotonic() + 0.5
    killer = None
    if not failed:
        if checks is not None:
            result.setdefault("checks", []).append(checks.check("start", indices))
        if name == "kill" and watcher is not None and checks is not None:
            plan = kill_plan(args, bursts)
            result["kill_plan"] = plan
            killer = Killer(engines, watcher, checks, plan, bursts, t0, setup, args)
            killer.start()
        log(f"{name}: engines {indices} ready, {len(requests)} requests")
        send_trace(engines, requests, t0 - shift, args.drain_s, result)
        if killer is not None:
            killer.join(args.ready_timeout_s * 2)
            result["kills"] = killer.kills
            if killer.error:
                result["killer_error"] = killer.error
            # The restarted engines' requests sent late: wait for them too.
            send_trace(engines, [], t0 - shift, args.drain_s, result, wanted=requests)
    if pool is not None:
        with pool.transaction() as ledger:
            result["ledger_problems_before_stop"] = rules.check(ledger)
        if checks is not None and not failed:
            result.setdefault("checks", []).append(checks.check("end", indices))
    for i in indices:
        engines.send(i, "stop")
    answers = engines.wait(("result",), indices, args.stop_timeout_s)
    if checks is not None and checks.rows:
        result["checks"] = checks.rows
    return {i: reply for i, (_, reply) in answers.items()}, t0


def send_trace(
    engines: Engines,
    requests: list[Request],
    t0: float,
    drain_s: float,
    result: dict[str, Any],
    wanted: list[Request] | None = None,
) -> None:
    """Sends each request to its engine at its arrival time (held while the engine is down,
    sent once it is back), then waits up to `drain_s` after the last arrival for every result
    of `wanted` (default: `requests`)."""
    for request in requests:
        delay = t0 + request.arrival_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        engines.send_request(request.engine, request.rid, request.prompt, request.new_tokens)
    last = time.monotonic()
    if requests:
        result["send_late_s"] = last - (t0 + requests[-1].arrival_s)
    rids = {r.rid for r in (wanted if wanted is not None else requests)}
    with engines.lock:
        while not rids <= engines.done.keys() and time.monotonic() < last + drain_s:
            engines.lock.wait(0.1)
        result["drained"] = rids <= engines.done.keys()
    result["drain_s"] = time.monotonic() - last


# ---------------------------------------------------------------------------------------------
# the report


# ---------------------------------------------------------------------------------------------
# sizes


def sizes_for(
    args: argparse.Namespace, infos: list[dict[str, Any]], gpu: bool, total_bytes: int
) -> dict[str, Any]:
    """The setups' memory, in bytes (see the module's docstring), and each engine's blocks."""
    unit = GIB if gpu else MIB
    n = len(infos)
    static = total_bytes // n
    share = n * static
    granule = args.granularity or 2 * MIB
    mins = [max(1, math.ceil(args.min_gib * unit / i["block_bytes"])) for i in infos]
    # What an engine holds beside its blocks: transformers' two trash sectors (a sector is at
    # most a few blocks), and up to a granule of rounding.
    beside = [2 * i["sector_bytes"] + granule for i in infos]
    engines = []
    for k, info in enumerate(infos):
        block = info["block_bytes"]
        others = sum(mins[j] * infos[j]["block_bytes"] + beside[j] for j in range(n) if j != k)
        most = (share - others - beside[k]) // block
        if most < mins[k]:
            raise SystemExit(
                f"--kv-gib leaves {info['model']} no room above --min-gib {args.min_gib}"
            )
        engines.append(
            {
                "model": info["model"],
                "block_bytes": block,
                "min_blocks": mins[k],
                "max_blocks": most,
                "static_blocks": max(1, (static - 2 * info["sector_bytes"]) // block),
                "oracle_blocks": max(1, (total_bytes - 2 * info["sector_bytes"]) // block),
            }
        )
    longest = args.max_prompt
    return {
        "gpu": gpu,
        "unit": unit,
        "total_bytes": total_bytes,
        "static_bytes": static,
        "share_bytes": share,
        "granularity": args.granularity,
        "step_blocks": args.step_blocks,
        "engines": engines,
        "hints": (longest, burst_range(args)[1]),
    }


HOST_DEFAULTS: dict[str, Any] = {
    "kv_gib": "0.75",
    "min_gib": 0.0625,
    "granularity": 16 << 10,  # a few blocks of the host's models: loans of a few blocks
    "burst_requests": [18, 28],
    "burst_s": 0.1,
    "period_s": 1.2,
    "rounds": 2,
    "lead_s": 0.2,
    "trickle_per_s": 1.0,
    "min_prompt": 8,
    "max_prompt": 64,
    "new_tokens": 16,
    "max_batch_tokens": 64,
    "drain_s": 30.0,
    "check_requests": 2,
    "ready_timeout_s": 120.0,
    "kills": 2,
    "budget_s": 0.0,
    "dtype": "float32",
}
# On a GPU (estimates, not run yet with several models: see docs/benchmarks.md). The H100 run
# of three 8B engines (6 GiB of KV, bursts of 48 requests of ~290 + 128 tokens, 28 s apart)
# took 426 s for four setups. Here five or seven engines burst 8 s apart, bursts of 16 to 48
# requests: an 8B engine's burst (~13k tokens of 128 KiB, ~1.6 GiB) is more than its static
# fifth of 6 GiB, a 0.5B engine's (12 KiB a token) is not. The oracle gives each engine all
# 6 GiB: 30 GiB for five (H100), 42 GiB for seven (H200), beside ~30 GiB of weights.
GPU_DEFAULTS: dict[str, Any] = {
    "kv_gib": "6",
    "min_gib": 0.25,
    "granularity": None,
    "burst_requests": [16, 48],
    "burst_s": 1.0,
    "period_s": 8.0,
    "rounds": 1,
    "lead_s": 0.5,
    "trickle_per_s": 0.1,
    "min_prompt": 64,
    "max_prompt": 512,
    "new_tokens": 128,
    # transformers' sdpa path materializes a prefill's scores, queries x every key it reads;
    # its warm-up sizes them by the longest request the cache holds: at 2048 a static third's
    # warm-up took 12.4 GiB an engine (H100, 4 layers), at 512 a quarter.
    "max_batch_tokens": 512,
    "drain_s": 45.0,
    "check_requests": 3,
    "ready_timeout_s": 300.0,
    "kills": 2,
    "budget_s": 400.0,
    "dtype": "bfloat16",
}
# What each per-device option means; its defaults are GPU_DEFAULTS' and HOST_DEFAULTS'.
PER_DEVICE: dict[str, tuple[Any, str]] = {
    "kv_gib": (str, "KV memory of every setup, in all (MiB on the host); auto: the free memory"),
    "min_gib": (float, "a pool engine's minimum (MiB on the host)"),
    "granularity": (int, "the caches' granule in bytes (the device's when unset)"),
    "burst_requests": (int, "requests in a burst: one value, or LOW HIGH (drawn per burst)"),
    "burst_s": (float, "a burst's arrival window"),
    "period_s": (float, "from one burst's start to the next's"),
    "rounds": (int, "bursts of each engine"),
    "lead_s": (float, "from the trace's start to the first burst"),
    "trickle_per_s": (float, "an engine's requests a second outside its bursts"),
    "min_prompt": (int, "the shortest prompt"),
    "max_prompt": (int, "the longest prompt"),
    "new_tokens": (int, "greedy tokens a request"),
    "max_batch_tokens": (int, "transformers' tokens a batch"),
    "drain_s": (float, "after the last arrival, how long the results may take"),
    "check_requests": (int, "requests of each engine run alone, for the tokens (0: all)"),
    "ready_timeout_s": (float, "for the engines to load, or to start a setup"),
    "kills": (int, "kill -9s in the kill setup (donor, borrower, donor, ...)"),
    "budget_s": (float, "skip the setups that would end past this many seconds (0: none)"),
    "dtype": (str, "the models' dtype: bfloat16 or float32"),
}


EPILOG = """\
models (pool_models.py; published shapes, random weights, bf16 on a GPU):
  H200 (>= 120 GiB): llama3-8b qwen3-4b llama3.2-1b qwen2.5-0.5b gemma3-1b-sliding
                     qwen3-0.6b smollm2-360m
  H100:              the first five; a model the card cannot hold beside the others'
                     overhead (--headroom-gib) and the KV is left out, largest first (said)
  --small (float32): small-llama small-qwen3 small-qwen2 small-sliding small-llama-mha
  host (--device cpu): tiny-llama tiny-qwen3 tiny-sliding (blocks of 8, 12 and 16 KiB)

the GPU runs (scripts/gpu-check pool runs the first two in one device call, ~9.5 min):
  the comparison (pool, static, oracle together, driver, kill -9s; --budget-s 330):
      bench_pool.py --out DIR --budget-s 330
  every request's tokens against alone, float32:
      bench_pool.py --out DIR --dtype float32 --small --setups pool static --check-requests 0
          --new-tokens 64 --kv-gib 0.25 --min-gib 0.02
  seven models, >= 100 GiB pooled (H200; the oracle alone in turn, said so):
      bench_pool.py --out DIR --kv-gib auto --setups pool static oracle
  kill -9 under load alone:
      bench_pool.py --out DIR --setups kill --kills 4
"""


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_pool"))
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (tiny models, MiB)")
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS + MORE_SETUPS)
    parser.add_argument(
        "--models",
        nargs="+",
        help="models by name, an engine each (default: the card's set; see pool_models.py)",
    )
    parser.add_argument(
        "--small", action="store_true", help="small float32-sized models on a GPU (tokens run)"
    )
    parser.add_argument(
        "--oracle",
        choices=("auto", "together", "in-turn"),
        default="auto",
        help="the oracle's engines at once, or each alone in turn (auto: at once if it fits)",
    )
    parser.add_argument(
        "--headroom-gib",
        type=float,
        default=3.0,
        help="GPU: what an engine needs beside its weights and KV (context, activations, "
        "graphs, warm-up): the fit of the models, the oracle's, --kv-gib auto",
    )
    for key, (kind, what) in PER_DEVICE.items():
        extra: dict[str, Any] = {"nargs": "+"} if key == "burst_requests" else {}
        parser.add_argument(
            "--" + key.replace("_", "-"),
            type=kind,
            help=f"{what} (GPU {GPU_DEFAULTS[key]}, host {HOST_DEFAULTS[key]})",
            **extra,
        )
    parser.add_argument(
        "--step-blocks",
        type=int,
        help="a pool engine's commit step, its smallest loan (the join's default)",
    )
    parser.add_argument("--stop-timeout-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.setups = list(dict.fromkeys(args.setups))  # each once, in the order given
    defaults = GPU_DEFAULTS if args.device.startswith("cuda") else HOST_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.small and args.dtype == "bfloat16" and "--dtype" not in (argv or sys.argv):
        args.dtype = "float32"
    if args.dtype not in ("bfloat16", "float32"):
        parser.error("--dtype is bfloat16 or float32")
    return args


def _sector_bytes(info: dict[str, Any], shape: Any, itemsize: int) -> int:
    """transformers' sector: the lcm of its attention groups' blocks (a group's block is
    `page_size` tokens of its layers) and 128 bytes."""
    layer = shape.kv_bytes_per_token(itemsize) // shape.layers * info["page_size"]
    types = shape.layer_types() or ["full_attention"]
    groups = Counter(types)
    return math.lcm(*(count * layer for count in groups.values()), 128)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    gpu = args.device.startswith("cuda")
    unit = GIB if gpu else MIB
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_pool.json"
    itemsize = 2 if args.dtype == "bfloat16" else 4
    models = catalog(args.device, args.small)
    total_memory = _device_total(args.device) if gpu else None
    kv_guess = 0 if args.kv_gib == "auto" else int(float(args.kv_gib) * unit)
    headroom = int(args.headroom_gib * GIB)
    fit = pick_models(
        args.models, args.device, args.small, total_memory, kv_guess, headroom, itemsize
    )
    names = list(fit.models)
    configs = [
        {
            "device": args.device,
            "model": asdict(models[n]),
            "dtype": args.dtype,
            "seed": args.seed,
            "new_tokens": args.new_tokens,
            "max_batch_tokens": args.max_batch_tokens,
            "num_blocks": None,
        }
        for n in names
    ]
    start = time.monotonic()
    log(f"models: {names} ({fit.note}); left out: {fit.left_out or 'none'}")
    engines = Engines(configs)
    results: dict[str, Any] = {}
    try:
        loaded = engines.wait(("loaded",), list(range(len(names))), args.ready_timeout_s)
        infos = [loaded[i][1] for i in range(len(names))]
        for info, n in zip(infos, names, strict=True):
            info["sector_bytes"] = _sector_bytes(info, models[n], itemsize)
        pids = {index: answer[1]["pid"] for index, answer in loaded.items()}
        log(f"engines loaded in {time.monotonic() - start:.1f} s")
        free = device_free(engines) if gpu else None
        total = kv_guess
        if args.kv_gib == "auto":
            if free is None:
                raise SystemExit("--kv-gib auto needs a GPU")
            total = max(unit, free - len(names) * headroom)
        sizes = sizes_for(args, infos, gpu, total)
        oracle_mode, oracle_why = args.oracle, ""
        if oracle_mode == "auto":
            need = len(names) * (total + headroom)
            if free is None or need <= free:
                oracle_mode = "together"
            else:
                oracle_mode = "in-turn"
                oracle_why = (
                    f"{len(names)} engines x ({total / GIB:.1f} GiB + {args.headroom_gib} GiB) "
                    f"= {need / GIB:.1f} GiB is more than the {free / GIB:.1f} GiB free"
                )
        sizes["oracle_mode"] = oracle_mode
        bursts, requests = make_trace(args, [i["vocab"] for i in infos])
        sample = check_sample(requests, args.check_requests, args.seed, len(names))
        keep = [r.rid for r in sample]
        low, high = burst_range(args)
        results = {
            "environment": {
                **{k: v for k, v in infos[0].items() if k in ("device", "total_memory_gib")},
                "torch": infos[0]["torch"],
                "transformers": infos[0]["transformers"],
                "shapes": [i["shape"] for i in infos],
                "engines": [
                    {k: v for k, v in i.items() if k not in ("torch", "transformers")}
                    for i in infos
                ],
                "device_free_after_load": free,
            },
            "settings": {
                **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                **{k: v for k, v in sizes.items() if k != "unit"},
                "models": names,
                "models_note": fit.note,
                "left_out": fit.left_out,
                "oracle_why": oracle_why,
                "unit_name": "GiB" if gpu else "MiB",
                "total_kv": sizes["total_bytes"] / unit,
                "static_kv": sizes["static_bytes"] / unit,
                "share_kv": sizes["share_bytes"] / unit,
                "requests": len(requests),
                "burst_range": f"{low}" if low == high else f"{low} to {high}",
                "sample_s": 0.01,
            },
            "trace": {
                "bursts": [asdict(b) for b in bursts],
                "requests": [
                    {
                        "rid": r.rid,
                        "engine": r.engine,
                        "arrival_s": r.arrival_s,
                        "prompt_len": len(r.prompt),
                        "new_tokens": r.new_tokens,
                        "burst": r.burst,
                    }
                    for r in requests
                ],
                "check_sample": keep,
            },
            "setups": {},
        }
        stuck = False
        last_s = 0.0
        for name in args.setups:
            elapsed = time.monotonic() - start
            # The next setup takes about as long as the last one, and the alone run follows.
            if args.budget_s and elapsed + 1.3 * last_s + 30 > args.budget_s:
                results["setups"][name] = {
                    "ok": True,
                    "skipped": f"skipped: {elapsed:.0f} s gone, the last setup took "
                    f"{last_s:.0f} s, the budget is {args.budget_s:.0f} s",
                }
                log(f"{name}: {results['setups'][name]['skipped']}")
                continue
            log(f"setup {name}")
            began = time.monotonic()
            try:
                results["setups"][name] = run_setup(
                    engines, name, sizes, bursts, requests, keep, pids, names, args
                )
            except (RuntimeError, TimeoutError) as error:
                results["setups"][name] = {"ok": False, "error": str(error)}
                log(f"{name} failed: {error}")
                # An engine that did not answer in time answers nothing later either.
                stuck = isinstance(error, TimeoutError)
                if stuck or any(not p.is_alive() for p in engines.processes):
                    break
            last_s = time.monotonic() - began
            pids = {i: engines.pid(i) for i in range(len(names))}  # the kill setup restarts
            if results["setups"][name].get("error"):
                log(f"{name}: {results['setups'][name]['error'][-3000:]}")
            path.write_text(json.dumps(results, indent=1, default=str))
        alone = None
        if not stuck and all(p.is_alive() for p in engines.processes):
            results["alone"] = run_alone(engines, sample, sizes, results["setups"], args, gpu)
            alone = results["alone"]["tokens"] if results["alone"]["error"] is None else None
        results["identical"] = compare_tokens(results["setups"], alone)
    finally:
        engines.close()
    path.write_text(json.dumps(results, indent=1, default=str))
    print(report(results))
    print(f"\nJSON: {path}")
    failed = [n for n, r in results.get("setups", {}).items() if not r.get("ok")]
    if failed or (results.get("alone") or {}).get("error"):
        log(f"failed: {failed or 'the alone run'}")
        return 1
    return 0


def run_alone(
    engines: Engines,
    sample: list[Request],
    sizes: dict[str, Any],
    setups: dict[str, Any],
    args: argparse.Namespace,
    gpu: bool,
) -> dict[str, Any]:
    """Every engine runs its sampled requests one at a time on transformers' own cache (all
    engines at once: each its own model); their tokens, and the model's scores."""
    log(f"alone: {len(sample)} requests one at a time, transformers' own cache")
    hints = sizes["hints"]
    indices = list(range(len(engines)))
    for i in indices:
        mine = [r for r in sample if r.engine == i]
        candidates = {
            name: {
                r.rid: s["kept_tokens"][r.rid] for r in mine if r.rid in s.get("kept_tokens", {})
            }
            for name, s in setups.items()
            if s.get("ok") and "kept_tokens" in s
        }
        engines.send(
            i,
            "alone",
            hints,
            [(r.rid, r.prompt, r.new_tokens) for r in mine],
            sizes["engines"][i]["max_blocks"],
            candidates,
            SCORED,
        )
    answers = engines.wait(("alone",), indices, args.ready_timeout_s + 600)
    tokens: dict[str, list[int]] = {}
    errors = []
    scores: dict[str, dict[str, Any]] = {}
    for i in indices:
        answer = answers[i][1]
        if answer["error"]:
            errors.append(f"engine {i}: {answer['error']}")
        tokens.update(answer["tokens"])
        for name, row in (answer.get("scores") or {}).items():
            total = scores.setdefault(
                name, {"tokens": 0, "argmax_n": 0, "top5_n": 0, "max_gap": None, "max_rank": None}
            )
            total["tokens"] += row["tokens"]
            total["argmax_n"] += row["argmax_n"]
            total["top5_n"] += row["top5_n"]
            for key in ("max_gap", "max_rank"):
                if row[key] is not None:
                    total[key] = row[key] if total[key] is None else max(total[key], row[key])
    for row in scores.values():
        n = row["tokens"]
        row["argmax"] = row["argmax_n"] / n if n else None
        row["top5"] = row["top5_n"] / n if n else None
    return {"error": "\n".join(errors) or None, "tokens": tokens, "scores": scores or None}


# Requests of each engine whose tokens the model scores (one forward each, a second on a GPU).
SCORED = 8


def device_free(engines: Engines) -> int:
    """The device's free bytes, as engine 0 sees them once its torch cache is emptied."""
    engines.send(0, "free")
    return int(engines.wait(("free",), [0], 60)[0][1])


def _device_total(device: str) -> int | None:
    """The GPU's memory, from nvidia-smi (this process never initializes CUDA: the engines
    are spawned, each with its own context)."""
    import subprocess

    index = device.partition(":")[2] or "0"
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=memory.total",
                "--format=csv,noheader,nounits",
                "-i",
                index,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return int(out.split()[0]) * MIB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


if __name__ == "__main__":
    sys.exit(main())
