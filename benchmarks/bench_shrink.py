"""Giving memory back without losing data, on the GPU: shrink (plain and exact), consolidate,
and the release + recommit that peers do instead (discarding the contents), beside the device
copy floor measured in the same run.

    python3 benchmarks/bench_shrink.py --out DIR [--gib 120] [--reps 3] [--pause 3]

- shrink: a one-segment cache of `--gib` GiB (default cut, 1 GiB cap) shrunk to a bit over
  half (the frontier inside a handle): `plain` releases the handles past it and keeps the one
  that straddles it; `exact` also replaces that one by a handle of its live granules, copying
  them. Contents are checked after each.
- consolidate: 4 segments grown to `--gib` * 5/6 GiB in all in 64 steps, then backed by one
  handle per segment (every byte copied once, one segment at a time).
- release + recommit: drop everything and grow back to the same size, zeroed (what vLLM 0.34's
  `commit(shrink=True)` and `commit(defragment=True)` do: the contents are lost).
- floor: `torch` device copy of the same bytes between two preallocated buffers.

Steady state: a pause before each repetition (docs/design.md §2: the driver scrubs released
memory in the background). Prints a markdown table, writes DIR/bench_shrink.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from common import GIB, log, settle, timed_ms

DEVICE = "cuda:0"
torch: Any = None


def stamp(t: Any) -> None:
    """Marks every MiB of every committed segment with its index (checked after the change)."""
    for s in range(t.num_segments):
        view = t.segment_view(s).view(torch.int32)
        step = (1 << 20) // 4
        view[::step] = torch.arange(s * 10**6, s * 10**6 + view[::step].numel(), device=DEVICE)


def stamped_ok(t: Any) -> bool:
    for s in range(t.num_segments):
        view = t.segment_view(s).view(torch.int32)
        step = (1 << 20) // 4
        want = torch.arange(s * 10**6, s * 10**6 + view[::step].numel(), device=DEVICE)
        if not torch.equal(view[::step], want):
            return False
    return True


def shrink_once(total: int, keep: int, exact: bool, pause_s: float) -> dict[str, Any]:
    from extensible_kv import ExtensibleTensor

    t = ExtensibleTensor(total, 1, DEVICE)
    t.resize_(total)
    stamp(t)
    handles_before = t.num_handles
    settle(pause_s)
    free_before = torch.cuda.mem_get_info()[0]
    ms = timed_ms(lambda: t.shrink_(keep, exact=exact))[0]
    freed = torch.cuda.mem_get_info()[0] - free_before
    out = {
        "ms": ms,
        "handles": [handles_before, t.num_handles],
        "physical_gib": t.physical_bytes / GIB,
        "freed_gib": freed / GIB,
        "ok": stamped_ok(t),
    }
    t.close()
    return out


def consolidate_once(per_segment: int, pause_s: float) -> dict[str, Any]:
    from extensible_kv import ExtensibleTensor

    # Room past each segment's prefix keeps the segments' runs apart: one handle each.
    t = ExtensibleTensor(4 * (per_segment + GIB), 4, DEVICE)
    for step in range(1, 65):
        t.resize_per_segment_(per_segment * step // 64 // (2 << 20) * (2 << 20) or (2 << 20))
    stamp(t)
    handles_before = t.num_handles
    settle(pause_s)
    ms = timed_ms(t.consolidate)[0]
    out = {
        "ms": ms,
        "bytes": t.physical_bytes,
        "handles": [handles_before, t.num_handles],
        "ok": stamped_ok(t),
    }
    t.close()
    return out


def recommit_once(total: int, pause_s: float) -> dict[str, Any]:
    from extensible_kv import ExtensibleTensor

    t = ExtensibleTensor(total, 1, DEVICE)
    t.resize_(total)
    settle(pause_s)
    release_ms = timed_ms(t.release_physical)[0]
    settle(pause_s)
    grow_ms = timed_ms(lambda: t.resize_(total))[0]
    t.close()
    return {"release_ms": release_ms, "grow_ms": grow_ms}


def copy_floor(num_bytes: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = min(timed_ms(lambda: dst.copy_(src))[0] for _ in range(3))
    return ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_shrink"))
    parser.add_argument("--gib", type=float, default=120.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pause", type=float, default=3.0)
    args = parser.parse_args(argv)

    global torch
    import torch as torch_module

    torch = torch_module
    from extensible_kv import vmm_unavailable_reason

    if (reason := vmm_unavailable_reason(DEVICE)) is not None:
        log(f"no CUDA VMM device: {reason}")
        return 2
    torch.zeros(1, device=DEVICE)
    total = int(args.gib * GIB) // (2 << 20) * (2 << 20)
    keep = total // 2 + 300 * (1 << 20)  # inside a 1 GiB handle: 300 MiB of it still live
    per_segment = int(args.gib * 5 / 6 / 4 * GIB) // (2 << 20) * (2 << 20)
    res: dict[str, Any] = {"total_bytes": total, "keep_bytes": keep, "per_segment": per_segment}
    res["plain"] = [shrink_once(total, keep, False, args.pause) for _ in range(args.reps)]
    res["exact"] = [shrink_once(total, keep, True, args.pause) for _ in range(args.reps)]
    res["consolidate"] = [consolidate_once(per_segment, args.pause) for _ in range(args.reps)]
    res["recommit"] = [recommit_once(total, args.pause) for _ in range(args.reps)]
    settle(args.pause)
    res["copy_floor_ms"] = {
        "straddler": copy_floor(300 * (1 << 20)),
        "segment": copy_floor(per_segment),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_shrink.json").write_text(json.dumps(res, indent=2))

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def runs(rows: list[dict[str, Any]]) -> str:
        return ", ".join(f"{r['ms']:.1f}" for r in rows)

    floor_seg = res["copy_floor_ms"]["segment"]
    cons_bytes = res["consolidate"][0]["bytes"]
    print(f"### Shrink {total / GIB:.0f} GiB to {keep / GIB:.2f} GiB, consolidate, recommit\n")
    print("| operation | ms (median of runs) | handles before -> after | GB/s | contents kept |")
    print("|---|---|---|---|---|")
    for name in ("plain", "exact"):
        rows = res[name]
        ms = med(rows, "ms")
        freed = statistics.median(r["freed_gib"] for r in rows)
        print(
            f"| shrink, {name} | {ms:.1f} ({runs(rows)}) "
            f"| {rows[0]['handles'][0]} -> {rows[0]['handles'][1]} | {freed * GIB / ms / 1e6:.0f} "
            f"freed | {all(r['ok'] for r in rows)} |"
        )
    rows = res["consolidate"]
    cons_ms = med(rows, "ms")
    print(
        f"| consolidate, 4 x {per_segment / GIB:.1f} GiB grown in 64 steps | {cons_ms:.1f} "
        f"({runs(rows)}) | {rows[0]['handles'][0]} -> "
        f"{rows[0]['handles'][1]} | {cons_bytes / cons_ms / 1e6:.0f} copied "
        f"| {all(r['ok'] for r in rows)} |"
    )
    rows = res["recommit"]
    rel, grow = med(rows, "release_ms"), med(rows, "grow_ms")
    print(
        f"| release + recommit (contents lost) | {rel:.1f} + {grow:.1f} | - "
        f"| {total / (rel + grow) / 1e6:.0f} | False |"
    )
    print(
        f"\nDevice copy floor: {floor_seg:.1f} ms for one segment "
        f"({per_segment / floor_seg / 1e6:.0f} GB/s), x4 = {4 * floor_seg:.1f} ms; "
        f"consolidate / floor = {cons_ms / (4 * floor_seg):.2f}. 300 MiB copy: "
        f"{res['copy_floor_ms']['straddler']:.2f} ms."
    )
    print(f"\nJSON: {args.out / 'bench_shrink.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
