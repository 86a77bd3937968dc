"""Three models on one device, each bursting in turn: the node pool against a static split of
the same KV memory, and against the pool moving memory through the driver (issue 37, item 6).

    python3 benchmarks/bench_pool.py --out DIR [--device cuda:0] [--setups pool static driver]

**The engines.** Three processes (spawned on a GPU: each its own CUDA context; on the host,
forks of one server that imported torch and transformers once), each a transformers
continuous-batching manager over a model built from a config with random weights, the same
seed in all three (so the same weights): on a GPU an 8B-shaped Llama (32 layers, hidden 4096,
32 heads, 8 KV heads of 128, bf16) with CUDA graphs, as `benchmarks/bench_transformers.py`
runs it; on the host backend (`--device cpu`) the demo's tiny model, with sizes in MiB where
the GPU's are GiB: a smoke run of seconds. Three 8B engines hold 16 GB of weights each
beside their activations and graphs: an H200 ran them with 36 GiB of KV; the default 6 GiB
should fit an 80 GB H100 too (estimated, not tried).

**The trace** (seeded, `--seed`): `--rounds` rounds in which each engine bursts in turn, one
burst every `--period-s`: `--burst-requests` requests arriving at uniform random times within
`--burst-s`, prompts of log-uniform length in `--min-prompt`..`--max-prompt` (many short, some
long), `--new-tokens` greedy tokens each (no EOS). Outside its bursts an engine gets a Poisson
trickle of `--trickle-per-s` requests a second (0: idle). The same requests, at the same
times, in every setup. The driver (this process) sends each engine its requests at their
arrival times over a queue; an engine adds each to its running manager on receipt, streaming.

**The setups**, each a fresh manager per engine (reserved, warmed up, graphs captured), the
same total KV memory `--kv-gib` (MiB on the host) in all:
- `pool`: `extensible_kv.transformers.enable(pool=..., pool_via="loan")`; each engine starts
  at `--min-gib` and may grow to the total less the others' minimums, committing
  `--step-blocks` at a time (the join's default when unset); the pool's share of the device
  is the total. Memory moves as loans of physical handles.
- `static`: each engine a third of the total (`enable(budget_bytes=...)`), no pool.
- `driver`: as `pool`, with `pool_via="driver"`: a donor releases its free top blocks to the
  driver and the needy engine creates memory again (as kvcached moves memory).
- `move` (only when named in `--setups`): as `pool`, with `pool_move=True`: a busy donor
  moves its live blocks down between its steps and lends every free block, not only its free
  top ones.
Only `enable_setup` calls the pool's options of `enable` (the transformers join, issue 37
item 4); a setup that fails to start is reported with its error, and the run exits 1.

**What each number measures** (all times `time.monotonic()`, one clock for every process):
- TTFT: from a request's arrival time in the trace to the moment its engine's result reader
  receives its first streamed token. End-to-end: arrival to the finished result. p50 / p99
  over the engine's completed requests (nearest rank); requests with no result are not in the
  percentiles but are counted (`completed` of `requests`).
- completed: requests finished without error before the drain ends, `--drain-s` after the
  last arrival. tokens/s: tokens of completed requests over the engine's busy window (its
  first arrival to its last finish); in all, over the setup's.
- KV memory: each engine's `physical_bytes` (what its cache maps: borrowed memory included,
  lent memory not), sampled every 10 ms from its start on; the JSON keeps the samples where
  it changed. KV mean is over time, from the trace's start; the peak of "all" is the peak of
  the engines' sum, which may count a moving block twice for up to a sample.
- Memory moved in (`grown_bytes`): the sum of every engine's increases during the trace: the
  memory that reached an engine, from free memory, by loan or through the driver (a lower
  bound: a change undone within a sample is not seen). Moved by the pool
  (`pool_moved_bytes`): the blocks of every request for memory that a donor answered with a
  loan or a release to the driver, times the donor's block.
- Each request for memory: from the ledger's events, its ask (`loan N: A asks B for K
  blocks`) and its answer (borrowed, released to the driver, refused, expired), each stamped
  with the time of the transaction that posted it, so the interval is exact. The ask to the
  needy engine (`latency_ms`): to the borrow for a loan (the memory mapped by the borrower);
  through the driver no event marks the needy engine's commit that follows the release, so
  the first sample of its memory that grew after the release stands in (an upper bound, by up
  to 10 ms). Seen in its memory (`seen_ms`): that same sampled figure for both, to compare
  them alike. The driver reads the ledger file every 5 ms (no lock: a write is a rename) and
  keeps every event it has not seen; the ledger keeps its last 64 only, and
  `events_maybe_lost` counts the reads whose oldest event was new (some may have fallen off
  between two reads). Each engine also returns its `extensible_kv` log records (the pool's
  decisions with their reasons, the cache's resizes).
- Ledger and leaks: `rules.check` on the ledger just before the engines stop, and what the
  ledger still lists once they left (nothing, if none leaked); each engine's host memfds of
  extensible-kv after its teardown (0), and on a GPU the device's free memory before the
  setup and after its teardown, measured by engine 0.
- Identical tokens: a fourth run on engine 0, with transformers' own KV cache (no
  extensible-kv code), serves a seeded sample of the trace's requests (`--check-requests` of
  each engine) one at a time, alone; each setup's tokens for those requests are compared with
  it. That is the stronger check: it is what the target says ("identical to the same requests
  run alone"), its reference shares no code with the cache under test, and it catches a fault
  common to all three setups, which comparing the setups with each other cannot. They are
  compared with each other too (every request completed in both, by a hash of its tokens). On
  a GPU, bf16 matmuls are not batch-invariant: a request batched differently may pick another
  token where two logits nearly tie; the static setup, which moves no memory, shows that floor.
  On the H100 every sampled request of every setup (the static one too) parted from the alone
  run within its first 15 tokens: a random-weight model's logits nearly tie often. So each
  setup's sampled tokens, and the alone run's, are also scored by the model itself (`score`):
  one plain forward over prompt and tokens, each token ranked among the logits for its own
  prefix; a token written from wrong KV is not near the top for its true prefix, and the
  `control` row (the alone run's tokens after another request's prompt) shows how far off
  that looks.

Markdown on stdout, DIR/bench_pool.json with everything (written after each setup), including
the memory time series and the trace's bursts, which `benchmarks/plot_pool.py` draws.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import math
import multiprocessing as mp
import os
import random
import re
import signal
import statistics
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import GIB, MIB, log

ENGINES = 3
SETUPS = ("pool", "static", "driver")
# Opt-in setups (`--setups ... move`): `pool` with `pool_move=True`.
MORE_SETUPS = ("move",)
VIAS = {"pool": "loan", "driver": "driver", "move": "loan"}
SAMPLE_S = 0.01  # the memory sampler's period
LEDGER_POLL_S = 0.005
MAX_LOG_RECORDS = 4000  # per engine and setup
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


# ---------------------------------------------------------------------------------------------
# the trace


@dataclass(frozen=True)
class Request:
    rid: str
    engine: int
    arrival_s: float  # from the trace's start
    prompt: list[int]
    new_tokens: int
    burst: int | None  # the index of its burst, None for the trickle


@dataclass(frozen=True)
class Burst:
    engine: int
    start_s: float
    end_s: float


def make_trace(args: argparse.Namespace, vocab: int) -> tuple[list[Burst], list[Request]]:
    """The seeded trace: bursts in turn, each engine's trickle outside its own bursts."""
    rng = random.Random(args.seed)
    bursts: list[Burst] = []
    arrivals: list[tuple[float, int, int | None]] = []
    for r in range(args.rounds):
        for engine in range(ENGINES):
            start = args.lead_s + (r * ENGINES + engine) * args.period_s
            bursts.append(Burst(engine, start, start + args.burst_s))
            for _ in range(args.burst_requests):
                arrivals.append((start + rng.uniform(0, args.burst_s), engine, len(bursts) - 1))
    span = args.lead_s + args.rounds * ENGINES * args.period_s
    if args.trickle_per_s > 0:
        for engine in range(ENGINES):
            own = [b for b in bursts if b.engine == engine]
            t = rng.expovariate(args.trickle_per_s)
            while t < span:
                if not any(b.start_s <= t <= b.end_s for b in own):
                    arrivals.append((t, engine, None))
                t += rng.expovariate(args.trickle_per_s)
    arrivals.sort()
    low, high = math.log(args.min_prompt), math.log(args.max_prompt)
    requests = []
    counts = [0] * ENGINES
    for arrival, engine, burst in arrivals:
        length = round(math.exp(rng.uniform(low, high)))
        prompt = [rng.randrange(1, vocab) for _ in range(length)]
        rid = f"e{engine}-{counts[engine]}"
        counts[engine] += 1
        requests.append(Request(rid, engine, arrival, prompt, args.new_tokens, burst))
    return bursts, requests


def check_sample(requests: list[Request], per_engine: int, seed: int) -> list[Request]:
    """`per_engine` burst requests of each engine, seeded: the alone run's requests."""
    rng = random.Random(seed + 1)
    sample: list[Request] = []
    for engine in range(ENGINES):
        mine = [r for r in requests if r.engine == engine and r.burst is not None]
        sample += rng.sample(mine, min(per_engine, len(mine)))
    return sorted(sample, key=lambda r: r.arrival_s)


# ---------------------------------------------------------------------------------------------
# the engine process


def setup_blocks(setup: str, sizes: dict[str, Any]) -> int:
    """The most blocks an engine of `setup` may hold: its cache's cap (see `_new_manager`)."""
    if setup == "static":
        return max(1, sizes["static_bytes"] // sizes["block_bytes"] - 2)  # less the trash
    return int(sizes["max_blocks"])


def enable_setup(setup: str, sizes: dict[str, Any], engine: str) -> None:
    """Enables `setup` in this engine process, named `engine` in the pool: the one place that
    calls the pool join's options of `extensible_kv.transformers.enable` (issue 37, item 4)."""
    import extensible_kv.transformers as ekt

    granularity = {"granularity": sizes["granularity"]} if sizes["granularity"] else {}
    if setup == "static":
        ekt.enable(budget_bytes=sizes["static_bytes"], **granularity)
        return
    # The host backend has no free-memory figure: the most this engine may hold is its budget.
    budget = {} if sizes["gpu"] else {"budget_bytes": sizes["max_blocks"] * sizes["block_bytes"]}
    step = {"pool_step_blocks": sizes["step_blocks"]} if sizes["step_blocks"] else {}
    ekt.enable(
        pool=sizes["pool"],
        engine=engine,
        min_blocks=sizes["min_blocks"],
        max_blocks=sizes["max_blocks"],
        pool_via=VIAS[setup],
        pool_move=setup == "move",
        **budget,
        **granularity,
        **step,
    )


def _kv_tensor(manager: Any) -> Any:
    """The `ExtensibleTensor` that holds the manager's KV cache."""
    return manager.batch_processor.cache._ekv.tensor


def _memfds() -> int:
    """This process's open memfds of extensible-kv (the host backend's memory)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += target.startswith("/memfd:extensible-kv")
    return count


class _Sampler:
    """The tensor's `physical_bytes` every `SAMPLE_S` on a thread; keeps the changes."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.t: list[float] = []
        self.bytes: list[int] = []
        self.samples = 0
        self.running = True
        self._sample()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        now, value = time.monotonic(), int(self.tensor.physical_bytes)
        self.samples += 1
        if not self.bytes or value != self.bytes[-1]:
            self.t.append(now)
            self.bytes.append(value)

    def _loop(self) -> None:
        while self.running:
            time.sleep(SAMPLE_S)
            self._sample()

    def stop(self) -> dict[str, Any]:
        self.running = False
        self.thread.join()
        self._sample()
        self.t.append(time.monotonic())  # the level held to the end
        self.bytes.append(self.bytes[-1])
        self.tensor = None  # the cache's memory goes with the manager
        return {"t": self.t, "bytes": self.bytes, "samples": self.samples}


class _Results:
    """Reads the manager's streamed results on a thread: first token and finish per request."""

    def __init__(self, manager: Any, outbox: Any, index: int, keep_tokens: set[str]) -> None:
        self.manager = manager
        self.outbox = outbox
        self.index = index
        self.keep_tokens = keep_tokens
        self.first: dict[str, float] = {}
        self.done: dict[str, dict[str, Any]] = {}
        self.running = True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while self.running:
            result = self.manager.get_result(timeout=0.05)
            now = time.monotonic()
            if result is None:
                time.sleep(0.001)  # get_result returns at once once the loop has stopped
                continue
            rid = result.request_id
            if result.generated_tokens and rid not in self.first:
                self.first[rid] = now
            if result.is_finished() and rid not in self.done:
                tokens = list(result.generated_tokens)
                self.done[rid] = {
                    "finish": now,
                    "n_tokens": len(tokens),
                    "sha": _digest(tokens),
                    "error": None if result.error is None else str(result.error),
                    **({"tokens": tokens} if rid in self.keep_tokens else {}),
                }
                self.outbox.put(("done", self.index, rid))

    def stop(self) -> None:
        self.running = False
        self.thread.join()


class _LogRecords:
    """The `extensible_kv` loggers' records (the pool's decisions, the cache's resizes)."""

    def __init__(self) -> None:
        import logging

        self.records: list[list[Any]] = []
        self.dropped = 0

        class Handler(logging.Handler):
            def emit(inner, record: logging.LogRecord) -> None:
                if len(self.records) < MAX_LOG_RECORDS:
                    self.records.append([time.monotonic(), record.name, record.getMessage()])
                else:
                    self.dropped += 1

        self.handler = Handler(logging.INFO)
        self.logger = logging.getLogger("extensible_kv")
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)

    def close(self) -> list[list[Any]]:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        return self.records


def _digest(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


class _Engine:
    """One engine's process: its model, and a manager per setup."""

    def __init__(self, index: int, config: dict[str, Any], outbox: Any) -> None:
        import torch
        from extensible_kv._demo import serve

        self.index, self.config, self.outbox = index, config, outbox
        self.device = torch.device(config["device"])
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # three engines share the host's cores
        self.options = serve.DemoOptions(
            device=config["device"],
            layers=config["layers"],
            new_tokens=config["new_tokens"],
            max_batch_tokens=config["max_batch_tokens"],
            num_blocks=config["num_blocks"],
            progress=False,
        ).resolved()
        start = time.perf_counter()
        self.model = serve.build_model(self.options)
        self.model_s = time.perf_counter() - start
        self.model_allocated = self._torch_memory()["allocated"]

    def info(self) -> dict[str, Any]:
        import torch
        import transformers
        from extensible_kv._demo import serve

        config = self.model.config
        cb_config = serve._cb_config(self.options, self.device)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // (
            config.num_attention_heads
        )
        itemsize = self.model.dtype.itemsize
        info = {
            "pid": os.getpid(),
            "model_s": self.model_s,
            "vocab": config.vocab_size,
            "page_size": cb_config.page_size,
            # transformers' whole-model block: page_size tokens of K and V of every layer.
            "block_bytes": config.num_hidden_layers
            * 2
            * config.num_key_value_heads
            * head_dim
            * itemsize
            * cb_config.page_size,
            "shape": serve.describe(self.model, self.options),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            info.update(device=props.name, total_memory_gib=props.total_memory / GIB)
        return info

    def _torch_memory(self) -> dict[str, int]:
        """What torch's allocator holds in this process (0 on the host)."""
        import torch

        if self.device.type != "cuda":
            return {"allocated": 0, "reserved": 0}
        return {
            "allocated": int(torch.cuda.memory_allocated(self.device)),
            "reserved": int(torch.cuda.memory_reserved(self.device)),
        }

    def free_bytes(self) -> int | None:
        import gc

        import torch

        if self.device.type != "cuda":
            return None
        gc.collect()
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(self.device)[0])

    def _new_manager(self, hints: tuple[int, int], num_blocks: int | None = None) -> Any:
        """`num_blocks` (when the engine has no cap of its own) caps its cache, and so what
        transformers sizes from it: without one, each engine's transformers sizes its reads
        per batch (`max_tokens_read`: the masks, and the warm-up's and every padded batch's
        attention scores) for ~90% of the free memory it sees, as if alone on the device.
        On an H200 that was 1,121-2,321 blocks an engine (logged), and every setup crawled
        (36 of 398 requests done)."""
        import dataclasses

        from extensible_kv._demo import serve

        options = self.options
        if num_blocks is not None and options.num_blocks is None:
            options = dataclasses.replace(options, num_blocks=num_blocks)

        # transformers' workload hints (the longest prompt, the number of requests), the same
        # in every engine and setup and in the alone run: the batch limits, and so the graphs
        # and the numerics, do not depend on which engine serves a request.
        longest, count = hints
        return serve.new_manager(self.model, options, [[1] * longest] * count)

    def setup(
        self, name: str, sizes: dict[str, Any], hints: tuple[int, int], keep: set[str], inbox: Any
    ) -> None:
        """Starts a manager for setup `name`, serves what arrives until `stop`, replies."""
        import extensible_kv.transformers as ekt
        from extensible_kv._demo import serve

        manager = sampler = results = None
        logs = _LogRecords()
        reply: dict[str, Any] = {"error": None}
        try:
            enable_setup(name, sizes, f"engine{self.index}")
            manager = self._new_manager(hints, setup_blocks(name, sizes))
            row = serve.Contender(name)
            serve._start_up(manager, row, self.device, extensible=True)
            manager.start()
            sampler = _Sampler(_kv_tensor(manager))
            reply["startup"] = {
                "blocks": row.blocks,
                "physical_bytes": sampler.bytes[0] if sampler.bytes else None,
                "startup_ms": row.startup_ms,
                "extend_ms": row.extend_ms,
            }
            results = _Results(manager, self.outbox, self.index, keep)
            self.free_bytes()  # the warm-up's transient memory, for the next engine's start
            self.outbox.put(("ready", self.index, reply["startup"]))
        except BaseException:
            reply["error"] = traceback.format_exc()
            self.outbox.put(("failed", self.index, reply["error"]))
        received: dict[str, float] = {}
        refused: dict[str, str] = {}
        while True:
            command, *rest = inbox.get()
            if command == "stop":
                break
            if command == "req" and manager is not None:
                rid, prompt, new_tokens = rest
                received[rid] = time.monotonic()
                try:
                    manager.add_request(
                        prompt, request_id=rid, max_new_tokens=new_tokens, streaming=True
                    )
                except Exception as error:  # the manager's loop died: the request is lost
                    refused[rid] = f"add_request: {error!r}"
        drained = results is not None and len(results.done) + len(refused) == len(received)
        try:
            if results is not None:
                results.stop()
                reply["requests"] = {
                    rid: {
                        "received": t,
                        "first": results.first.get(rid),
                        **results.done.get(rid, {}),
                        **({"error": refused[rid]} if rid in refused else {}),
                    }
                    for rid, t in received.items()
                }
            if sampler is not None:
                reply["memory"] = sampler.stop()
            if manager is not None:
                _stop(manager, hard=not drained)
        except BaseException:
            reply["error"] = (reply["error"] or "") + traceback.format_exc()
        finally:
            ekt.disable()
            reply["log"] = logs.close()
            reply["log_dropped"] = logs.dropped
            del manager, sampler, results
            self.free_bytes()  # empties torch's cache on a GPU
            reply["memfds_after"] = _memfds()
            # The device's free memory fell ~3 GiB a setup on the H200: which engine kept it,
            # and whether torch's allocator holds it (tensors past the model's, or cache).
            held = self._torch_memory()
            reply["torch_after"] = {
                "allocated_over_model": held["allocated"] - self.model_allocated,
                "reserved": held["reserved"],
            }
            self.outbox.put(("result", self.index, reply))

    def alone(
        self,
        hints: tuple[int, int],
        requests: list[tuple[str, list[int], int]],
        num_blocks: int | None = None,
        candidates: dict[str, dict[str, list[int]]] | None = None,
    ) -> None:
        """Each request alone on a manager with transformers' own KV cache: the reference;
        then every setup's tokens for them (`candidates`), and the reference's, scored by the
        model itself (`score`)."""
        import extensible_kv.transformers as ekt
        from extensible_kv._demo import serve

        ekt.disable()
        reply: dict[str, Any] = {"error": None, "tokens": {}}
        manager = None
        try:
            manager = self._new_manager(hints, num_blocks)
            serve._start_up(manager, serve.Contender("alone"), self.device, extensible=False)
            manager.start()
            for rid, prompt, new_tokens in requests:
                manager.add_request(prompt, request_id=rid, max_new_tokens=new_tokens)
                while True:
                    result = manager.get_result(timeout=120)
                    if result is None:
                        raise RuntimeError(f"no result for {rid} in 120 s")
                    if result.request_id == rid and result.is_finished():
                        break
                if result.error is not None:
                    raise RuntimeError(f"{rid} failed: {result.error}")
                reply["tokens"][rid] = list(result.generated_tokens)
        except BaseException:
            reply["error"] = traceback.format_exc()
        finally:
            if manager is not None:
                _stop(manager, hard=False)
        if reply["error"] is None:
            try:
                scored = {**(candidates or {}), "alone": reply["tokens"]}
                reply["scores"] = self.score({rid: p for rid, p, _ in requests}, scored)
            except BaseException:
                reply["error"] = traceback.format_exc()
        self.outbox.put(("alone", self.index, reply))

    def score(
        self, prompts: dict[str, list[int]], candidates: dict[str, dict[str, list[int]]]
    ) -> dict[str, dict[str, Any]]:
        """Teacher forcing: one plain forward of the model (no KV cache, the whole sequence at
        once) over each request's prompt and the tokens a setup generated for it; each token
        is ranked among the logits for its own prefix (rank 0: the argmax) and its gap to the
        top logit taken. bf16 matmuls are not batch-invariant, so greedy tokens of differently
        batched runs of a random-weight model part early (near ties); but a token that came
        from wrong KV (another request's blocks, a stale or zeroed block) is not near the top
        for its true prefix. `control` shows that: the reference's tokens of each request
        scored after the next request's prompt, which is what a request reading another's
        blocks would have written. Per name: tokens, the share of argmax and of top 5, the
        largest gap (logits) and rank."""
        import torch

        rids = sorted(prompts)
        named = dict(candidates)
        alone = candidates.get("alone", {})
        named["control"] = {rid: alone[rid] for rid in rids if rid in alone and len(rids) > 1}
        out: dict[str, dict[str, Any]] = {}
        with torch.no_grad():
            for name, tokens in named.items():
                ranks: list[int] = []
                gaps: list[float] = []
                for i, rid in enumerate(rids):
                    if rid not in tokens or not tokens[rid]:
                        continue
                    prompt = prompts[rids[(i + 1) % len(rids)] if name == "control" else rid]
                    generated = tokens[rid]
                    ids = torch.tensor([prompt + generated[:-1]], device=self.device)
                    logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 :].float()
                    chosen = torch.tensor(generated, device=self.device).unsqueeze(1)
                    picked = logits.gather(1, chosen)
                    ranks += (logits > picked).sum(dim=1).tolist()
                    gaps += (logits.max(dim=1).values - picked.squeeze(1)).tolist()
                    del logits
                n = len(ranks)
                out[name] = {
                    "tokens": n,
                    "argmax": sum(r == 0 for r in ranks) / n if n else None,
                    "top5": sum(r < 5 for r in ranks) / n if n else None,
                    "max_gap": max(gaps, default=None),
                    "max_rank": max(ranks, default=None),
                }
        return out


def _stop(manager: Any, hard: bool) -> None:
    """Stops and destroys the manager; `hard` fails what it still has (a drain that ran out)."""
    import inspect

    kwargs = (
        {"hard_stop": True}
        if hard and "hard_stop" in inspect.signature(manager.stop).parameters
        else {}
    )
    manager.stop(block=True, **kwargs)
    manager.destroy()


def engine_main(index: int, config: dict[str, Any], inbox: Any, outbox: Any) -> None:
    """An engine process: loads its model, then runs the driver's commands until `quit`.
    SIGUSR1 prints every thread's stack to stderr (the driver sends it to an engine that
    does not answer in time)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        engine = _Engine(index, config, outbox)
        outbox.put(("loaded", index, engine.info()))
        while True:
            command, *rest = inbox.get()
            if command == "quit":
                return
            if command == "setup":
                name, sizes, hints, keep = rest
                engine.setup(name, sizes, hints, set(keep), inbox)
            elif command == "alone":
                engine.alone(*rest)
            elif command == "probe":
                outbox.put(("probe", index, engine.free_bytes()))
            elif command == "stop":  # a setup this engine never started
                outbox.put(("result", index, {"error": "not set up"}))
    except BaseException:
        outbox.put(("crashed", index, traceback.format_exc()))


# ---------------------------------------------------------------------------------------------
# the driver


class Engines:
    """The three engine processes, a queue to each, and what they answered."""

    def __init__(self, config: dict[str, Any]) -> None:
        if config["device"].startswith("cuda"):
            # Spawned: the child of a fork server whose imports initialized CUDA (transformers'
            # may ask torch for devices) could not use it.
            ctx = mp.get_context("spawn")
        else:  # forks of one server that imported torch and transformers once: seconds saved
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["torch", "transformers", "extensible_kv.transformers"])
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(ENGINES)]
        self.processes = [
            ctx.Process(
                target=engine_main,
                args=(i, config, self.inboxes[i], self.outbox),
                name=f"bench_pool engine {i}",
                daemon=True,
            )
            for i in range(ENGINES)
        ]
        self.lock = threading.Condition()
        self.answers: dict[tuple[str, int], Any] = {}
        self.done: dict[str, float] = {}
        self.crashed: dict[int, str] = {}
        for process in self.processes:
            process.start()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                kind, index, payload = self.outbox.get()
            except (EOFError, OSError):
                return
            if kind == "closed":
                return
            with self.lock:
                if kind == "done":
                    self.done[payload] = time.monotonic()
                elif kind == "crashed":
                    self.crashed[index] = payload
                else:
                    self.answers[(kind, index)] = payload
                self.lock.notify_all()

    def send(self, index: int, *message: Any) -> None:
        self.inboxes[index].put(message)

    def wait(self, kinds: tuple[str, ...], indices: list[int], timeout_s: float) -> dict[int, Any]:
        """Each engine's first answer of one of `kinds` (taken off), within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        got: dict[int, Any] = {}
        with self.lock:
            while True:
                for index in indices:
                    for kind in kinds:
                        if index not in got and (kind, index) in self.answers:
                            got[index] = (kind, self.answers.pop((kind, index)))
                if len(got) == len(indices):
                    return got
                dead = [i for i in indices if i in self.crashed or not self.processes[i].is_alive()]
                if dead:
                    why = "; ".join(self.crashed.get(i, "exited")[-2000:] for i in dead)
                    raise RuntimeError(f"engine(s) {dead} died: {why}")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [i for i in indices if i not in got]
                    for i in missing:  # where they are stuck, on stderr
                        pid = self.processes[i].pid
                        if pid is not None and self.processes[i].is_alive():
                            log(f"engine {i} (pid {pid}) did not answer: its threads' stacks")
                            os.kill(pid, signal.SIGUSR1)
                    time.sleep(1.0)
                    raise TimeoutError(f"engines {missing} did not answer {kinds} in {timeout_s} s")
                self.lock.wait(min(left, 1.0))

    def close(self) -> None:
        for i, process in enumerate(self.processes):
            if process.is_alive():
                self.send(i, "quit")
        for process in self.processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
        self.outbox.put(("closed", -1, None))
        self.reader.join(10)


class LedgerWatcher:
    """Reads the pool's ledger file every `LEDGER_POLL_S` (no lock: a write is a rename) and
    keeps every event it has not seen, and each engine's name and pid."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.events: list[tuple[float, str]] = []
        self.seen: set[tuple[float, str]] = set()
        self.engines: dict[str, dict[str, int]] = {}
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
    index: int, reply: dict[str, Any], mine: list[Request], t0: float, unit: int
) -> dict[str, Any]:
    """One engine's figures in one setup (see the module's docstring)."""
    got = reply.get("requests", {})
    ttft, e2e, tokens, finishes = [], [], 0, []
    completed = 0
    for request in mine:
        row = got.get(request.rid, {})
        arrival = t0 + request.arrival_s
        if row.get("finish") is None or row.get("error"):
            continue
        completed += 1
        tokens += row["n_tokens"]
        finishes.append(row["finish"])
        e2e.append((row["finish"] - arrival) * 1e3)
        if row.get("first") is not None:
            ttft.append((row["first"] - arrival) * 1e3)
    memory = reply.get("memory", {"t": [], "bytes": []})
    trace = [(t, b) for t, b in zip(memory["t"], memory["bytes"], strict=True) if t >= t0]
    levels = [b for _, b in trace] or memory["bytes"][-1:] or [0]
    busy = (max(finishes) - (t0 + mine[0].arrival_s)) if finishes and mine else 0.0
    return {
        "engine": index,
        "requests": len(mine),
        "completed": completed,
        "errors": [row["error"] for row in got.values() if row.get("error")][:5],
        "ttft_ms": percentiles(ttft),
        "e2e_ms": percentiles(e2e),
        "tokens": tokens,
        "tokens_per_s": tokens / busy if busy > 0 else 0.0,
        "busy_s": busy,
        "kv_peak": max(levels) / unit,
        "kv_mean": _time_mean(memory, t0) / unit,
        "grown_bytes": _growth(memory, t0),
        "memory": {
            "t": [round(t - t0, 4) for t in memory["t"]],
            "bytes": memory["bytes"],
            "samples": memory.get("samples", 0),
        },
        "startup": reply.get("startup"),
        "memfds_after": reply.get("memfds_after"),
        "torch_after": reply.get("torch_after"),
        "log": [[round(t - t0, 4), name, text] for t, name, text in reply.get("log", [])],
        "log_dropped": reply.get("log_dropped", 0),
        "error": reply.get("error"),
    }


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


def run_setup(
    engines: Engines,
    name: str,
    sizes: dict[str, Any],
    requests: list[Request],
    keep: list[str],
    pids: dict[int, int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One setup: managers started, the trace sent at its times, drained, stopped. `pids`:
    each engine's process, which names it in the ledger."""
    from extensible_kv.pool import Pool

    result: dict[str, Any] = {"ok": False, "error": None}
    pool = watcher = None
    if name in VIAS:
        pool = Pool(f"bench-pool-{os.getpid()}-{name}")
        pool.destroy()
        pool.set_cap(args.device, sizes["share_bytes"])
        sizes = {**sizes, "pool": pool.name}
        watcher = LedgerWatcher(pool)
    try:
        replies, t0 = _serve(engines, name, sizes, requests, keep, args, result, pool)
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
    indices = list(range(ENGINES))
    block_bytes = {n: e["block_bytes"] for n, e in watcher.engines.items()} if watcher else {}
    result["device_free_after"] = device_free(engines, sizes)
    errors = {i: reply["error"] for i, reply in replies.items() if reply.get("error")}
    errors.update(result.pop("failed_to_start"))
    if errors:
        result["error"] = "\n".join(f"engine {i}: {e}" for i, e in sorted(errors.items()))
    result["engines"] = [
        engine_summary(i, replies[i], [r for r in requests if r.engine == i], t0, sizes["unit"])
        for i in indices
    ]
    result["total"] = _total(result["engines"], requests, replies, t0)
    result["total"]["kv_total_peak_bytes"] = peak_of_sum(
        [replies[i].get("memory", {"t": [], "bytes": []}) for i in indices]
    )
    rows = [
        (rid, row) for reply in replies.values() for rid, row in reply.get("requests", {}).items()
    ]
    ok_rows = [(rid, row) for rid, row in rows if row.get("sha") and not row.get("error")]
    result["tokens"] = {rid: row["sha"] for rid, row in ok_rows}
    result["kept_tokens"] = {rid: row["tokens"] for rid, row in ok_rows if "tokens" in row}
    events = watcher.events if watcher is not None else []
    loans = loans_from_events(events, block_bytes, sizes["block_bytes"], t0)
    by_pid = {pid: index for index, pid in pids.items()}
    names = watcher.engines if watcher is not None else {}
    seen_in_memory(
        loans,
        {
            n: result["engines"][by_pid[e["pid"]]]["memory"]
            for n, e in names.items()
            if e["pid"] in by_pid
        },
        t0,
    )
    result["loans"] = loans
    for key in ("latency_ms", "seen_ms"):
        result[f"loan_{key}"] = percentiles([loan[key] for loan in loans if loan[key] is not None])
    result["pool_moved_bytes"] = sum(loan["bytes"] for loan in loans)
    result["grown_bytes"] = sum(e["grown_bytes"] for e in result["engines"])
    result["ok"] = not errors
    return result


def _serve(
    engines: Engines,
    name: str,
    sizes: dict[str, Any],
    requests: list[Request],
    keep: list[str],
    args: argparse.Namespace,
    result: dict[str, Any],
    pool: Any,
) -> tuple[dict[int, dict[str, Any]], float]:
    """Starts the setup in every engine, sends the trace, stops them: their replies, and the
    trace's start."""
    from extensible_kv.pool import rules

    indices = list(range(ENGINES))
    result["device_free_before"] = device_free(engines, sizes)
    hints = (
        max(len(r.prompt) for r in requests),
        max(Counter(r.engine for r in requests).values()),
    )
    # One engine at a time: transformers' warm-up holds transient memory (its largest
    # prefill's attention scores, sized by the cache it finds), which the next engine's commit
    # must not meet; each engine empties torch's cache once it serves.
    ready: dict[int, Any] = {}
    for i in indices:
        engines.send(i, "setup", name, sizes, hints, keep)
        ready.update(engines.wait(("ready", "failed"), [i], args.ready_timeout_s))
    result["failed_to_start"] = {i: p for i, (kind, p) in ready.items() if kind == "failed"}
    t0 = time.monotonic() + 0.5
    if not result["failed_to_start"]:
        log(f"{name}: engines ready, trace of {len(requests)} requests")
        send_trace(engines, requests, t0, args.drain_s, result)
    if pool is not None:
        with pool.transaction() as ledger:
            result["ledger_problems_before_stop"] = rules.check(ledger)
    for i in indices:
        engines.send(i, "stop")
    answers = engines.wait(("result",), indices, args.stop_timeout_s)
    return {i: reply for i, (_, reply) in answers.items()}, t0


def send_trace(
    engines: Engines, requests: list[Request], t0: float, drain_s: float, result: dict[str, Any]
) -> None:
    """Sends each request to its engine at its arrival time, then waits up to `drain_s` after
    the last arrival for every result."""
    with engines.lock:
        engines.done.clear()  # the last setup's (every setup has the same request ids)
    for request in requests:
        delay = t0 + request.arrival_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        engines.send(request.engine, "req", request.rid, request.prompt, request.new_tokens)
    last = time.monotonic()
    result["send_late_s"] = last - (t0 + requests[-1].arrival_s)
    wanted = {r.rid for r in requests}
    with engines.lock:
        while not wanted <= engines.done.keys() and time.monotonic() < last + drain_s:
            engines.lock.wait(0.1)
        result["drained"] = wanted <= engines.done.keys()
    result["drain_s"] = time.monotonic() - last


def device_free(engines: Engines, sizes: dict[str, Any]) -> int | None:
    """The device's free bytes, as engine 0 sees them once its torch cache is emptied (a GPU
    only: the host's free memory moves with everything else on the machine)."""
    if not sizes["gpu"]:
        return None
    engines.send(0, "probe")
    return int(engines.wait(("probe",), [0], 60)[0][1])


def _total(
    rows: list[dict[str, Any]], requests: list[Request], replies: dict[int, Any], t0: float
) -> dict[str, Any]:
    ttft, e2e, finishes = [], [], []
    arrival = {r.rid: t0 + r.arrival_s for r in requests}
    for reply in replies.values():
        for rid, row in reply.get("requests", {}).items():
            if row.get("finish") is None or row.get("error"):
                continue
            finishes.append(row["finish"])
            e2e.append((row["finish"] - arrival[rid]) * 1e3)
            if row.get("first") is not None:
                ttft.append((row["first"] - arrival[rid]) * 1e3)
    tokens = sum(r["tokens"] for r in rows)
    busy = max(finishes) - (t0 + requests[0].arrival_s) if finishes else 0.0
    return {
        "requests": len(requests),
        "completed": sum(r["completed"] for r in rows),
        "ttft_ms": percentiles(ttft),
        "e2e_ms": percentiles(e2e),
        "tokens": tokens,
        "tokens_per_s": tokens / busy if busy > 0 else 0.0,
    }


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
            "differ": differ,
            "first_difference": {rid: _first_difference(kept[rid], alone[rid]) for rid in differ},
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


# ---------------------------------------------------------------------------------------------
# the report


def _ms(p: dict[str, Any], key: str) -> str:
    value = p.get(key)
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _last_line(error: str | None) -> str:
    lines = [line for line in (error or "").splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


def report(results: dict[str, Any]) -> str:
    settings, setups = results["settings"], results["setups"]
    unit, per = settings["unit_name"], GIB if settings["unit_name"] == "GiB" else MIB
    lines = [
        f"### Three engines, bursty trace ({results['environment'].get('shape', '')})",
        "",
        f"KV memory in all: {settings['total_kv']:.2f} {unit} (static: "
        f"{settings['static_kv']:.2f} each; pool: {settings['min_blocks']} to "
        f"{settings['max_blocks']} blocks of {settings['block_bytes'] / MIB:.3g} MiB, share "
        f"{settings['share_kv']:.2f}); {settings['requests']} requests, bursts of "
        f"{settings['burst_requests']} in {settings['burst_s']} s every {settings['period_s']} s, "
        f"{settings['new_tokens']} tokens each",
        "",
        f"| setup | engine | completed | TTFT p50 (ms) | TTFT p99 (ms) | e2e p50 (ms) | "
        f"e2e p99 (ms) | tokens/s | KV mean ({unit}) | KV peak ({unit}) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, res in setups.items():
        if "engines" not in res:
            lines.append(f"| {name} | failed: {_last_line(res.get('error'))} | | | | | | | | |")
            continue
        total = res["total"]
        for row in [*res["engines"], {**total, "engine": "all"}]:
            mean = row.get("kv_mean", sum(e["kv_mean"] for e in res["engines"]))
            peak = row.get("kv_peak", total["kv_total_peak_bytes"] / per)
            lines.append(
                f"| {name} | {row['engine']} | {row['completed']}/{row['requests']} | "
                f"{_ms(row['ttft_ms'], 'p50')} | {_ms(row['ttft_ms'], 'p99')} | "
                f"{_ms(row['e2e_ms'], 'p50')} | {_ms(row['e2e_ms'], 'p99')} | "
                f"{row['tokens_per_s']:.0f} | {mean:.2f} | {peak:.2f} |"
            )
    lines += [
        "",
        f"| setup | memory moved in ({unit}) | asked | answered: borrowed / released / refused "
        f"| moved by the pool ({unit}) | ask to the needy engine p50 / p99 / max (ms) | seen in "
        "its memory p50 / p99 (ms) | events maybe lost | ledger problems | left in ledger | "
        "memfds after |",
        "|---|---:|---:|---|---:|---|---|---:|---:|---|---|",
    ]
    for name, res in setups.items():
        if "engines" not in res:
            continue
        lat, seen, ledger = res["loan_latency_ms"], res["loan_seen_ms"], res.get("ledger")
        answers = Counter(loan["answer"] for loan in res["loans"])
        problems = len(res.get("ledger_problems_before_stop", [])) if ledger else "-"
        left = "-"
        if ledger:
            left = f"{len(ledger['engines_left'])} engines, {ledger['loans_left']} loans"
        lines.append(
            f"| {name} | {res['grown_bytes'] / per:.3f} | {len(res['loans'])} | "
            f"{answers['borrowed']} / {answers['released']} / {answers['refused']} | "
            f"{res['pool_moved_bytes'] / per:.3f} | {_ms(lat, 'p50')} / {_ms(lat, 'p99')} / "
            f"{_ms(lat, 'max')} | {_ms(seen, 'p50')} / {_ms(seen, 'p99')} | "
            f"{ledger['events_maybe_lost'] if ledger else '-'} | {problems} | {left} | "
            f"{[e['memfds_after'] for e in res['engines']]} |"
        )
    lines.append("")
    for name, res in setups.items():
        kept = [e.get("torch_after") for e in res.get("engines", [])]
        if settings.get("gpu") and any(kept):
            lines.append(
                f"torch after {name}'s teardown, per engine (MiB allocated past the model / "
                f"reserved): "
                + ", ".join(
                    f"{k['allocated_over_model'] / MIB:.0f} / {k['reserved'] / MIB:.0f}"
                    for k in kept
                    if k
                )
            )
    identical = results.get("identical", {})
    for name, row in identical.get("alone", {}).items():
        lines.append(
            f"identical to the same requests run alone, {name}: {row['identical']}/"
            f"{row['compared']} (of a sample of {row['sample']})"
        )
    for pair, row in identical.get("cross", {}).items():
        lines.append(f"identical, {pair}: {row['identical']}/{row['compared']}")
    scores = (results.get("alone") or {}).get("scores")
    if scores:
        lines += [
            "",
            "Each sampled request's tokens scored by the model itself (one forward over prompt "
            "and tokens, no KV cache): where each token ranks among the logits for its prefix "
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
    for name in VIAS:
        other = setups.get(name, {}).get("total")
        if static and other and other["ttft_ms"]["n"] and static["ttft_ms"]["n"]:
            ratio = static["ttft_ms"]["p99"] / other["ttft_ms"]["p99"]
            lines.append(
                f"TTFT p99 static / {name}: {ratio:.2f} (completed {static['completed']} vs "
                f"{other['completed']})"
            )
    for name, res in setups.items():
        if res.get("error"):
            lines.append(f"{name} failed: {_last_line(res['error'])}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def sizes_for(args: argparse.Namespace, info: dict[str, Any], gpu: bool) -> dict[str, Any]:
    """The setups' memory: the same total in each (see the module's docstring)."""
    unit = GIB if gpu else MIB
    block = info["block_bytes"]
    total = int(args.kv_gib * unit)
    static = total // ENGINES
    share = ENGINES * static
    min_blocks = max(1, math.ceil(args.min_gib * unit / block))
    granule = args.granularity or 2 * MIB
    # What an engine holds beside its blocks: transformers' two trash sectors, and up to a
    # granule of rounding.
    beside = 2 * block + granule
    max_blocks = (share - (ENGINES - 1) * (min_blocks * block + beside) - beside) // block
    if max_blocks < min_blocks:
        raise SystemExit(f"--kv-gib {args.kv_gib} leaves no room above --min-gib {args.min_gib}")
    return {
        "gpu": gpu,
        "unit": unit,
        "block_bytes": block,
        "total_bytes": total,
        "static_bytes": static,
        "share_bytes": share,
        "min_blocks": min_blocks,
        "max_blocks": max_blocks,
        "granularity": args.granularity,
        "step_blocks": args.step_blocks,
    }


HOST_DEFAULTS: dict[str, Any] = {
    "kv_gib": 0.75,
    "min_gib": 0.0625,
    "granularity": 16 << 10,  # two blocks of the host's model: loans of a few blocks
    "burst_requests": 24,
    "burst_s": 0.1,
    "period_s": 1.5,
    "rounds": 1,
    "lead_s": 0.2,
    "trickle_per_s": 1.0,
    "min_prompt": 8,
    "max_prompt": 64,
    "new_tokens": 16,
    "max_batch_tokens": 64,
    "drain_s": 30.0,
    "check_requests": 2,
    "ready_timeout_s": 120.0,
}
# On a GPU (estimates; the first H200 run, at 36 GiB and bursts of 128 requests of 256 tokens,
# served 36 of 398 requests: each engine's transformers read for 1,121-2,321 blocks, see
# `_new_manager`, and its sdpa path computes every decode step's attention over the batch's
# gathered keys, 175 ms a step at ~128 requests there). Here a burst's KV (48 requests of
# ~290 + 128 tokens, ~20k tokens of 128 KiB) is above the static third (2 GiB: ~15.9k tokens
# past the trash), so there a burst's last requests wait for its first ones' 128 steps, while
# a pool engine may grow to ~4.8 GiB (~39k tokens). A burst is served before the next engine's
# (the H100 run at 256 tokens and 15 s: its requests took ~40 s, so every burst overlapped the
# one before and each engine needed its memory at once: nothing to lend). One round: each
# setup ~2 minutes.
GPU_DEFAULTS: dict[str, Any] = {
    "kv_gib": 6.0,
    "min_gib": 0.5,
    "granularity": None,
    "burst_requests": 48,
    "burst_s": 1.0,
    "period_s": 28.0,
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
    "drain_s": 60.0,
    "check_requests": 3,
    "ready_timeout_s": 300.0,
}


# What each per-device option means; its defaults are GPU_DEFAULTS' and HOST_DEFAULTS'.
PER_DEVICE = {
    "kv_gib": (float, "KV memory in all setups' engines together (MiB on the host)"),
    "min_gib": (float, "a pool engine's minimum (MiB on the host)"),
    "granularity": (int, "the caches' granule in bytes (the device's when unset)"),
    "burst_requests": (int, "requests in a burst"),
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
    "check_requests": (int, "requests of each engine run alone, for the tokens"),
    "ready_timeout_s": (float, "for the engines to load, or to start a setup"),
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_pool"))
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (a tiny model, MiB)")
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS + MORE_SETUPS)
    parser.add_argument("--layers", type=int, help="the model's layers (the shape's by default)")
    for key, (kind, what) in PER_DEVICE.items():
        parser.add_argument(
            "--" + key.replace("_", "-"),
            type=kind,
            help=f"{what} (GPU {GPU_DEFAULTS[key]}, host {HOST_DEFAULTS[key]})",
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
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    gpu = args.device.startswith("cuda")
    unit = GIB if gpu else MIB
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_pool.json"
    config = {
        "device": args.device,
        "layers": args.layers,
        "new_tokens": args.new_tokens,
        "max_batch_tokens": args.max_batch_tokens,
        "num_blocks": None,
    }
    if not gpu:
        # The host has no device memory to size the cache from: the most an engine may hold
        # caps every setup's cache (and transformers' read buffers with it).
        block = _host_block_bytes(args)
        config["num_blocks"] = sizes_for(args, {"block_bytes": block}, gpu)["max_blocks"]
    start = time.monotonic()
    engines = Engines(config)
    try:
        loaded = engines.wait(("loaded",), list(range(ENGINES)), args.ready_timeout_s)
        info = loaded[0][1]
        pids = {index: answer[1]["pid"] for index, answer in loaded.items()}
        log(f"engines loaded in {time.monotonic() - start:.1f} s: {info['shape']}")
        sizes = sizes_for(args, info, gpu)
        if config["num_blocks"] is not None and config["num_blocks"] != sizes["max_blocks"]:
            raise RuntimeError(f"block bytes {info['block_bytes']} != the host's estimate")
        bursts, requests = make_trace(args, info["vocab"])
        sample = check_sample(requests, args.check_requests, args.seed)
        keep = [r.rid for r in sample]
        results: dict[str, Any] = {
            "environment": {k: v for k, v in info.items() if k not in ("pid", "vocab")},
            "settings": {
                **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                **{k: v for k, v in sizes.items() if k != "unit"},
                "unit_name": "GiB" if gpu else "MiB",
                "total_kv": sizes["total_bytes"] / unit,
                "static_kv": sizes["static_bytes"] / unit,
                "share_kv": sizes["share_bytes"] / unit,
                "requests": len(requests),
                "sample_s": SAMPLE_S,
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
        for name in args.setups:
            log(f"setup {name}")
            try:
                results["setups"][name] = run_setup(
                    engines, name, sizes, requests, keep, pids, args
                )
            except (RuntimeError, TimeoutError) as error:
                results["setups"][name] = {"ok": False, "error": str(error)}
                log(f"{name} failed: {error}")
                # An engine that did not answer in time answers nothing later either.
                stuck = isinstance(error, TimeoutError)
                if stuck or any(not p.is_alive() for p in engines.processes):
                    break
            if results["setups"][name].get("error"):
                log(f"{name}: {results['setups'][name]['error'][-3000:]}")
            path.write_text(json.dumps(results, indent=1, default=str))
        alone = None
        if not stuck and all(p.is_alive() for p in engines.processes):
            log(f"alone: {len(sample)} requests one at a time on engine 0, transformers' own cache")
            hints = (
                max(len(r.prompt) for r in requests),
                max(Counter(r.engine for r in requests).values()),
            )
            engines.send(
                0,
                "alone",
                hints,
                [(r.rid, r.prompt, r.new_tokens) for r in sample],
                sizes["max_blocks"],
                {
                    name: setup.get("kept_tokens", {})
                    for name, setup in results["setups"].items()
                    if setup.get("ok")
                },
            )
            answer = engines.wait(("alone",), [0], args.ready_timeout_s + 300)[0][1]
            results["alone"] = {
                "error": answer["error"],
                "tokens": answer["tokens"],
                "scores": answer.get("scores"),
            }
            alone = answer["tokens"] if answer["error"] is None else None
        results["identical"] = compare_tokens(results["setups"], alone)
    finally:
        engines.close()
    path.write_text(json.dumps(results, indent=1, default=str))
    print(report(results))
    print(f"\nJSON: {path}")
    failed = [n for n, r in results["setups"].items() if not r.get("ok")]
    if failed or results.get("alone", {}).get("error"):
        log(f"failed: {failed or 'the alone run'}")
        return 1
    return 0


def _host_block_bytes(args: argparse.Namespace) -> int:
    """The demo's host model's block (`HOST_SHAPE`, float32, page 16), without loading it."""
    from extensible_kv._demo.serve import HOST_SHAPE

    layers = args.layers or HOST_SHAPE["num_hidden_layers"]
    head_dim = HOST_SHAPE["hidden_size"] // HOST_SHAPE["num_attention_heads"]
    return layers * 2 * HOST_SHAPE["num_key_value_heads"] * head_dim * 4 * 16


if __name__ == "__main__":
    sys.exit(main())
