"""The flow's extend step on the GPU, for a 7B-like and a 70B-like per-GPU KV cache.

    python3 benchmarks/bench_extend.py --out DIR [--reps 3] [--pause 3] [--shapes 7b,70b_tp8]

Per shape and repetition: `KVCacheFlow.reserve` with the capacity for the whole device memory
(one block committed), a pause (the driver scrubs released memory in the background and
cuMemCreate waits for it: docs/benchmarks.md), then `extend_to_fit()`: the driver's free memory
less the margin (max(1 GiB, 0.75 x transient peak); no warm-up here, so 1 GiB), turned into
blocks granule-aware and committed with zeroing. The commit is timed by the flow itself
(`time.perf_counter()` around the commit and a `torch.cuda.synchronize()`); medians over the
repetitions. Beside it, in the same process, the legacy allocation of the same bytes: one
`torch.zeros` per buffer, as engines allocate the cache today.

Prints a markdown table and writes DIR/bench_extend.json (rewritten after every shape).
Runs only where CUDA's VMM API works.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import GIB, log, settle

DEVICE = "cuda:0"


@dataclass(frozen=True)
class Shape:
    label: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int = 16
    layout: str = "FLASH_ATTN"

    @property
    def block_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * 2  # K and V, bf16


SHAPES = {
    "7b": Shape("7B-like: 32 layers, 8 KV heads x 128, block 16, bf16", 32, 8, 128),
    "70b_tp8": Shape(
        "70B-like per GPU (TP8): 80 layers, 1 KV head x 128, block 16, bf16", 80, 1, 128
    ),
}


def spec_of(shape: Shape) -> list[Any]:
    import torch
    from extensible_kv import AttentionLayerSpec, KVCacheTensorSpec

    layer = AttentionLayerSpec(
        shape.layout, shape.block_size, shape.num_kv_heads, shape.head_size, torch.bfloat16
    )
    return [
        KVCacheTensorSpec(shape.block_bytes, {f"layers.{i}": layer})
        for i in range(shape.num_layers)
    ]


def extend_once(shape: Shape, pause_s: float, margin_bytes: int | None) -> dict[str, Any]:
    """One reserve + extend_to_fit; the teardown is timed too."""
    import torch
    from extensible_kv import KVCacheFlow, capacity_blocks_for
    from extensible_kv.sizing import device_granularity

    spec = spec_of(shape)
    total = int(torch.cuda.mem_get_info(DEVICE)[1])  # the upper bound: memory being scrubbed
    capacity = capacity_blocks_for(total, spec, device_granularity(DEVICE))  # may not show free
    flow = KVCacheFlow.reserve(spec, capacity, DEVICE)
    settle(pause_s)
    # No warm-up here: no transient peak (earlier legacy rows would otherwise count as one).
    report = flow.extend_to_fit(margin_bytes=margin_bytes, transient_peak_bytes=0)
    free_after = int(torch.cuda.mem_get_info(DEVICE)[0])
    buffer_bytes = list(flow.cache.buffer_physical_bytes)
    start = time.perf_counter()
    flow.close()
    torch.cuda.synchronize()
    teardown_ms = (time.perf_counter() - start) * 1e3
    return {
        "report": asdict(report),
        "free_after_bytes": free_after,
        "buffer_bytes": buffer_bytes,
        "teardown_ms": teardown_ms,
    }


def legacy_once(buffer_bytes: list[int], pause_s: float) -> float:
    """Milliseconds to allocate and zero the same bytes as one torch tensor per buffer."""
    import torch

    settle(pause_s)
    start = time.perf_counter()
    tensors = [torch.zeros(n, dtype=torch.uint8, device=DEVICE) for n in buffer_bytes]
    torch.cuda.synchronize()
    elapsed_ms = (time.perf_counter() - start) * 1e3
    del tensors
    return elapsed_ms


def bench_shape(shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    margin = None if args.margin_gib is None else int(args.margin_gib * GIB)
    runs = [extend_once(shape, args.pause, margin) for _ in range(args.reps)]
    reports = [r["report"] for r in runs]
    committed = [r["bytes_after"] - r["bytes_before"] for r in reports]
    commit_ms = [r["commit_ms"] for r in reports]
    legacy_ms = [legacy_once(runs[0]["buffer_bytes"], args.pause) for _ in range(args.reps)]
    settle(0)
    median_ms = statistics.median(commit_ms)
    return {
        "shape": asdict(shape),
        "label": shape.label,
        "buffers": shape.num_layers,
        "segments": 2 * shape.num_layers,
        "blocks_after": reports[0]["blocks_after"],
        "capacity_blocks": reports[0]["capacity_blocks"],
        "committed_gib": statistics.median(committed) / GIB,
        "commit_ms": commit_ms,
        "commit_ms_median": median_ms,
        "gib_per_s": statistics.median(committed) / GIB / (median_ms / 1e3),
        "total_ms_median": statistics.median(r["total_ms"] for r in reports),
        "handles": reports[0]["handles_after"],
        "margin_gib": reports[0]["margin_bytes"] / GIB,
        "free_after_gib": statistics.median(r["free_after_bytes"] for r in runs) / GIB,
        "teardown_ms_median": statistics.median(r["teardown_ms"] for r in runs),
        "legacy_zeros_ms": legacy_ms,
        "legacy_zeros_ms_median": statistics.median(legacy_ms),
        "runs": runs,
    }


def table(results: dict[str, Any]) -> str:
    rows = [
        "| shape | buffers x segments | GiB committed | blocks | extend ms | GiB/s | handles "
        "| free after, GiB | teardown ms | legacy torch.zeros ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["shapes"].values():
        rows.append(
            f"| {r['label']} | {r['buffers']} x 2 | {r['committed_gib']:.1f} | "
            f"{r['blocks_after']} | {r['commit_ms_median']:.1f} | {r['gib_per_s']:.0f} | "
            f"{r['handles']} | {r['free_after_gib']:.2f} | {r['teardown_ms_median']:.1f} | "
            f"{r['legacy_zeros_ms_median']:.1f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for bench_extend.json")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per shape")
    parser.add_argument("--pause", type=float, default=3.0, help="seconds before each extend")
    parser.add_argument("--margin-gib", type=float, help="margin (default: the flow's)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes")
    args = parser.parse_args(argv)

    import torch
    from extensible_kv import vmm_unavailable_reason

    reason = vmm_unavailable_reason(DEVICE)
    if reason is not None or not torch.cuda.is_available():
        log(f"no CUDA VMM device: {reason or 'torch sees no CUDA device'}")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_extend.json"
    results: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "device": torch.cuda.get_device_name(DEVICE),
        "torch": torch.__version__,
        "shapes": {},
    }
    torch.zeros(1, device=DEVICE)  # the context, before the first measurement
    for name in args.shapes.split(","):
        log(f"extend: {SHAPES[name].label}")
        results["shapes"][name] = bench_shape(SHAPES[name], args)
        path.write_text(json.dumps(results, indent=2))
    print("### Extend step (extend_to_fit: free memory - margin)\n")
    print(table(results))
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
