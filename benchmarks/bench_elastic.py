"""Resizing a live KV cache under decode: the step times, the host time of each shrink and
release, and, end to end, transformers with the automatic resize policy against a fixed cache.

    python3 benchmarks/bench_elastic.py --out DIR [--device cuda:0] [--parts decode serve]

`decode` (one run, three phases, each `--phase-s` long): a decode loop replays a CUDA graph on
its own stream in one thread (an 8B-shaped attention step: 32 layers, 8 KV heads of 128, bf16,
`--batch` sequences of `--context` tokens, over the first bytes of the cache) and waits for
each step, as an engine does before it samples. Meanwhile another thread grows the same
reservation by `--resize-gib` and shrinks it back, in steps of 1-8 GiB (seeded), giving the
decode stream to every shrink:
- `quiet`: no resizing;
- `ours`: the shrinks return at once, the memory going back from the tensor's release thread
  once the decode stream has passed the shrink (`src/tensor/release.rs`);
- `synchronize`: what the peers do: a device synchronize before each shrink;
- `rated`: ours with the tensor's `driver_rate` at `--driver-rate-gib` GiB/s: the grows create
  and the release thread releases one handle at a time at that rate, so that the driver's
  work for them, spread thin, does not slow the steps (at `7fd8a0d`, as `release_rate`, it
  paced the releases only); `--handle-mib` sets the handles' size for every phase (default:
  the library's 1 GiB).
`--phases` picks phases by name (default: these four, and with `--diagnose` the ones below).
With `--diagnose`, five phases more, to say what slows the steps while resizing (both `ours`
and `synchronize` did, alike): `elsewhere` (ours, on a second reservation the loop never
reads), `python` (the resizing thread's Python and GIL traffic, a native getter in a loop, no
driver call: a worst case for the GIL), `paced` (ours, 50 ms between calls) and `remap` (a
second reservation of `--resize-gib`, committed, lending all of it to itself and reclaiming
it: unmaps and maps of the same handles, none created or released), `trickle` (ours in
steps of `--trickle-mib`, `--trickle-gap-ms` after each call: the same create and release
at a bounded rate), `trickle-grows` / `trickle-shrinks` (the pause after grows / shrinks
only) and `small-grows` / `small-grows-rated` (grows of `--trickle-mib` a call, back to back;
shrinks of 1-8 units; the second with `rated`'s driver rate).
Reported: the step time p50 / p99 / max per phase (on the host's clock, launch to the
stream's end as the engine sees it, and on a GPU also the device's own, CUDA events around
the replay: what the GPU was slowed by, apart from the host), the host time of every grow and shrink
call, how long after a shrink returned its memory was released (and, on a GPU, after the
stream's last use of it: an event recorded after the shrink, seen complete), and the host time of a
`release_physical` of `--resize-gib` under the loop, and, with the loop stopped, the
driver's own time to give back shrinks of 1, 2, 4 and 8 GiB: the least a release can lag
(beside which the lag per GiB under decode reads). The grows do not zero (paged KV is
written before it is read; vLLM does not zero its cache either): `--zero` zeroes them.

`serve`: transformers' continuous batching (random-weight model from a config, 8B-shaped on a
GPU) on a bursty trace: `--bursts` bursts of requests of mixed length, idle gaps between them.
Twice: with `AutoResize` (grow on demand, shrink to its floor after `--idle-s`), then with a
fixed cache of the peak the first run reached (`--repeats N`: N such pairs in turn, the
tokens/s ratio over all of them, so that a drift of the machine falls on both). Reported:
mean and peak KV memory over the trace (sampled every 10 ms), tokens/s over the bursts, and
whether the tokens are identical.

Markdown on stdout, DIR/bench_elastic.json. On the host backend (`--device cpu`) sizes are
MiB and the model is tiny: a quick end-to-end run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import GIB, MIB, environment, log

KV_HEADS, HEAD_DIM, LAYERS, Q_HEADS = 8, 128, 32, 32


def _live_bytes(gpu: bool, batch: int, context: int) -> int:
    """The K and V of every layer the decode step reads (bf16 on a GPU, float32 on the host)."""
    layers, itemsize = (LAYERS, 2) if gpu else (2, 4)
    return 2 * layers * batch * KV_HEADS * context * HEAD_DIM * itemsize


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"n": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0, "mean_ms": 0.0}

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "n": len(ordered),
        "p50_ms": at(0.50),
        "p99_ms": at(0.99),
        "max_ms": ordered[-1],
        "mean_ms": statistics.fmean(ordered),
    }


class DecodeLoop:
    """An attention step over the cache's first bytes, replayed (a CUDA graph on a GPU) on its
    own stream by a thread that waits for every step; step times are filed under the phase
    set at the time."""

    def __init__(self, tensor: Any, batch: int, context: int) -> None:
        import torch

        self.device = torch.device(tensor.device)
        self.gpu = self.device.type == "cuda"
        dtype = torch.bfloat16 if self.gpu else torch.float32
        layers = LAYERS if self.gpu else 2
        shape = (batch, KV_HEADS, context, HEAD_DIM)
        per = batch * KV_HEADS * context * HEAD_DIM * dtype.itemsize
        self.live_bytes = _live_bytes(self.gpu, batch, context)
        tensor.resize_(self.live_bytes, zero_new=True)
        kv = [tensor.view(dtype, shape, offset=i * per) for i in range(2 * layers)]
        self.stream = torch.cuda.Stream(self.device) if self.gpu else None
        q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device=self.device, dtype=dtype)
        for view in kv:
            view.normal_()
        self.out = torch.zeros_like(q)

        def step() -> None:
            acc = self.out
            acc.zero_()
            for layer in range(layers):
                k, v = kv[2 * layer], kv[2 * layer + 1]
                acc += torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        self._step = step
        self.graph: Any = None
        if self.gpu:
            assert self.stream is not None
            with torch.cuda.stream(self.stream):
                for _ in range(3):
                    step()
                self.stream.synchronize()
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, stream=self.stream):
                    step()
        self.phase = "warm-up"
        self.times: dict[str, list[float]] = {}
        # The device's own time of each replay (CUDA events around it): a step slowed on the
        # GPU (page tables, the copy engines) shows here, one slowed on the host (the GIL, a
        # CPU) only in `times`.
        self.device_times: dict[str, list[float]] = {}
        self.running = True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    @property
    def raw_stream(self) -> int | None:
        return None if self.stream is None else int(self.stream.cuda_stream)

    def _loop(self) -> None:
        import torch

        context = torch.cuda.stream(self.stream) if self.gpu else contextlib.nullcontext()
        with context:
            began = torch.cuda.Event(enable_timing=True) if self.gpu else None
            ended = torch.cuda.Event(enable_timing=True) if self.gpu else None
            while self.running:
                start = time.perf_counter()
                if self.graph is not None:
                    assert self.stream is not None and began is not None and ended is not None
                    began.record(self.stream)
                    self.graph.replay()
                    ended.record(self.stream)
                    self.stream.synchronize()
                else:
                    self._step()
                took = (time.perf_counter() - start) * 1e3
                phase = self.phase
                self.times.setdefault(phase, []).append(took)
                if began is not None and ended is not None:
                    self.device_times.setdefault(phase, []).append(began.elapsed_time(ended))

    def stop(self) -> None:
        self.running = False
        self.thread.join()


def _steps_bytes(
    total: int, unit: int, rng: random.Random, multiples: tuple[int, ...] = (1, 2, 4, 8)
) -> list[int]:
    """Steps of 1, 2, 4 or 8 units (seeded; or of `multiples`) that sum to `total`."""
    steps, left = [], total
    while left > 0:
        step = min(left, rng.choice(multiples) * unit)
        steps.append(step)
        left -= step
    return steps


def _resize_cycles(
    tensor: Any,
    loop: DecodeLoop,
    base_bytes: int,
    resize_bytes: int,
    unit: int,
    until: float,
    synchronize: bool,
    zero: bool,
    rng: random.Random,
    pause_s: float | tuple[float, float] = 0.0,
    multiples: tuple[int, ...] = (1, 2, 4, 8),
    grow_unit: int | None = None,
) -> dict[str, list[float]]:
    """Grows `tensor` from `base_bytes` by `resize_bytes` and shrinks it back, in 1-8 `unit`
    steps (or `multiples` of it; grows in steps of `grow_unit` if given), until `until`,
    sleeping `pause_s` after each call (or a pair: after each grow, after each shrink)."""
    import torch

    calls: dict[str, list[float]] = {
        "grow_ms": [],
        "shrink_ms": [],
        "released_after_ms": [],
        "released_after_last_use_ms": [],
        "released_per_gib_ms": [],  # the lag after the last use over the step's GiB
    }
    per_gib = GIB if loop.gpu else MIB  # the host backend's sizes are MiB
    pause_grow_s, pause_shrink_s = pause_s if isinstance(pause_s, tuple) else (pause_s, pause_s)
    own = torch.cuda.Stream(loop.device) if loop.gpu else None
    context = torch.cuda.stream(own) if own is not None else contextlib.nullcontext()
    with context:
        while time.monotonic() < until:
            size = base_bytes
            grows = (
                _steps_bytes(resize_bytes, unit, rng, multiples)
                if grow_unit is None
                else _steps_bytes(resize_bytes, grow_unit, rng, (1,))
            )
            for step in grows:
                size += step
                start = time.perf_counter()
                tensor.resize_(size, zero_new=zero)
                calls["grow_ms"].append((time.perf_counter() - start) * 1e3)
                time.sleep(pause_grow_s)
            for step in _steps_bytes(resize_bytes, unit, rng, multiples):
                size -= step
                start = time.perf_counter()
                if synchronize and loop.gpu:
                    torch.cuda.synchronize(loop.device)
                tensor.shrink_(size, stream=loop.raw_stream)
                returned = time.perf_counter()
                calls["shrink_ms"].append((returned - start) * 1e3)
                last_use = returned
                if loop.gpu:
                    # The stream's last use of the memory: an event recorded after the shrink's
                    # own completes after it, and torch's synchronize spins without the GIL, so
                    # the host sees it within microseconds.
                    passed = torch.cuda.Event()
                    passed.record(loop.stream)
                    passed.synchronize()
                    last_use = time.perf_counter()
                # Blocks without the GIL (a poll here would take it from the decode thread
                # thousands of times a second and slow the steps it measures).
                tensor.wait_released()
                released = time.perf_counter()
                calls["released_after_ms"].append((released - returned) * 1e3)
                calls["released_after_last_use_ms"].append((released - last_use) * 1e3)
                calls["released_per_gib_ms"].append((released - last_use) * 1e3 * per_gib / step)
                time.sleep(pause_shrink_s)
    return calls


def _remap_cycles(tensor: Any, loop: DecodeLoop, until: float) -> dict[str, list[float]]:
    """Page-table work without the driver's allocator: `tensor` (committed, exporting POSIX
    fds) lends all its memory to itself and reclaims it, again and again: its handles are
    unmapped and mapped back, none created, scrubbed or released."""
    calls: dict[str, list[float]] = {"unmap_ms": [], "map_ms": []}
    while time.monotonic() < until:
        start = time.perf_counter()
        loan = tensor.lend(0, stream=loop.raw_stream)
        lent = time.perf_counter()
        tensor.reclaim(loan, zero=False, timeout=60, stream=loop.raw_stream)
        calls["unmap_ms"].append((lent - start) * 1e3)
        calls["map_ms"].append((time.perf_counter() - lent) * 1e3)
    return calls


def _python_only(tensor: Any, until: float) -> dict[str, list[float]]:
    """The resizing thread's Python side without its driver calls: a getter of the native
    tensor in a loop (the GIL taken and given back as the resize loop does)."""
    calls: dict[str, list[float]] = {"getter_ms": []}
    while time.monotonic() < until:
        start = time.perf_counter()
        for _ in range(100):
            tensor.physical_bytes  # noqa: B018 (the call is the point)
        calls["getter_ms"].append((time.perf_counter() - start) * 1e3 / 100)
    return calls


# `--diagnose`: what slows the decode steps while resizing (issue 36: the p99 was 1.09-1.14x
# quiet with and without a synchronize per shrink). `elsewhere`: ours, on a second
# reservation the decode loop does not read (its page tables untouched); `python`: the
# resizing thread's Python and GIL traffic without driver calls; `paced`: ours with 50 ms
# between calls, nearer an engine's rate than back to back; `remap`: page-table updates
# alone (the same handles unmapped and mapped back), without the driver's create and release;
# `trickle`: ours in steps of `--trickle-mib` with `--trickle-gap-ms` after each call, the
# same bytes created and released at a bounded rate (whether a scrub spread thin still
# shows in the steps); `trickle-grows` / `trickle-shrinks`: the same steps, the pause only
# after each grow / each shrink (whether the scrub that slows the steps follows the creates or
# the releases); `small-grows`: ours with every grow a call of `--trickle-mib`, back to back,
# the shrinks 1-8 units (whether a many-handle grow call is what slows the steps), and
# `small-grows-rated` the same with `rated`'s driver rate.
DIAGNOSE = (
    "elsewhere",
    "python",
    "paced",
    "remap",
    "trickle",
    "trickle-grows",
    "trickle-shrinks",
    "small-grows",
    "small-grows-rated",
)
PHASES = ("quiet", "ours", "synchronize", "rated")


def decode_part(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from extensible_kv import ExtensibleTensor, HandleSizing

    gpu = args.device.startswith("cuda")
    unit = GIB if gpu else MIB
    resize_bytes = int(args.resize_gib * unit)
    batch, context = (args.batch, args.context) if gpu else (2, 64)
    capacity = _live_bytes(gpu, batch, context) + resize_bytes + 2 * unit
    kw: dict[str, Any] = {} if gpu else {"granularity": 4096}
    sizing: dict[str, Any] = {}
    if args.handle_mib is not None:
        sizing["handle_sizing"] = HandleSizing("cap_aligned", int(args.handle_mib * unit / 1024))
    tensor = ExtensibleTensor(capacity, device=args.device, **kw, **sizing)
    loop = DecodeLoop(tensor, batch, context)
    rng = random.Random(args.seed)
    result: dict[str, Any] = {"live_bytes": loop.live_bytes, "resize_bytes": resize_bytes}
    phases = tuple(args.phases or PHASES + (DIAGNOSE if args.diagnose else ()))
    if "quiet" not in phases:
        phases = ("quiet", *phases)  # every ratio is to it
    elsewhere = (
        ExtensibleTensor(resize_bytes + 2 * unit, device=args.device, **kw)
        if args.diagnose
        else None
    )
    remap = None
    if args.diagnose:
        remap = ExtensibleTensor(
            resize_bytes, device=args.device, export_handle_types="posix_fd", **kw
        )
        remap.resize_(resize_bytes, zero_new=False)
    try:
        time.sleep(1.0)  # warm-up steps
        for phase in phases:
            log(f"decode: phase {phase} ({args.phase_s} s)")
            loop.phase = phase
            until = time.monotonic() + args.phase_s
            if phase == "quiet":
                time.sleep(args.phase_s)
                continue
            if phase == "python":
                result[phase] = _python_only(tensor, until)
                continue
            if phase == "remap":
                result[phase] = _remap_cycles(remap, loop, until)
                continue
            # `elsewhere` cycles the second reservation from empty; the others the decode
            # loop's, above the bytes it reads.
            target, base = (elsewhere, 0) if phase == "elsewhere" else (tensor, loop.live_bytes)
            trickle = phase.startswith("trickle")
            if phase in ("rated", "small-grows-rated"):
                tensor.driver_rate = int(args.driver_rate_gib * unit)
            small = int(args.trickle_mib * unit / 1024)
            gap_s = args.trickle_gap_ms / 1e3
            pause_s = {
                "paced": 0.05,
                "trickle": gap_s,
                "trickle-grows": (gap_s, 0.0),
                "trickle-shrinks": (0.0, gap_s),
            }.get(phase, 0.0)
            result[phase] = _resize_cycles(
                target,
                loop,
                base,
                resize_bytes,
                small if trickle else unit,
                until,
                phase == "synchronize",
                args.zero,
                rng,
                pause_s,
                (1,) if trickle else (1, 2, 4, 8),
                small if phase.startswith("small-grows") else None,
            )
            tensor.driver_rate = None
        loop.phase = "release"
        other = ExtensibleTensor(resize_bytes, device=args.device, **kw)
        other.resize_(resize_bytes, zero_new=False)
        time.sleep(0.2)
        start = time.perf_counter()
        other.release_physical(stream=loop.raw_stream)
        returned = time.perf_counter()
        other.wait_released()
        result["release_physical"] = {
            "bytes": resize_bytes,
            "call_ms": (returned - start) * 1e3,
            "released_after_ms": (time.perf_counter() - returned) * 1e3,
        }
        other.close()
    finally:
        loop.stop()
        if elsewhere is not None:
            elsewhere.close()
        if remap is not None:
            remap.close()
    result["idle_release"] = _idle_release(args, unit, kw, sizing, gpu)
    result["steps"] = {phase: _percentiles(times) for phase, times in loop.times.items()}
    result["device_steps"] = {p: _percentiles(t) for p, t in loop.device_times.items()}
    for phase in [p for p in phases if p != "quiet"]:
        calls = result.get(phase, {})
        result[f"{phase}_calls"] = {name: _percentiles(v) for name, v in calls.items()}
        result.pop(phase, None)
    del loop, tensor  # the loop's views hold the memory: it goes with them
    if gpu:
        torch.cuda.synchronize()
    return result


def _idle_release(
    args: argparse.Namespace, unit: int, kw: dict[str, Any], sizing: dict[str, Any], gpu: bool
) -> dict[str, Any]:
    """The driver's own time to give back each step size (1, 2, 4, 8 units) with the device
    idle, the decode loop stopped: how long after a shrink its memory can be released at
    the least (the unmaps and releases themselves), beside which the lag under decode reads.
    Median of 3 shrinks of each size."""
    import torch
    from extensible_kv import ExtensibleTensor

    sizes = [k * unit for k in (1, 2, 4, 8) if k * unit <= args.resize_gib * unit]
    tensor = ExtensibleTensor(max(sizes), device=args.device, **kw, **sizing)
    floor: dict[str, Any] = {}
    try:
        for size in sizes:
            lags = []
            for _ in range(3):
                tensor.resize_(size, zero_new=False)
                if gpu:
                    torch.cuda.synchronize(args.device)
                tensor.shrink_(0)
                returned = time.perf_counter()
                tensor.wait_released()
                lags.append((time.perf_counter() - returned) * 1e3)
            floor[str(size // unit)] = {"bytes": size, "released_after_ms": statistics.median(lags)}
    finally:
        tensor.close()
    return floor


def _bursts(args: argparse.Namespace, vocab: int, gpu: bool) -> list[list[list[int]]]:
    """`--bursts` bursts, each of 8-48 requests (4-12 on the host) of mixed prompt lengths."""
    rng = random.Random(args.seed)
    low, high = (64, 512) if gpu else (5, 40)
    counts = (8, 48) if gpu else (4, 12)
    return [
        [
            [rng.randrange(1, vocab) for _ in range(rng.randint(low, high))]
            for _ in range(rng.randint(*counts))
        ]
        for _ in range(args.bursts)
    ]


class _MemorySampler:
    """Samples the cache's physical bytes every 10 ms on a thread."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.samples: list[int] = []
        self.running = True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while self.running:
            self.samples.append(int(self.tensor.physical_bytes))
            time.sleep(0.01)

    def stop(self) -> dict[str, float]:
        self.running = False
        self.thread.join()
        return {
            "mean_gib": statistics.fmean(self.samples) / GIB,
            "peak_gib": max(self.samples) / GIB,
            "samples": len(self.samples),
        }


def _serve_once(
    model: Any, options: Any, bursts: list[list[list[int]]], args: argparse.Namespace, auto: bool
) -> dict[str, Any]:
    import extensible_kv.transformers as ekt
    from extensible_kv._demo import serve

    device = model.device
    enable: dict[str, Any] = {}
    if device.type != "cuda":
        enable["budget_bytes"] = (options.budget_mib or 64) * MIB
    if auto:
        enable["auto_resize"] = ekt.AutoResize(min_blocks=args.min_blocks, idle_s=args.idle_s)
    tokens: list[list[list[int]]] = []
    busy_s, generated = 0.0, 0
    with ekt.enabled(**enable):
        manager = serve.new_manager(model, options, [p for b in bursts for p in b])
        # The processor and the warm-up before start(), as the demo does (the cache exists,
        # and is extended, before the first request).
        serve._start_up(manager, serve.Contender("elastic"), device, extensible=True)
        manager.start()
        try:
            cache = manager.batch_processor.cache
            sampler = _MemorySampler(cache._ekv.tensor)
            blocks_seen = [int(cache.num_blocks)]
            for index, burst in enumerate(bursts):
                got, seconds, _ = serve.generate(manager, burst, options, f"burst {index}")
                tokens.append(got)
                busy_s += seconds
                generated += sum(map(len, got))
                blocks_seen.append(int(cache.num_blocks))
                if index + 1 < len(bursts):
                    time.sleep(args.gap_s)
                    blocks_seen.append(int(cache.num_blocks))
            memory = sampler.stop()
        finally:
            manager.stop(block=True)
            manager.destroy()
    return {
        "tokens": tokens,
        "tokens_per_s": generated / busy_s,
        "busy_s": busy_s,
        "blocks_seen": blocks_seen,
        "peak_blocks": max(blocks_seen),
        **memory,
    }


def serve_part(args: argparse.Namespace) -> dict[str, Any]:
    from extensible_kv._demo import serve

    options = serve.DemoOptions(
        device=args.device, new_tokens=args.new_tokens, progress=False
    ).resolved()
    model = serve.build_model(options)
    gpu = model.device.type == "cuda"
    bursts = _bursts(args, model.config.vocab_size, gpu)
    log(f"serve: {len(bursts)} bursts of {[len(b) for b in bursts]} requests, auto-resize")
    # Pairs run in turn (auto, then a fixed cache of its peak), so that a drift of the machine
    # over the run falls on both contenders; the ratio is of all pairs' tokens over their
    # busy time.
    pairs: list[dict[str, Any]] = []
    identical, fixed_options = True, None
    for pair in range(args.repeats):
        auto = _serve_once(model, options, bursts, args, auto=True)
        if fixed_options is None:  # every pair's fixed cache is of the first run's peak
            fixed_options = serve.DemoOptions(
                device=args.device,
                new_tokens=args.new_tokens,
                progress=False,
                num_blocks=auto["peak_blocks"],
            ).resolved()
        log(
            f"serve: fixed cache of {fixed_options.num_blocks} blocks "
            f"(pair {pair + 1} of {args.repeats})"
        )
        fixed = _serve_once(model, fixed_options, bursts, args, auto=False)
        identical = identical and auto.pop("tokens") == fixed.pop("tokens")
        pairs.append({"auto": auto, "fixed": fixed})

    def rate(name: str) -> float:
        runs = [p[name] for p in pairs]
        return sum(r["tokens_per_s"] * r["busy_s"] for r in runs) / sum(r["busy_s"] for r in runs)

    def mean_gib(name: str) -> float:
        return statistics.fmean(p[name]["mean_gib"] for p in pairs)

    return {
        "bursts": [len(b) for b in bursts],
        "auto": pairs[0]["auto"],
        "fixed": pairs[0]["fixed"],
        "pairs": pairs,
        "identical": identical,
        "mean_memory_saved": 1 - mean_gib("auto") / mean_gib("fixed"),
        "tokens_per_s_ratio": rate("auto") / rate("fixed"),
    }


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def _step_rows(steps: dict[str, dict[str, float]], count: bool) -> list[str]:
    """A table row per phase that ran: its step times and their ratios to the quiet phase's
    (with the number of steps if `count`)."""
    quiet, rows = steps["quiet"], []
    for phase in (*PHASES, *DIAGNOSE):
        s = steps.get(phase)
        if not s or not s["n"]:
            continue
        n = f" {s['n']} |" if count else ""
        rows.append(
            f"| {phase} |{n} {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | {s['max_ms']:.3f} | "
            f"{s['p99_ms'] / quiet['p99_ms']:.3f} | {s['max_ms'] / quiet['p50_ms']:.2f} |"
        )
    return rows


def report(results: dict[str, Any]) -> str:
    lines: list[str] = []
    decode = results.get("decode")
    if decode:
        lines += [
            "### Decode step while resizing (ms)",
            "| phase | steps | p50 | p99 | max | p99 / quiet p99 | max / quiet p50 |",
            "|---|---|---|---|---|---|---|",
            *_step_rows(decode["steps"], count=True),
        ]
        device = decode.get("device_steps") or {}
        if "quiet" in device:
            lines += [
                "",
                "### The same steps on the device's clock (CUDA events around each replay, ms)",
                "| phase | p50 | p99 | max | p99 / quiet p99 | max / quiet p50 |",
                "|---|---|---|---|---|---|",
                *_step_rows(device, count=False),
            ]
        lines += [
            "",
            "### Host time of each call (ms)",
            "| phase | call | n | p50 | p99 | max |",
            "|---|---|---|---|---|---|",
        ]
        for phase in (*PHASES[1:], *DIAGNOSE):
            for name, s in decode.get(f"{phase}_calls", {}).items():
                lines.append(
                    f"| {phase} | {name} | {s['n']} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | "
                    f"{s['max_ms']:.3f} |"
                )
        rel = decode["release_physical"]
        lines.append(
            f"| ours | release_physical of {rel['bytes'] / GIB:.2f} GiB | 1 | "
            f"{rel['call_ms']:.3f} | released {rel['released_after_ms']:.2f} ms after | |"
        )
        floor = decode.get("idle_release") or {}
        if floor:
            lines += [
                "",
                "### A shrink's memory released, after the stream's last use of it (ms)",
                "The driver's own time for the same sizes with the device idle (median of 3) "
                "is the least it can take: "
                + ", ".join(f"{k} units {v['released_after_ms']:.2f} ms" for k, v in floor.items())
                + " (a unit is a GiB on a GPU, a MiB on the host).",
                "",
                "| phase | n | p50 | p99 | max | p50 per unit | p99 per unit |",
                "|---|---|---|---|---|---|---|",
            ]
            for phase in (*PHASES[1:], *DIAGNOSE):
                calls = decode.get(f"{phase}_calls", {})
                lag, per = calls.get("released_after_last_use_ms"), calls.get("released_per_gib_ms")
                if lag and per:
                    lines.append(
                        f"| {phase} | {lag['n']} | {lag['p50_ms']:.2f} | {lag['p99_ms']:.2f} | "
                        f"{lag['max_ms']:.2f} | {per['p50_ms']:.2f} | {per['p99_ms']:.2f} |"
                    )
    serve = results.get("serve")
    if serve:
        a, f = serve["auto"], serve["fixed"]
        lines += [
            "",
            f"### Bursty trace ({serve['bursts']} requests per burst)",
            "| cache | mean KV GiB | peak KV GiB | tokens/s | blocks seen |",
            "|---|---|---|---|---|",
            f"| auto-resize | {a['mean_gib']:.3f} | {a['peak_gib']:.3f} | "
            f"{a['tokens_per_s']:.0f} | {a['blocks_seen']} |",
            f"| fixed | {f['mean_gib']:.3f} | {f['peak_gib']:.3f} | {f['tokens_per_s']:.0f} | "
            f"{f['blocks_seen']} |",
        ]
        for index, pair in enumerate(serve.get("pairs", [])[1:], start=2):
            a, f = pair["auto"], pair["fixed"]
            lines += [
                f"| auto-resize, pair {index} | {a['mean_gib']:.3f} | {a['peak_gib']:.3f} | "
                f"{a['tokens_per_s']:.0f} | {a['blocks_seen']} |",
                f"| fixed, pair {index} | {f['mean_gib']:.3f} | {f['peak_gib']:.3f} | "
                f"{f['tokens_per_s']:.0f} | {f['blocks_seen']} |",
            ]
        lines += [
            "",
            f"mean KV memory saved: {serve['mean_memory_saved']:.1%}; tokens/s auto / fixed: "
            f"{serve['tokens_per_s_ratio']:.3f}; identical: {_yes(serve['identical'])}",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_elastic"))
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--parts", nargs="+", default=["decode", "serve"])
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--resize-gib", type=float, default=60.0, help="MiB on the host")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--zero", action="store_true")
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="also the phases that say what slows the steps: " + ", ".join(DIAGNOSE),
    )
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--gap-s", type=float, default=4.0)
    parser.add_argument("--idle-s", type=float, default=1.0)
    parser.add_argument("--min-blocks", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trickle-mib", type=float, default=64.0, help="`trickle`'s step (KiB on the host)"
    )
    parser.add_argument("--trickle-gap-ms", type=float, default=2.0)
    parser.add_argument(
        "--driver-rate-gib",
        type=float,
        default=32.0,
        help="`rated`'s driver rate, GiB/s (MiB/s on the host)",
    )
    parser.add_argument(
        "--handle-mib",
        type=float,
        default=None,
        help="the decode cache's largest handle (KiB on the host); default: the library's 1 GiB",
    )
    parser.add_argument(
        "--phases",
        nargs="+",
        choices=(*PHASES, *DIAGNOSE),
        default=None,
        help="decode: these phases only, in this order",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="serve: pairs of runs (auto, then fixed) in turn"
    )
    args = parser.parse_args(argv)

    import torch

    results: dict[str, Any] = {"environment": environment(torch.device(args.device))}
    if "decode" in args.parts:
        results["decode"] = decode_part(args)
    if "serve" in args.parts:
        results["serve"] = serve_part(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_elastic.json").write_text(json.dumps(results, indent=1))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
