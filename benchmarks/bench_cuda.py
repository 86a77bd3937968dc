"""End-to-end CUDA benchmarks of `extensible_kv.ExtensibleTensor`, each beside its baselines in
the same process and run: vLLM 0.34.0's `ExtensibleTensor`, fixed 2 MiB handles (what
per-granule peers do) and plain torch memory.

    python3 benchmarks/bench_cuda.py --out DIR [--quick]

Prints markdown tables and writes DIR/bench_cuda.json (rewritten after every section, so a
run cut short still leaves what it measured). Timings: `time.perf_counter()` around the call
and a `torch.cuda.synchronize()`, medians of repetitions; host-only timings (Python overhead)
use `time.perf_counter_ns()`. The driver scrubs released memory in the background and
cuMemCreate waits for it (docs/benchmarks.md): bulk repetitions pause first (steady state),
and one "just-freed" repetition without the pause is reported separately.

The vLLM baseline is imported from .vendor/vllm034 (git-ignored; carry it to the device);
without it those rows say "skipped".
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from common import (
    GIB,
    KIB,
    MIB,
    child_json,
    driver_memset,
    driver_profile,
    log,
    median,
    settle,
    sync,
    timed,
)
from common import environment as common_environment

DEVICE = "cuda:0"
BLOCK = 32 * KIB  # the flow's first commit, per segment
REPO = Path(__file__).resolve().parent.parent
VENDOR = REPO / ".vendor" / "vllm034"

torch: Any = None  # imported in main(), after argument parsing (--help needs no torch)
GRANULE = 2 * MIB  # the driver's granularity, read in main()
ExtensibleTensor: Any = None
VllmExtensibleTensor: Any = None
VLLM_NOTE = ""


# Sizes and repetitions: (full run, --quick); each can be set on the command line.
SIZES: dict[str, tuple[float, float]] = {
    "bulk_gib": (60, 4),  # bulk extend target per segment (2 segments)
    "fixed_gib": (8, 1),  # the same for fixed 2 MiB handles, too slow at full size
    "read_gib": (8, 1),  # first-pass read
    "reps": (3, 2),  # steady-state repetitions (bulk, first pass)
    "pause": (3.0, 0.5),  # seconds before each steady-state repetition (the scrub)
    "pair_reps": (5, 2),  # rotations of the pairs section (ours, vLLM's, pages)
    "start_reps": (3, 1),  # fresh processes per contender (the starts section)
    "steps": (10_000, 128),  # incremental grows (issue 21: flat over 10,000)
    "calls": (10_000, 1000),  # calls per batch (Python overhead)
    "incremental_limit_s": (60.0, 30.0),  # give up the incremental run after this long
}


def gib_bytes(gib: float) -> int:
    """`gib` GiB in bytes, a multiple of 2 MiB (the granularity on Hopper)."""
    return max(1, round(gib * GIB / (2 * MIB))) * 2 * MIB


def tbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e12


# --------------------------------------------------------------------------------------------
# the contenders: a uniform face over ours and vLLM's


class Ours:
    def __init__(self, capacity: int, segments: int, **options: Any) -> None:
        self.t = ExtensibleTensor(capacity, segments, device=DEVICE, **options)

    def grow(self, per_segment: int) -> None:
        self.t.resize_per_segment_(per_segment, zero_new=True)

    def release(self) -> None:
        self.t.release_physical()
        self.t.wait_released()  # the next grow must find the memory free

    def teardown(self) -> None:
        self.t.close()

    def handles(self) -> int:
        return int(self.t.num_handles)


class Vllm:
    def __init__(self, capacity: int, segments: int) -> None:
        self.t = VllmExtensibleTensor(capacity, device=DEVICE, num_segments=segments)

    def grow(self, per_segment: int) -> None:
        self.t.resize_per_segment_(per_segment, zero_new=True)

    def release(self) -> None:
        self.t.release_physical()
        self.t.wait_released()  # the next grow must find the memory free

    def teardown(self) -> None:
        self.t.free()

    def handles(self) -> int:
        return int(self.t.num_physical_chunks)


def make(kind: str, capacity: int, segments: int) -> Ours | Vllm:
    from extensible_kv import HandleSizing

    if kind == "ours":
        return Ours(capacity, segments)
    if kind == "ours_4gib":
        return Ours(capacity, segments, handle_sizing=HandleSizing(max_bytes=4 * GIB))
    if kind == "ours_fixed_2mib":
        return Ours(capacity, segments, handle_sizing=HandleSizing("per_run", 2 * MIB))
    if kind == "vllm":
        return Vllm(capacity, segments)
    raise ValueError(kind)


# --------------------------------------------------------------------------------------------
# a. bulk extend, c. teardown


def bulk_one(kind: str, per_segment: int, pause_s: float) -> dict[str, float]:
    t = make(kind, 2 * per_segment, 2)
    t.grow(BLOCK)  # untimed: the flow's first commit
    sync()
    time.sleep(pause_s)
    extend_s = timed(partial(t.grow, per_segment))
    handles = t.handles()
    teardown_s = timed(t.teardown)
    del t
    gc.collect()
    return {"extend_s": extend_s, "teardown_s": teardown_s, "handles": handles}


def bench_bulk(args: argparse.Namespace) -> dict[str, Any]:
    big = gib_bytes(args.bulk_gib)
    variants = [
        ("ours", "ours, cap-aligned handles of at most 1 GiB (default)", big),
        ("ours_4gib", "ours, cap-aligned handles of at most 4 GiB", big),
        (
            "ours_fixed_2mib",
            "ours, fixed 2 MiB handles (per-granule peers)",
            gib_bytes(args.fixed_gib),
        ),
        ("vllm", "vLLM 0.34.0 ExtensibleTensor", big),
    ]
    results: dict[str, Any] = {}
    for kind, label, per_segment in variants:
        entry: dict[str, Any] = {"label": label, "gib_per_segment": per_segment / GIB}
        results[kind] = entry
        if kind == "vllm" and VllmExtensibleTensor is None:
            entry["skipped"] = VLLM_NOTE
            continue
        log(f"bulk: {label}, {per_segment / GIB:g} GiB x 2 segments")
        try:
            reps = [bulk_one(kind, per_segment, args.pause) for _ in range(args.reps)]
            freed = bulk_one(kind, per_segment, 0.0)  # right after the last teardown
        except Exception as exc:
            traceback.print_exc()
            entry["error"] = f"{type(exc).__name__}: {exc}"
            settle()
            continue
        total = 2 * per_segment
        extend = median([r["extend_s"] for r in reps])
        entry.update(
            committed_bytes=total,
            handles=reps[0]["handles"],
            extend_ms=[r["extend_s"] * 1e3 for r in reps],
            extend_ms_median=extend * 1e3,
            tb_per_s=tbps(total, extend),
            teardown_ms=[r["teardown_s"] * 1e3 for r in reps],
            teardown_ms_median=median([r["teardown_s"] for r in reps]) * 1e3,
            just_freed_extend_ms=freed["extend_s"] * 1e3,
            just_freed_tb_per_s=tbps(total, freed["extend_s"]),
            just_freed_teardown_ms=freed["teardown_s"] * 1e3,
        )
        log(f"  extend {extend * 1e3:.1f} ms ({entry['tb_per_s']:.2f} TB/s)")
        settle()
    ours = results["ours"]
    for kind in ("ours", "ours_4gib"):
        entry = results[kind]
        if "tb_per_s" not in entry:
            continue
        if "tb_per_s" in results["vllm"]:
            entry["speedup_vs_vllm"] = entry["tb_per_s"] / results["vllm"]["tb_per_s"]
            entry["just_freed_speedup_vs_vllm"] = (
                entry["just_freed_tb_per_s"] / results["vllm"]["just_freed_tb_per_s"]
            )
        if "tb_per_s" in results["ours_fixed_2mib"]:
            entry["speedup_vs_fixed_2mib"] = (
                entry["tb_per_s"] / results["ours_fixed_2mib"]["tb_per_s"]
            )
    results["memset_floor"] = memset_floor(args)
    if "tb_per_s" in ours and "tb_per_s" in results["memset_floor"]:
        ours["fraction_of_memset"] = ours["tb_per_s"] / results["memset_floor"]["tb_per_s"]
    return results


def _pair_one(kind: str, per_segment: int, pause_s: float) -> dict[str, float]:
    """One bulk extend of `kind` after `pause_s` s, with the host time of its creates (ours:
    `_profile_report`; vLLM's: its driver's `create`, wrapped for the call)."""
    zero = kind != "pages"
    if kind == "vllm":
        t = VllmExtensibleTensor(2 * per_segment, device=DEVICE, num_segments=2)
        driver = t._buffer._driver
        create_ns = [0]
        inner = driver.create

        def counted(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return inner(*a, **kw)
            finally:
                create_ns[0] += time.perf_counter_ns() - start

        driver.create = counted  # an instance attribute over the class's method
        try:
            t.resize_per_segment_(BLOCK, zero_new=True)
            sync()
            time.sleep(pause_s)
            create_ns[0] = 0
            extend_s = timed(partial(t.resize_per_segment_, per_segment, zero_new=True))
        finally:
            del driver.create
        create_ms = create_ns[0] / 1e6
        handles = int(t.num_physical_chunks)
        teardown = t.free
    else:
        t = ExtensibleTensor(2 * per_segment, 2, device=DEVICE, _profile=True)
        t.resize_per_segment_(BLOCK)
        sync()
        time.sleep(pause_s)
        t._profile_report(reset=True)
        extend_s = timed(partial(t.resize_per_segment_, per_segment, zero_new=zero))
        create_ms = driver_profile(t).get("create", [0, 0.0])[1]
        handles = int(t.num_handles)
        teardown = t.close
    teardown_s = timed(teardown)
    del t, teardown
    gc.collect()
    return {
        "extend_ms": extend_s * 1e3,
        "create_ms": create_ms,
        "teardown_ms": teardown_s * 1e3,
        "handles": handles,
    }


def bench_pairs(args: argparse.Namespace) -> dict[str, Any]:
    """The bulk extend of ours, vLLM's and ours unzeroed ("pages": create, map, access alone),
    in rotating order, each after the previous contender's 120 GiB teardown and the same pause:
    every repetition of each meets the driver's scrub in the same state. With the host time of
    the creates (where the scrub's wait shows) and the device's memset of the same bytes."""
    per_segment = gib_bytes(args.bulk_gib)
    kinds = ["ours", "vllm", "pages"] if VllmExtensibleTensor is not None else ["ours", "pages"]
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for rep in range(args.pair_reps):
        order = kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]
        for kind in order:
            runs[kind].append(_pair_one(kind, per_segment, args.pause))
            log(f"pairs {rep} {kind}: {json.dumps(runs[kind][-1])}")
    results: dict[str, Any] = {"gib_per_segment": per_segment / GIB, "runs": runs}
    for kind, entries in runs.items():
        results[kind] = {
            key: median([e[key] for e in entries])
            for key in ("extend_ms", "create_ms", "teardown_ms")
        }
    settle()
    total = 2 * per_segment
    buf = torch.empty(total, dtype=torch.uint8, device=DEVICE)
    results["memset_ms"] = median(
        [timed(partial(driver_memset, buf.data_ptr(), total)) * 1e3 for _ in range(3)]
    )
    results["zero_ms"] = median([timed(buf.zero_) * 1e3 for _ in range(3)])
    del buf
    settle()
    if "vllm" in runs:
        ratios = [
            v["extend_ms"] / o["extend_ms"] for v, o in zip(runs["vllm"], runs["ours"], strict=True)
        ]
        results["vllm_over_ours"] = ratios
        results["vllm_over_ours_median"] = median(ratios)
    log(f"pairs: {json.dumps({k: v for k, v in results.items() if k != 'runs'})}")
    return results


def bench_starts(args: argparse.Namespace) -> dict[str, Any]:
    """The bulk extend as a serving stack's start meets it: each repetition in a fresh process
    (after the same warm-up as this one's), ours and vLLM's in rotating order, so that neither
    follows a free of the size it asks for in its own process."""
    kinds = ["ours", "vllm"] if VllmExtensibleTensor is not None else ["ours"]
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for rep in range(args.start_reps):
        for kind in kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]:
            command = [sys.executable, __file__, "--out", str(args.out), "--one-start", kind]
            command += ["--bulk-gib", str(args.bulk_gib), "--pause", str(args.pause)]
            runs[kind].append(child_json(command, f"{kind} start"))
            log(f"starts {rep} {kind}: {json.dumps(runs[kind][-1])}")
            time.sleep(args.pause)
    results: dict[str, Any] = {"gib_per_segment": args.bulk_gib, "runs": runs}
    for kind, entries in runs.items():
        results[kind] = {
            key: median([e[key] for e in entries]) for key in ("extend_ms", "create_ms")
        }
    if "vllm" in runs:
        results["vllm_over_ours_median"] = (
            results["vllm"]["extend_ms"] / results["ours"]["extend_ms"]
        )
    log(f"starts: {json.dumps({k: v for k, v in results.items() if k != 'runs'})}")
    return results


def _profiled_extend(per_segment: int, pause_s: float) -> dict[str, Any]:
    """One bulk extend of ours with its driver profile, then a second zeroing of the same
    range by cuMemsetD8Async alone (the driver's zeroing floor), then the teardown."""
    t = ExtensibleTensor(2 * per_segment, 2, device=DEVICE, _profile=True)
    t.resize_per_segment_(BLOCK)
    sync()
    time.sleep(pause_s)
    t._profile_report(reset=True)
    extend_s = timed(partial(t.resize_per_segment_, per_segment))
    entry: dict[str, Any] = {
        "extend_ms": extend_s * 1e3,
        "tb_per_s": tbps(2 * per_segment, extend_s),
        "handles": t.num_handles,
        "extend_ops_ms": driver_profile(t),
    }
    try:
        starts = [t.base_ptr + offset for offset in t.segment_offsets]

        def memset_again() -> None:
            for start in starts:
                driver_memset(start, per_segment)

        floor_s = timed(memset_again)
        entry["driver_memset_ms"] = floor_s * 1e3
        entry["driver_memset_tb_per_s"] = tbps(2 * per_segment, floor_s)
    except ImportError as exc:
        entry["driver_memset_ms"] = f"skipped: {exc}"
    teardown_s = timed(t.close)
    entry["teardown_ms"] = teardown_s * 1e3
    entry["teardown_ops_ms"] = driver_profile(t, reset=False)
    del t
    gc.collect()
    return entry


def bench_profile(args: argparse.Namespace) -> dict[str, Any]:
    """Where a bulk extend and its teardown spend their time, call by call: on memory never
    used before in this process (pristine), after a pause (steady), right after a free."""
    per_segment = gib_bytes(args.bulk_gib)
    results: dict[str, Any] = {"gib_per_segment": per_segment / GIB}
    for case, pause in (("pristine", 0.0), ("steady", args.pause), ("just_freed", 0.0)):
        results[case] = _profiled_extend(per_segment, pause)
        log(f"profile {case}: {json.dumps(results[case])}")
    return results


def memset_floor(args: argparse.Namespace) -> dict[str, Any]:
    """torch.empty(...).zero_(): the zeroing every commit pays, with no mapping at all."""
    settle()
    for total in (2 * gib_bytes(args.bulk_gib), gib_bytes(args.bulk_gib)):
        try:
            buf = torch.empty(total, dtype=torch.uint8, device=DEVICE)
        except torch.cuda.OutOfMemoryError:
            settle()
            continue
        times = [timed(buf.zero_) for _ in range(args.reps)]
        del buf
        settle()
        t = median(times)
        log(f"memset floor: {total / GIB:g} GiB in {t * 1e3:.1f} ms")
        return {
            "label": "memset only: torch.empty(n, uint8).zero_()",
            "bytes": total,
            "zero_ms": [x * 1e3 for x in times],
            "zero_ms_median": t * 1e3,
            "tb_per_s": tbps(total, t),
        }
    return {"error": "no buffer of the bulk size fits"}


# --------------------------------------------------------------------------------------------
# b. incremental growth


def bench_incremental(args: argparse.Namespace) -> dict[str, Any]:
    steps = args.steps
    results: dict[str, Any] = {"steps": steps}
    for kind in ("ours", "vllm"):
        entry: dict[str, Any] = {}
        results[kind] = entry
        if kind == "vllm" and VllmExtensibleTensor is None:
            entry["skipped"] = VLLM_NOTE
            continue
        log(f"incremental: {kind}, {steps} grows of one granule per segment")
        time.sleep(args.pause)
        try:
            g = GRANULE
            t = make(kind, 2 * (steps + 8) * g, 2)
            t.grow(g)
            sync()
            times = []
            deadline = time.perf_counter() + args.incremental_limit_s
            for i in range(2, steps + 2):
                times.append(timed(partial(t.grow, i * g)))
                if time.perf_counter() > deadline:
                    entry["truncated_after"] = len(times)
                    break
            entry["handles"] = t.handles()
            entry["teardown_ms"] = timed(t.teardown) * 1e3
            del t
        except Exception as exc:
            traceback.print_exc()
            entry["error"] = f"{type(exc).__name__}: {exc}"
            settle()
            continue
        eighth = max(1, len(times) // 8)
        first, last = median(times[:eighth]) * 1e6, median(times[-eighth:]) * 1e6
        entry.update(
            first_eighth_us=first,
            last_eighth_us=last,
            last_over_first=last / first,
            median_us=median(times) * 1e6,
            max_us=max(times) * 1e6,
            total_s=sum(times),
        )
        log(f"  first eighth {first:.0f} us, last eighth {last:.0f} us")
        settle()
    if "last_eighth_us" in results["ours"] and "last_eighth_us" in results["vllm"]:
        results["ours"]["speedup_vs_vllm_last_eighth"] = (
            results["vllm"]["last_eighth_us"] / results["ours"]["last_eighth_us"]
        )
    return results


# --------------------------------------------------------------------------------------------
# d. first-pass read bandwidth


def read_once(buf: Any) -> float:
    """Seconds for one full read of `buf` (int64 elements, bandwidth-bound sum)."""
    return timed(partial(torch.sum, buf))


def bench_first_pass(args: argparse.Namespace) -> dict[str, Any]:
    n = gib_bytes(args.read_gib)
    torch.sum(torch.zeros(1 << 20, dtype=torch.int64, device=DEVICE))  # loads the kernel
    contenders: dict[str, Callable[[], tuple[Any, Any]]] = {}

    def ours(**options: Any) -> Callable[[], tuple[Any, Any]]:
        def build() -> tuple[Any, Any]:
            t = ExtensibleTensor(n, 1, device=DEVICE, **options)
            t.resize_(BLOCK)
            t.resize_(n)  # zeroed by the commit: written once, by a memset
            return t, t.view(torch.int64, (n // 8,))

        return build

    def plain() -> tuple[Any, Any]:
        buf = torch.empty(n, dtype=torch.uint8, device=DEVICE)
        buf.zero_()  # written once, by a memset, like ours
        return None, buf.view(torch.int64)

    contenders["ours"] = ours()
    from extensible_kv import HandleSizing

    contenders["ours_fixed_2mib"] = ours(handle_sizing=HandleSizing("per_run", 2 * MIB))
    contenders["torch_empty"] = plain
    results: dict[str, Any] = {"bytes": n}
    for name, build in contenders.items():
        first, second = [], []
        for _ in range(args.reps):
            owner, view = build()
            sync()
            first.append(read_once(view))
            second.append(read_once(view))
            del view
            gc.collect()
            if owner is not None:
                owner.close()
            del owner
            settle()
        results[name] = {
            "first_pass_ms": median(first) * 1e3,
            "first_pass_gb_per_s": n / median(first) / 1e9,
            "second_pass_gb_per_s": n / median(second) / 1e9,
        }
        log(f"first pass: {name} {results[name]['first_pass_gb_per_s']:.0f} GB/s")
    base = results["torch_empty"]["first_pass_gb_per_s"]
    for name in ("ours", "ours_fixed_2mib"):
        results[name]["ratio_vs_torch_empty"] = results[name]["first_pass_gb_per_s"] / base
    return results


# --------------------------------------------------------------------------------------------
# e. Python overhead (host time)


def per_call_us(fn: Callable[[], object], calls: int, batches: int) -> float:
    """Median over `batches` of the mean host time of `calls` calls, in µs."""
    results = []
    for _ in range(batches):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        results.append((time.perf_counter_ns() - start) / calls / 1e3)
    sync()
    return median(results)


def in_granule_grow_us(t: Ours | Vllm, calls: int, batches: int, **kw: Any) -> float:
    """Host time of a 1 KiB zeroing grow inside the mapped first granule of every segment.
    When the granule is full: release, commit 1 KiB again (untimed) and go on."""
    step = KIB
    max_steps = 2 * MIB // step - 1
    grow = t.t.resize_per_segment_
    results = []
    for _ in range(batches):
        done, total_ns = 0, 0
        while done < calls:
            t.release()
            grow(step, zero_new=True)
            sync()
            k = min(max_steps, calls - done)
            size = step
            start = time.perf_counter_ns()
            for _ in range(k):
                size += step
                grow(size, zero_new=True, **kw)
            total_ns += time.perf_counter_ns() - start
            done += k
        sync()
        results.append(total_ns / calls / 1e3)
    return median(results)


def bench_overhead(args: argparse.Namespace) -> dict[str, Any]:
    calls, batches = args.calls, 5
    results: dict[str, Any] = {"calls": calls, "batches": batches}
    for kind in ("ours", "vllm"):
        entry: dict[str, Any] = {}
        results[kind] = entry
        if kind == "vllm" and VllmExtensibleTensor is None:
            entry["skipped"] = VLLM_NOTE
            continue
        log(f"overhead: {kind}")
        for segments in (2, 1):
            t = make(kind, segments * 64 * MIB, segments)
            t.grow(4 * MIB)
            sync()
            raw = t.t
            if segments == 2:
                noop = raw.resize_per_segment_
                entry["noop_resize_us"] = per_call_us(partial(noop, 4 * MIB), calls, batches)
                entry["segment_view_us"] = per_call_us(partial(raw.segment_view, 0), calls, batches)
                entry["full_view_us"] = per_call_us(raw.full_view, calls, batches)
                if kind == "ours":
                    n = 4 * MIB // 2
                    entry["view_bf16_us"] = per_call_us(
                        partial(raw.view, torch.bfloat16, (n,)), calls, batches
                    )
                    entry["noop_resize_explicit_stream_us"] = per_call_us(
                        partial(noop, 4 * MIB, stream=0), calls, batches
                    )
            key = f"in_granule_grow_{segments}seg_us"
            entry[key] = in_granule_grow_us(t, calls, batches)
            if kind == "ours":
                stream = torch.cuda.current_stream().cuda_stream
                entry[f"in_granule_grow_{segments}seg_explicit_stream_us"] = in_granule_grow_us(
                    t, calls, batches, stream=stream
                )
            gc.collect()  # the views made above are gone: close() refuses while any lives
            t.teardown()
            del t, raw
            settle()
        log("  " + ", ".join(f"{k} {v:.2f}" for k, v in entry.items()))
    return results


# --------------------------------------------------------------------------------------------
# report


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def report(res: dict[str, Any]) -> str:
    out = []
    bulk = res.get("bulk")
    if bulk:
        rows = []
        for kind in ("ours", "ours_4gib", "ours_fixed_2mib", "vllm", "memset_floor"):
            e = bulk.get(kind, {})
            label = e.get("label", kind)
            if "skipped" in e or "error" in e:
                rows.append([label, *["—"] * 10, e.get("skipped") or e.get("error")])
                continue
            if kind == "memset_floor":
                rows.append(
                    [label, e["bytes"] / GIB, e["zero_ms_median"], e["tb_per_s"]]
                    + ["—"] * 7
                    + ["no mapping: the zeroing floor"]
                )
                continue
            note = (
                "8 GiB/segment (too slow at full size): compare TB/s"
                if (kind == "ours_fixed_2mib")
                else ""
            )
            rows.append(
                [
                    label,
                    e["committed_bytes"] / GIB,
                    e["extend_ms_median"],
                    e["tb_per_s"],
                    e["handles"],
                    e["teardown_ms_median"],
                    e["just_freed_extend_ms"],
                    e["just_freed_tb_per_s"],
                    e.get("speedup_vs_vllm"),
                    e.get("speedup_vs_fixed_2mib"),
                    e.get("fraction_of_memset"),
                    note,
                ]
            )
        out.append(
            "### a/c. Bulk extend one block → N GiB per segment, 2 segments, zero_new "
            "(median of steady-state repetitions after a pause; just-freed = no pause)\n\n"
            + table(
                [
                    "contender",
                    "GiB",
                    "extend ms",
                    "TB/s",
                    "handles",
                    "teardown ms",
                    "just-freed ms",
                    "just-freed TB/s",
                    "speedup vs vLLM",
                    "speedup vs fixed 2 MiB",
                    "of memset",
                    "note",
                ],
                rows,
            )
        )
    inc = res.get("incremental")
    if inc:
        rows = []
        for kind in ("ours", "vllm"):
            e = inc.get(kind, {})
            if "skipped" in e or "error" in e:
                rows.append([kind, "—", "—", "—", "—", "—", e.get("skipped") or e.get("error")])
                continue
            rows.append(
                [
                    kind,
                    e["first_eighth_us"],
                    e["last_eighth_us"],
                    e["last_over_first"],
                    e.get("speedup_vs_vllm_last_eighth"),
                    e["teardown_ms"],
                    f"truncated after {e['truncated_after']} grows"
                    if "truncated_after" in e
                    else "",
                ]
            )
        out.append(
            f"### b. Incremental growth: {inc['steps']} grows of one granule per segment, "
            "2 segments, zero_new (µs per grow, incl. synchronize)\n\n"
            + table(
                [
                    "contender",
                    "first eighth µs",
                    "last eighth µs",
                    "last/first",
                    "speedup vs vLLM (last eighth)",
                    "teardown ms",
                    "note",
                ],
                rows,
            )
        )
    fp = res.get("first_pass")
    if fp and "torch_empty" in fp:
        rows = [
            [
                name,
                fp[name]["first_pass_gb_per_s"],
                fp[name]["second_pass_gb_per_s"],
                fp[name].get("ratio_vs_torch_empty", 1.0),
            ]
            for name in ("ours", "ours_fixed_2mib", "torch_empty")
        ]
        out.append(
            f"### d. First-pass read of a freshly committed {fp['bytes'] / GIB:.0f} GiB range "
            "(int64 sum)\n\n"
            + table(["buffer", "first pass GB/s", "second pass GB/s", "ratio vs torch.empty"], rows)
        )
    ov = res.get("overhead")
    if ov:
        keys = [
            ("noop_resize_us", "no-op resize_per_segment_"),
            ("noop_resize_explicit_stream_us", "no-op resize, stream=0"),
            ("view_bf16_us", "view(bfloat16, (n,))"),
            ("segment_view_us", "segment_view(0)"),
            ("full_view_us", "full_view()"),
            ("in_granule_grow_2seg_us", "in-granule grow + zero, 2 segments"),
            ("in_granule_grow_2seg_explicit_stream_us", "  same, explicit stream"),
            ("in_granule_grow_1seg_us", "in-granule grow + zero, 1 segment"),
            ("in_granule_grow_1seg_explicit_stream_us", "  same, explicit stream"),
        ]
        ours, vllm = ov.get("ours", {}), ov.get("vllm", {})
        rows = [[label, ours.get(k), vllm.get(k)] for k, label in keys]
        out.append(
            f"### e. Python overhead (host µs per call, median of {ov['batches']} batches of "
            f"{ov['calls']})\n\n" + table(["call", "ours", "vLLM 0.34"], rows)
        )
    return "\n\n".join(out)


def environment() -> dict[str, Any]:
    env = common_environment(torch_cuda=torch.version.cuda, vllm_baseline=VLLM_NOTE or str(VENDOR))
    try:
        from cuda.bindings import driver as cu

        err, version = cu.cuDriverGetVersion()
        if err == cu.CUresult.CUDA_SUCCESS:
            env["cuda_driver_api"] = f"{version // 1000}.{version % 1000 // 10}"
    except Exception:
        pass
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for bench_cuda.json")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument(
        "--only",
        default="profile,bulk,incremental,first_pass,overhead",
        help="comma-separated sections to run (default: all)",
    )
    for name, (full, quick) in SIZES.items():
        kind = float if isinstance(full, float) or name.endswith("gib") else int
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            help=f"default {full}, {quick} with --quick",
        )
    parser.add_argument(
        "--one-start",
        choices=["ours", "vllm"],
        help="(the starts section's child) one bulk extend of this kind; JSON on stdout",
    )
    args = parser.parse_args(argv)
    for name, (full, quick) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)

    global torch, ExtensibleTensor, VllmExtensibleTensor, VLLM_NOTE, GRANULE
    import torch as torch_module

    torch = torch_module
    from extensible_kv import ExtensibleTensor as Ours_
    from extensible_kv import vmm_unavailable_reason

    ExtensibleTensor = Ours_
    reason = vmm_unavailable_reason(DEVICE)
    if reason is not None or not torch.cuda.is_available():
        log(f"no CUDA VMM device: {reason or 'torch sees no CUDA device'}")
        return 2
    probe = ExtensibleTensor(1, 1, device=DEVICE)
    GRANULE = probe.granularity
    probe.close()
    if (VENDOR / "extensible_tensor.py").exists():
        sys.path.insert(0, str(VENDOR))
        from extensible_tensor import ExtensibleTensor as vllm_tensor  # type: ignore

        VllmExtensibleTensor = vllm_tensor
    else:
        VLLM_NOTE = f"skipped: {VENDOR} is absent (git-ignored: carry .vendor to the device)"
        log(VLLM_NOTE)

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_cuda.json"
    results: dict[str, Any] = {
        "quick": args.quick,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "only", "quick")},
        "environment": environment(),
    }
    log(json.dumps(results["environment"]))

    # Warm-up: libcuda, the first handles and memsets of both implementations.
    torch.zeros(1, device=DEVICE)
    for kind in ("ours", "vllm"):
        if kind == "vllm" and VllmExtensibleTensor is None:
            continue
        t = make(kind, 2 * GIB, 2)
        t.grow(BLOCK)
        t.grow(GIB // 2)
        t.grow(GIB)
        t.teardown()
        del t
    settle()

    if args.one_start:
        entry = _pair_one(args.one_start, gib_bytes(args.bulk_gib), args.pause)
        print(json.dumps(entry))
        return 0

    sections = {
        "profile": bench_profile,
        "bulk": bench_bulk,
        "pairs": bench_pairs,
        "starts": bench_starts,
        "incremental": bench_incremental,
        "first_pass": bench_first_pass,
        "overhead": bench_overhead,
    }
    failed = []
    for name in args.only.split(","):
        name = name.strip()
        start = time.perf_counter()
        try:
            results[name] = sections[name](args)
        except Exception as exc:
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            failed.append(name)
            settle()
        results.setdefault("section_seconds", {})[name] = time.perf_counter() - start
        path.write_text(json.dumps(results, indent=2))
        log(f"== {name} done in {results['section_seconds'][name]:.1f} s")

    print(report(results))
    print(f"\nJSON: {path}")
    errors = [
        f"{section}/{kind}"
        for section in ("bulk", "incremental", "overhead")
        for kind, entry in results.get(section, {}).items()
        if isinstance(entry, dict) and "error" in entry
    ]
    if failed or errors:
        log(f"failed: {failed + errors}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
