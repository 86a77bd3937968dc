"""Giving memory back without losing data, on the GPU: shrink (plain and exact), consolidate,
and the release + recommit that peers do instead (discarding the contents), beside the device
copy floor measured in the same run.

    python3 benchmarks/bench_shrink.py --out DIR [--gib 120] [--reps 3] [--pause 3] [--profile]
        [--segments 4] [--scrub] [--steps]

- shrink: a one-segment cache of `--gib` GiB (default cut, 1 GiB cap) shrunk to a bit over
  half (the frontier inside a handle): `plain` releases the handles past it and keeps the one
  that straddles it; `exact` also replaces that one by a handle of its live granules, copying
  them. Contents are checked after each.
- consolidate: `--segments` (4) segments grown to `--gib` * 5/6 GiB in all in 64 steps, then
  backed by one handle per segment (every byte copied once, a segment's copy overlapping the
  previous segment's swap when there is room); the copy floor is one segment's copy times the
  segments. 80 segments is a 70B TP8 LBNHC cache's. Beside it, the teardown of the old handles
  alone (a tensor grown the same way, `release_physical`): the driver's unmaps and releases,
  which no order of calls avoids (the copies run under them; a second thread for them is
  slower: the driver serialises its calls).
- release + recommit: drop everything and grow back to the same size, zeroed (what vLLM 0.34's
  `commit(shrink=True)` and `commit(defragment=True)` do: the contents are lost).
- floor: `torch` device copy of the same bytes between two preallocated buffers.
- `--scrub`: a segment's bytes released, then created as one handle after 0-1000 ms.
- `--steps`: consolidate's steps one at a time (create a segment's new handle, copy, release
  the old), back to back and 1 s apart: each create's wait for the scrub of what the step
  before released.

Steady state: a pause before each repetition (docs/design.md §2: the driver scrubs released
memory in the background). Prints a markdown table, writes DIR/bench_shrink.json.

`--profile` builds the tensors with `_profile=True` and records, for each timed step, the
driver calls it made and their host time (`_profile_report`: create, map, set_access, memset,
copy, synchronize, unmap, release, ...), printed as a second table: where the time goes, and
what is left for the host side and Python. `--device cpu` runs it all on the host backend with small
sizes (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from common import GIB, driver_profile, free_bytes, log, settle, timed_ms

DEVICE = "cuda:0"
PROFILE = False
torch: Any = None


def new_tensor(max_bytes: int, num_segments: int) -> Any:
    from extensible_kv import ExtensibleTensor

    return ExtensibleTensor(max_bytes, num_segments, DEVICE, _profile=PROFILE)


def grow_in_steps(t: Any, num_bytes: int, steps: int, zero_new: bool) -> None:
    """Grows every segment of `t` to `num_bytes` in `steps` granule-aligned grows: one handle
    or more per grow, as a cache that grew with its load holds them."""
    g = t.granularity
    for step in range(1, steps + 1):
        t.resize_per_segment_(num_bytes * step // steps // g * g or g, zero_new=zero_new)


def one_handle_tensor(num_bytes: int, profile: bool) -> Any:
    """A one-segment tensor whose grows make one handle per run: what consolidate creates."""
    from extensible_kv import ExtensibleTensor, HandleSizing

    return ExtensibleTensor(
        num_bytes, 1, DEVICE, handle_sizing=HandleSizing("whole_runs"), _profile=profile
    )


def ops(t: Any) -> dict[str, list[float]]:
    """The driver calls since the last call, `{op: [calls, host ms]}` (empty unless profiling)."""
    if not PROFILE:
        return {}
    return driver_profile(t)


def timed_step(t: Any, fn: Any) -> tuple[float, dict[str, list[float]]]:
    """`fn()`'s milliseconds (device synchronized) and the driver calls it made."""
    ops(t)
    ms = timed_ms(fn, torch.device(DEVICE))[0]
    return ms, ops(t)


def free_now() -> int:
    from extensible_kv import host_free_bytes

    return free_bytes(torch.device(DEVICE)) or host_free_bytes()


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
    t = new_tensor(total, 1)
    t.resize_(total)
    stamp(t)
    handles_before = t.num_handles
    settle(pause_s, torch.device(DEVICE))
    free_before = free_now()
    # Timed until the memory is back (the release itself runs on the tensor's thread).
    ms, step_ops = timed_step(t, lambda: (t.shrink_(keep, exact=exact), t.wait_released()))
    freed = free_now() - free_before
    out = {
        "ms": ms,
        "ops": step_ops,
        "handles": [handles_before, t.num_handles],
        "physical_gib": t.physical_bytes / GIB,
        "freed_gib": freed / GIB,
        "ok": stamped_ok(t),
    }
    t.close()
    return out


def fragmented(per_segment: int, segments: int) -> Any:
    """`segments` segments grown to `per_segment` bytes in 64 steps: what consolidate meets.
    Room past each segment's prefix keeps the segments' runs apart: one handle each after it."""
    t = new_tensor(segments * (per_segment + GIB), segments)
    grow_in_steps(t, per_segment, 64, zero_new=True)
    return t


def consolidate_once(per_segment: int, segments: int, pause_s: float) -> dict[str, Any]:
    t = fragmented(per_segment, segments)
    stamp(t)
    handles_before = t.num_handles
    settle(pause_s, torch.device(DEVICE))
    ms, step_ops = timed_step(t, t.consolidate)
    out = {
        "ms": ms,
        "ops": step_ops,
        "bytes": t.physical_bytes,
        "handles": [handles_before, t.num_handles],
        "ok": stamped_ok(t),
    }
    t.close()
    # The driver's part that no order of calls avoids: unmapping and releasing the old handles
    # (a tensor grown the same way, released alone). Its cost goes with the handles and bytes,
    # not the calls (one unmap over adjacent mappings cost as much as one per mapping).
    t = fragmented(per_segment, segments)
    settle(pause_s, torch.device(DEVICE))
    out["old_teardown_ms"], out["old_teardown_ops"] = timed_step(t, _release_and_wait(t))
    t.close()
    return out


def _release_and_wait(t: Any) -> Callable[[], object]:
    """`release_physical`, then the wait for its release (done on the tensor's thread): the
    teardown's whole cost, as before the release was deferred."""
    return lambda: (t.release_physical(), t.wait_released())


def recommit_once(total: int, pause_s: float) -> dict[str, Any]:
    t = new_tensor(total, 1)
    t.resize_(total)
    settle(pause_s, torch.device(DEVICE))
    release_ms, release_ops = timed_step(t, _release_and_wait(t))
    settle(pause_s, torch.device(DEVICE))
    grow_ms, grow_ops = timed_step(t, lambda: t.resize_(total))
    t.close()
    return {
        "release_ms": release_ms,
        "grow_ms": grow_ms,
        "release_ops": release_ops,
        "grow_ops": grow_ops,
    }


SCRUB_DELAYS_S = (0.0, 0.01, 0.05, 0.2, 1.0)


def scrub_once(num_bytes: int, delay_s: float, pause_s: float, created: int) -> dict[str, Any]:
    """`num_bytes` in 1 GiB handles released, then, `delay_s` later, `created` bytes created as
    one handle (not zeroed): how long `cuMemCreate` waits for the driver's scrub of memory
    freed just before -- what each step of `consolidate` but the first meets. With `created`
    below `num_bytes` and that much never-freed memory free besides, it tells whether create
    waits for the pages it takes or for every pending scrub."""
    old = new_tensor(num_bytes, 1)
    old.resize_(num_bytes, zero_new=False)
    settle(pause_s, torch.device(DEVICE))
    release_ms, _ = timed_ms(old.close, torch.device(DEVICE))
    time.sleep(delay_s)
    new = one_handle_tensor(created, profile=True)
    ms, _ = timed_ms(lambda: new.resize_(created, zero_new=False), torch.device(DEVICE))
    calls = driver_profile(new, reset=False)
    new.close()
    settle(pause_s, torch.device(DEVICE))
    return {
        "delay_s": delay_s,
        "created": created,
        "release_ms": release_ms,
        "ms": ms,
        "ops": calls,
    }


STEP_GAPS_S = (0.0, 1.0)


def steps_once(per_segment: int, segments: int, gap_s: float, pause_s: float) -> dict[str, Any]:
    """`consolidate`'s steps by hand, each timed alone: `segments` tensors of `per_segment`
    bytes grown in 22 steps, then for each, one new handle of `per_segment` bytes created, a
    copy into it, and the old tensor released; `gap_s` after each release. On a full device
    every create but the first needs what the step before released: with no gap it waits for
    the driver's scrub of it, a second later it does not."""
    device = torch.device(DEVICE)
    olds = [new_tensor(per_segment, 1) for _ in range(segments)]
    for old in olds:
        grow_in_steps(old, per_segment, 22, zero_new=False)
    old_handles = olds[0].num_handles
    settle(pause_s, device)
    rows, news = [], []
    for old in olds:
        new = one_handle_tensor(per_segment, profile=PROFILE)
        row = {"create_ms": timed_ms(partial(new.resize_, per_segment, zero_new=False), device)[0]}
        # The view after the grow: before it, segment 0 holds no bytes.
        copy = partial(new.segment_view(0).copy_, old.segment_view(0))
        row["copy_ms"] = timed_ms(copy, device)[0]
        del copy  # its views: `close` refuses while any is alive
        row["release_ms"] = timed_ms(old.close, device)[0]
        rows.append(row)
        news.append(new)
        time.sleep(gap_s)
    for new in news:
        new.close()
    settle(pause_s, device)
    return {"gap_s": gap_s, "old_handles": old_handles, "steps": rows}


def steps_table(runs: list[dict[str, Any]], per_segment: int) -> str:
    lines = [
        "",
        f"### Consolidate's steps one at a time: {per_segment / GIB:.2f} GiB a step",
        "",
        "| gap after each release s | first create ms | later creates ms | copies ms "
        "| releases ms |",
        "|---|---|---|---|---|",
    ]

    def spread(values: list[float]) -> str:
        return f"{min(values):.1f}-{max(values):.1f}" if values else "-"

    for run in runs:
        rows = run["steps"]
        cells = [f"{rows[0]['create_ms']:.1f}", spread([r["create_ms"] for r in rows[1:]])]
        cells += [spread([r[k] for r in rows]) for k in ("copy_ms", "release_ms")]
        lines.append(f"| {run['gap_s']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def copy_floor(num_bytes: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = min(timed_ms(lambda: dst.copy_(src), torch.device(DEVICE))[0] for _ in range(3))
    return ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_shrink"))
    parser.add_argument("--gib", type=float, default=120.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pause", type=float, default=3.0)
    parser.add_argument("--profile", action="store_true", help="driver calls per step")
    parser.add_argument(
        "--segments", type=int, default=4, help="consolidate: segments sharing 5/6 of --gib"
    )
    parser.add_argument(
        "--scrub", action="store_true", help="create right after a release, by delay"
    )
    parser.add_argument(
        "--steps",
        action="store_true",
        help="consolidate's steps one at a time, back to back and 1 s apart",
    )
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (small sizes)")
    args = parser.parse_args(argv)

    global torch, DEVICE, PROFILE
    import torch as torch_module

    torch = torch_module
    from extensible_kv import vmm_unavailable_reason

    DEVICE, PROFILE = args.device, args.profile
    straddler = 300 * (1 << 20)
    if DEVICE == "cpu":
        args.gib, args.pause, straddler = min(args.gib, 0.25), 0.0, 3 << 20
    elif (reason := vmm_unavailable_reason(DEVICE)) is not None:
        log(f"no CUDA VMM device: {reason}")
        return 2
    torch.zeros(1, device=DEVICE)
    g = new_tensor(1, 1).granularity
    total = int(args.gib * GIB) // g * g
    keep = total // 2 + straddler  # inside a handle: `straddler` bytes of it still live
    n = args.segments
    per_segment = int(args.gib * 5 / 6 / n * GIB) // g * g
    res: dict[str, Any] = {"total_bytes": total, "keep_bytes": keep, "per_segment": per_segment}
    res["plain"] = [shrink_once(total, keep, False, args.pause) for _ in range(args.reps)]
    res["exact"] = [shrink_once(total, keep, True, args.pause) for _ in range(args.reps)]
    res["segments"] = n
    res["consolidate"] = [consolidate_once(per_segment, n, args.pause) for _ in range(args.reps)]
    res["recommit"] = [recommit_once(total, args.pause) for _ in range(args.reps)]
    if args.scrub:
        half = per_segment // 2 // g * g
        res["scrub"] = [scrub_once(per_segment, d, args.pause, per_segment) for d in SCRUB_DELAYS_S]
        res["scrub"].append(scrub_once(per_segment, 0.0, args.pause, half))
    if args.steps:
        gaps = (0.0, 0.01) if DEVICE == "cpu" else STEP_GAPS_S
        res["steps"] = [steps_once(per_segment, n, gap, args.pause) for gap in gaps]
    settle(args.pause, torch.device(DEVICE))
    res["copy_floor_ms"] = {
        "straddler": copy_floor(straddler),
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
        f"| consolidate, {n} x {per_segment / GIB:.2f} GiB grown in 64 steps | {cons_ms:.1f} "
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
        f"({per_segment / floor_seg / 1e6:.0f} GB/s), x{n} = {n * floor_seg:.1f} ms; "
        f"consolidate / floor = {cons_ms / (n * floor_seg):.2f}. "
        f"{straddler / (1 << 20):.0f} MiB copy: "
        f"{res['copy_floor_ms']['straddler']:.2f} ms."
    )
    old_runs = [r["old_teardown_ms"] for r in res["consolidate"]]
    old_ms = statistics.median(old_runs)
    print(
        "Teardown of the old handles alone (the same growth, `release_physical`): "
        f"{old_ms:.1f} ms ({', '.join(f'{v:.1f}' for v in old_runs)}); "
        f"consolidate / (copy floor + that) = {cons_ms / (n * floor_seg + old_ms):.2f}."
    )
    if PROFILE:
        print(profile_table(res))
    if "scrub" in res:
        print(scrub_table(res["scrub"], per_segment))
    if "steps" in res:
        print(steps_table(res["steps"], per_segment))
    print(f"\nJSON: {args.out / 'bench_shrink.json'}")
    return 0


def scrub_table(rows: list[dict[str, Any]], num_bytes: int) -> str:
    lines = [
        "",
        f"### The scrub: {num_bytes / GIB:.1f} GiB released, then created (one handle)",
        "",
        "| delay ms | GiB created | release ms | create ms | create GB/s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        create = r["ops"].get("create", [0, float("nan")])[1]
        lines.append(
            f"| {r['delay_s'] * 1e3:.0f} | {r['created'] / GIB:.1f} | {r['release_ms']:.1f} "
            f"| {create:.1f} | {r['created'] / create / 1e6:.0f} |"
        )
    return "\n".join(lines)


def profile_table(res: dict[str, Any]) -> str:
    """Per step, the median repetition's driver calls: calls and host ms per op, their sum,
    and what the step took beyond them (host side, Python, the device's wait)."""
    steps = [
        ("shrink, plain", res["plain"], "ms", "ops"),
        ("shrink, exact", res["exact"], "ms", "ops"),
        ("consolidate", res["consolidate"], "ms", "ops"),
        ("release (teardown of the mappings)", res["recommit"], "release_ms", "release_ops"),
        ("recommit (grow, zeroed)", res["recommit"], "grow_ms", "grow_ops"),
    ]
    lines = ["", "### Where the time goes (`--profile`: driver calls, host ms)", ""]
    lines += [
        "| step | ms | driver calls: op (calls, ms) | sum of calls | rest |",
        "|---|---|---|---|---|",
    ]
    for name, rows, ms_key, ops_key in steps:
        row = sorted(rows, key=lambda r: r[ms_key])[len(rows) // 2]
        calls = row[ops_key]
        spent = sum(ms for _, ms in calls.values())
        detail = ", ".join(
            f"{op} ({int(n)}, {ms:.1f})"
            for op, (n, ms) in sorted(calls.items(), key=lambda kv: -kv[1][1])
        )
        lines.append(
            f"| {name} | {row[ms_key]:.1f} | {detail} | {spent:.1f} | {row[ms_key] - spent:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
