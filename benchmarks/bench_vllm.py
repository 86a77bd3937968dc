"""vLLM 0.34.0's own `ExtensibleKVCache`, on vLLM's `ExtensibleTensor` and on ours through the
plugin, side by side in one process, on vLLM 0.34 layouts.

    python3 benchmarks/bench_vllm.py --out DIR [--quick] [--reps 2] [--pause 3]

Per layout and repetition, for each contender -- vLLM's class, and ours with two handle cuts
of `EXTENSIBLE_KV_VLLM_HANDLES` (cap_aligned, the default; whole_runs: one handle per
run, vLLM's count); the plugin's `unregister()`/`register()` switch the module global vLLM's
cache reads -- the steps a vLLM
worker runs, each timed with `time.perf_counter()` around the call and a
`torch.cuda.synchronize()`:
  allocate     `ExtensibleKVCache(...)` + `allocate()`: reserve the capacity, commit the
               minimum (1 block, 2 for block-outermost) -- what happens before CUDA graphs --
               after a pause, as at a start (no memory just freed);
  extend       `commit(N)`: from there to the free memory (less a 2 GiB margin), zeroed --
               the post-warmup extension, after a pause (the driver scrubs released memory in
               the background and cuMemCreate waits for it: docs/benchmarks.md);
  defragment   `commit(N, defragment=True)`: what vLLM does when a KV connector registers the
               memory: release everything, map each segment as one allocation, zero it. It
               follows the extend with no pause (just-freed memory, as in vLLM);
  sleep, wake  `release_physical()`, then `recommit()` after a pause;
  free         `free()`.
The capacity is the device's total memory (an upper bound, as vLLM's profiling gives).
Medians over the repetitions. Prints markdown tables and writes DIR/bench_vllm.json
(rewritten after every layout). vLLM comes installed or from `.vendor` (tests/support/vllm_env.py:
`scripts/vendor-vllm`, carried to the GPU machine).

`--device cpu` runs ours alone on the host backend (a smoke test of this script).
`--profile` builds our tensors with `_profile=True` and adds, per step of ours, the driver
calls it made and their host time (`ops`: {op: [calls, ms]}); the report lists them under the
table: where `allocate` and the others spend their time (issue 21).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
# common is found next to this file when it runs as a script, not when a test loads it by path.
sys.path.insert(0, str(REPO / "benchmarks"))

import common  # noqa: E402
from common import GIB, log, settle, timed_ms  # noqa: E402
from support import vllm_env  # noqa: E402  (after the path: it lives with the tests)

MARGIN = 2 * GIB
STEPS = ("allocate", "extend", "defragment", "sleep", "wake", "free")
# Ours, by EXTENSIBLE_KV_VLLM_HANDLES.
OURS = {"ours": "cap_aligned", "ours_runs": "whole_runs"}
LABELS = {"vllm": "vLLM 0.34", "ours": "ours (default cut)", "ours_runs": "ours (whole runs)"}

torch: Any = None


def cases(quick: bool) -> list[Any]:
    from support.vllm_cases import Case, Shape

    llama8b = Shape(num_layers=32, num_kv_heads=8, head_size=128)
    chosen = [
        Case("Llama-3-8B: 32 layers, 8 KV heads x 128, LBNHC padded", "LBNHC", True, llama8b),
        Case(
            "Llama-3-70B TP8: 80 layers, 1 KV head x 128, LBNHC padded",
            "LBNHC",
            True,
            Shape(num_layers=80, num_kv_heads=1, head_size=128),
        ),
        Case("Llama-3-8B, BLNHC (block-outermost: one segment)", "BLNHC", False, llama8b),
        Case(
            "hybrid: 12 attention (2 KV heads x 256) + 12 Mamba layers, LBNHC padded",
            "LBNHC",
            True,
            Shape(num_layers=12, num_kv_heads=2, head_size=256, num_mamba_layers=12),
        ),
    ]
    return chosen[:2] if quick else chosen


class Contender:
    """Switches vLLM's cache between its own class and ours, with the plugin."""

    def __init__(self, device: Any) -> None:
        from extensible_kv.vllm import ExtensibleTensor, plugin
        from vllm.plugins import load_general_plugins
        from vllm.v1.worker import extensible_kv_cache

        self.module = extensible_kv_cache
        self.vllm_tensor = extensible_kv_cache.ExtensibleTensor
        self.plugin = plugin
        load_general_plugins()  # as in every vLLM process: installs ours
        if self.module.ExtensibleTensor is not ExtensibleTensor:
            raise RuntimeError("the vllm.general_plugins entry point did not install ours")
        self.ours = ExtensibleTensor
        self.kinds = [*(["vllm"] if device.type == "cuda" else []), *OURS]

    def use(self, kind: str) -> None:
        from extensible_kv.vllm import HANDLES_ENV_VAR

        if kind == "vllm":
            self.plugin.unregister()
        else:
            self.plugin.register()
            os.environ[HANDLES_ENV_VAR] = OURS[kind]
        expected = self.vllm_tensor if kind == "vllm" else self.ours
        assert self.module.ExtensibleTensor is expected, kind


def one_run(
    case: Any, device: Any, capacity: int, target: int | None, budget: int, pause_s: float
) -> dict[str, Any]:
    """The worker's steps on one fresh cache; `target` None: sized from the free memory."""
    from support.vllm_cases import kv_cache_config, layout
    from vllm.utils.extensible_tensor import granule_size
    from vllm.v1.worker.extensible_kv_cache import ExtensibleKVCache
    from vllm.v1.worker.utils import allocate_kv_cache

    granule = granule_size(device.index if device.type == "cuda" else "cpu")
    config = kv_cache_config(case, capacity, granule)
    lay = layout(case)
    out: dict[str, Any] = {}

    def allocate() -> Any:
        kv = ExtensibleKVCache(config, device, lay)
        views = allocate_kv_cache(config, device, lay, allocate=kv.allocate)
        return kv, views

    def ops() -> dict[str, list[float]]:
        """The driver calls of ours since the last call (empty for vLLM's, or unprofiled)."""
        native = getattr(kv.buffer, "_tensor", None)
        if native is None or not hasattr(native, "_profile_report"):
            return {}
        return common.driver_profile(native)

    out["allocate"], made = timed_ms(allocate, device)
    kv, views = made
    out["ops"] = {"allocate": ops()}
    if target is None:
        available = (
            (common.free_bytes(device) or 0) + kv.physical_bytes - MARGIN if budget == 0 else budget
        )
        target = kv.blocks_within(available)
    out["blocks"] = target
    settle(pause_s, device)
    out["extend"], _ = timed_ms(lambda: kv.commit(target), device)
    out["ops"]["extend"] = ops()
    out["committed_bytes"] = kv.physical_bytes
    out["chunks_after_extend"] = kv.buffer.num_physical_chunks
    out["segments"] = kv.buffer.num_segments
    out["defragment"], _ = timed_ms(lambda: kv.commit(target, defragment=True), device)
    out["ops"]["defragment"] = ops()
    sizes = [target * stride for stride in kv.segment_strides]
    out["one_chunk_per_segment"] = all(kv.buffer.segments_backed_by_one_chunk(sizes))
    out["chunks_after_defragment"] = kv.buffer.num_physical_chunks
    out["sleep"], _ = timed_ms(kv.release_physical, device)
    out["ops"]["sleep"] = ops()
    settle(pause_s, device)
    out["wake"], _ = timed_ms(kv.recommit, device)
    out["ops"]["wake"] = ops()
    views.clear()
    native = getattr(kv.buffer, "_tensor", None)
    out["free"], _ = timed_ms(kv.free, device)
    if native is not None and hasattr(native, "_profile_report"):
        # free() dropped the buffer's tensor: its teardown calls are on the object we kept.
        out["ops"]["free"] = common.driver_profile(native)
    return out


def bench_case(case: Any, device: Any, contender: Contender, args: argparse.Namespace):
    from support.vllm_cases import kv_cache_config

    # One block of every layer, unpadded: the capacity fills the device before padding.
    bytes_per_block = (
        kv_cache_config(replace(case, padded=False), 1, 2 << 20).kv_cache_tensors[0].size
    )
    total = int(torch.cuda.mem_get_info(device)[1]) if device.type == "cuda" else args.cpu_bytes
    capacity = max(total // bytes_per_block, 16)
    budget = int(args.budget_gib * GIB) if args.budget_gib else 0
    if device.type == "cpu":
        budget = args.cpu_bytes // 2
    entry: dict[str, Any] = {"capacity_blocks": capacity, "runs": {k: [] for k in contender.kinds}}
    target: int | None = None
    for rep in range(args.reps):
        kinds = contender.kinds if rep % 2 == 0 else contender.kinds[::-1]
        for kind in kinds:
            contender.use(kind)
            # A vLLM start finds no memory just freed: without the pause, allocate's first
            # cuMemCreate waits for the driver's scrub of the last run's ~137 GiB (36-48 ms on
            # the H200, for either tensor), which is not what a start pays.
            settle(args.pause, device)
            log(f"  rep {rep + 1}/{args.reps}: {kind}")
            run = one_run(case, device, capacity, target, budget, args.pause)
            target = run["blocks"]  # every run commits the same blocks
            entry["runs"][kind].append(run)
    contender.use("ours")
    for kind, runs in entry["runs"].items():
        entry[kind] = {step: statistics.median(r[step] for r in runs) for step in STEPS}
        for key in ("blocks", "committed_bytes", "segments"):
            entry[key] = runs[0][key]
        entry[kind]["chunks_after_extend"] = runs[0]["chunks_after_extend"]
        entry[kind]["chunks_after_defragment"] = runs[0]["chunks_after_defragment"]
        entry[kind]["one_chunk_per_segment"] = all(r["one_chunk_per_segment"] for r in runs)
    return entry


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if value < 100 else f"{value:.0f}"
    return str(value)


def report(results: dict[str, Any]) -> str:
    out = []
    for name, entry in results["cases"].items():
        if "error" in entry:
            out.append(f"### {name}\n\nerror: {entry['error']}")
            continue
        gib = entry["committed_bytes"] / GIB
        runs = len(next(iter(entry["runs"].values())))
        head = (
            f"### {name}\n\n{entry['segments']} segments; extend to {entry['blocks']} blocks "
            f"({gib:.1f} GiB); capacity {entry['capacity_blocks']} blocks; ms, median of {runs}; "
            "(x: vLLM's time / ours)\n"
        )
        kinds = list(entry["runs"])
        vllm = entry.get("vllm")
        lines = [
            "| step | " + " | ".join(LABELS[k] for k in kinds) + " |",
            "|---|" + "---|" * len(kinds),
        ]
        for step in STEPS:
            cells = []
            for kind in kinds:
                value = entry[kind][step]
                ratio = f" ({vllm[step] / value:.2f}x)" if vllm and kind != "vllm" else ""
                cells.append(fmt(value) + ratio)
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
        for key in ("chunks_after_extend", "chunks_after_defragment", "one_chunk_per_segment"):
            cells = [fmt(entry[kind][key]) for kind in kinds]
            lines.append(f"| {key.replace('_', ' ')} | " + " | ".join(cells) + " |")
        out.append(head + "\n" + "\n".join(lines) + profile_lines(entry, kinds))
    return "\n\n".join(out)


def profile_lines(entry: dict[str, Any], kinds: list[str]) -> str:
    """Per step of ours, the driver calls of each repetition: `op calls/ms`, and the step's
    time they leave unexplained (Python, waits on the GPU)."""
    lines = []
    for kind in kinds:
        for rep, run in enumerate(entry["runs"][kind]):
            for step in STEPS:
                calls = run["ops"].get(step)
                if not calls:
                    continue
                total = sum(ms for _, ms in calls.values())
                cells = ", ".join(f"{op} {n}/{ms:.2f}" for op, (n, ms) in sorted(calls.items()))
                lines.append(
                    f"- {LABELS[kind]} rep {rep + 1} {step} {run[step]:.2f} ms: {cells}; "
                    f"outside the calls {run[step] - total:.2f} ms"
                )
    return ("\n\nDriver calls (calls/host ms):\n" + "\n".join(lines)) if lines else ""


def environment(device: Any) -> dict[str, Any]:
    import vllm

    return common.environment(device, vllm=f"{vllm.__version__} ({vllm_env.source()})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for bench_vllm.json")
    parser.add_argument("--quick", action="store_true", help="2 layouts, 8 GiB, 1 repetition")
    parser.add_argument("--reps", type=int, help="repetitions (default 2, 1 with --quick)")
    parser.add_argument("--pause", type=float, help="seconds before extend and wake (3)")
    parser.add_argument("--budget-gib", type=float, help="extend to this much, not the free memory")
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (ours alone)")
    parser.add_argument("--profile", action="store_true", help="driver calls per step of ours")
    parser.add_argument("--kinds", help=f"a subset of {','.join(LABELS)} (default: all)")
    parser.add_argument(
        "--cases", help="only the cases whose name contains one of these (comma-separated)"
    )
    parser.add_argument("--cpu-bytes", type=int, default=512 << 20, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 2)
    args.pause = args.pause if args.pause is not None else (0.5 if args.quick else 3.0)
    if args.quick and args.budget_gib is None:
        args.budget_gib = 8

    reason = vllm_env.load()
    if reason is not None:
        log(f"no vLLM: {reason}")
        return 2
    global torch
    import extensible_kv
    import torch as torch_module

    torch = torch_module
    device = torch.device(args.device)
    if device.type == "cuda":
        unavailable = extensible_kv.vmm_unavailable_reason(str(device))
        if unavailable is not None or not torch.cuda.is_available():
            log(f"no CUDA VMM device: {unavailable or 'torch sees no CUDA device'}")
            return 2
        torch.zeros(1, device=device)
    contender = Contender(device)
    if args.kinds:
        wanted = args.kinds.split(",")
        unknown = sorted(set(wanted) - set(LABELS))
        if unknown:
            parser.error(f"--kinds: unknown {', '.join(unknown)} (of {', '.join(LABELS)})")
        contender.kinds = [k for k in contender.kinds if k in wanted]
    if args.profile:
        import functools

        from extensible_kv.vllm import tensor as ours

        ours._CoreTensor = functools.partial(ours._CoreTensor, _profile=True)  # type: ignore[misc]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_vllm.json"
    results: dict[str, Any] = {
        "quick": args.quick,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "environment": environment(device),
        "cases": {},
    }
    log(json.dumps(results["environment"]))
    failed = False
    chosen = cases(args.quick)
    if args.cases:
        wanted_cases = args.cases.split(",")
        chosen = [c for c in chosen if any(w in c.name for w in wanted_cases)]
        if not chosen:
            parser.error(f"--cases: {args.cases} names none of the cases")
    for case in chosen:
        log(f"{case.name}")
        try:
            results["cases"][case.name] = bench_case(case, device, contender, args)
        except Exception as exc:
            traceback.print_exc()
            results["cases"][case.name] = {"error": f"{type(exc).__name__}: {exc}"}
            failed = True
            contender.use("ours")
            settle(0.0, device)
        path.write_text(json.dumps(results, indent=2, default=str))
    print(report(results))
    print(f"\nJSON: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
