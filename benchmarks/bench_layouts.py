"""Bulk extend on vLLM 0.34's own layouts, ours beside vLLM's `ExtensibleTensor`, the legacy
allocation and the memset floor, in one process and run.

    python3 benchmarks/bench_layouts.py --out DIR [--quick] [--shapes a,b] [--contenders a,b]

vLLM 0.34 backs every layer with one allocation. Under its default layer-outermost layout
(LBNHC) each layer is a segment of `capacity x block_stride` bytes, padded apart to the granule
(`pad_kv_cache_segments`), and a commit grows every segment from its first block; under
block-outermost (BLNHC) the allocation is one segment whose first two blocks are committed at
allocation. This bench builds exactly those geometries, commits the minimum, then times the
extend to ~120 GiB (zeroed) per contender:

- `ours`: `extensible_kv.ExtensibleTensor`, default handle policy (cut at cap multiples);
  `ours:<cut>[@GiB]`: the same with another cut of runs into handles
  (`aligned_powers_of_two`, `whole_runs`) or cap;
- `vllm`: vLLM 0.34.0's `ExtensibleTensor` (from .vendor/vllm034, git-ignored; carry it);
- `legacy`: one `torch.zeros` of the same bytes, as engines allocate the cache today;
- `floor`: `cuMemsetD8Async` (what ours zeroes with) over memory allocated beforehand: the
  device's zeroing time, no mapping; torch's `zero_()` of the same buffer is recorded beside
  it (`torch_zero_ms`: a slower kernel on the H200, so not the floor);
- `pages`: ours with one handle per run, not zeroed: what getting the pages costs (create,
  map, access). After a large free `cuMemCreate` waits for the driver's scrub of the freed
  pages, work on the device that no caller can skip: `pages + floor` is then the floor of a
  zeroed extend, and the report gives `it / (pages + floor)` beside `it / floor`.

Steady state: each repetition starts after a pause (the driver scrubs released memory in the
background and cuMemCreate waits for it: docs/design.md §2); `just freed`: one repetition
right after the contender's own teardown (its last steady one). `--fresh`: each repetition
in a fresh process instead (a serving stack's start: nothing of this size was freed in the
process before it, and the pause follows the previous process's exit), no just-freed one.
Also: the teardown (free) time, the first read of the committed bytes (TLB warm-up), and for
ours (built with `_profile=True`: a clock read per driver call) the driver calls of every
extend, their host time and the create time alone (`create_ms`: the scrub wait). Prints
markdown tables and writes DIR/bench_layouts.json (rewritten after every shape). `--device
cpu` runs it on the host backend with a small commit and without vLLM's tensor (a smoke test
of this script).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import common
from common import GIB, child_json, driver_memset, driver_profile, log, settle, sync, timed_ms
from common import median as med

DEVICE = "cuda:0"
REPO = Path(__file__).resolve().parent.parent
VENDOR = REPO / ".vendor" / "vllm034"

torch: Any = None


@dataclass(frozen=True)
class Shape:
    """A model's KV cache per GPU: layers, KV heads, head sizes (one per layer, cycled)."""

    label: str
    num_layers: int
    num_kv_heads: int
    head_sizes: tuple[int, ...]
    layout: str  # "LBNHC" (a segment per layer, padded to the granule) or "BLNHC" (one)
    block_size: int = 16
    itemsize: int = 2  # bf16

    def block_strides(self) -> list[int]:
        """Bytes one block takes in each layer: N tokens x H heads x (K and V) x D."""
        return [
            self.block_size
            * self.num_kv_heads
            * 2
            * self.head_sizes[i % len(self.head_sizes)]
            * self.itemsize
            for i in range(self.num_layers)
        ]


SHAPES = {
    "qwen3_0.6b": Shape("Qwen3-0.6B-like, LBNHC", 28, 8, (128,), "LBNHC"),
    "llama3_8b": Shape("Llama-3-8B-like, LBNHC", 32, 8, (128,), "LBNHC"),
    "llama2_7b": Shape("Llama-2-7B-like, LBNHC", 32, 32, (128,), "LBNHC"),
    "mixed_heads": Shape(
        "40 layers, head sizes 128/256 alternating, LBNHC", 40, 4, (128, 256), "LBNHC"
    ),
    "llama3_70b_tp8": Shape("Llama-3-70B-like TP8 (1 KV head/rank), LBNHC", 80, 1, (128,), "LBNHC"),
    "llama3_70b_tp8_blnhc": Shape("Llama-3-70B-like TP8, BLNHC", 80, 1, (128,), "BLNHC"),
}
QUICK_SHAPES = "llama3_70b_tp8,llama3_70b_tp8_blnhc"
CONTENDERS = ",".join(
    [
        "ours",
        "ours:whole_runs",
        "vllm",
        "legacy",
        "floor",
        "pages",
    ]
)


@dataclass(frozen=True)
class Geometry:
    """The allocation as vLLM 0.34 lays it out for `capacity_blocks`."""

    segment_capacities: tuple[int, ...]
    segment_strides: tuple[int, ...]  # bytes one block adds to each segment
    min_blocks: int

    @property
    def size(self) -> int:
        return sum(self.segment_capacities)

    def sizes(self, num_blocks: int) -> list[int]:
        return [num_blocks * s for s in self.segment_strides]


def geometry(shape: Shape, capacity_blocks: int, granule: int) -> Geometry:
    strides = shape.block_strides()
    if shape.layout == "BLNHC":
        stride = sum(strides)
        return Geometry((capacity_blocks * stride,), (stride,), 2)
    assert shape.layout == "LBNHC", shape.layout
    padded = tuple(-(-capacity_blocks * s // granule) * granule for s in strides)
    return Geometry(padded, tuple(strides), 1)


def footprint(geo: Geometry, num_blocks: int, granule: int) -> int:
    """Physical bytes of `num_blocks` committed: whole granules per (granule-aligned) segment."""
    if len(geo.segment_capacities) == 1:
        return -(-num_blocks * geo.segment_strides[0] // granule) * granule
    return sum(-(-num_blocks * s // granule) * granule for s in geo.segment_strides)


# --------------------------------------------------------------------------------------------
# contenders


class Ours:
    """`ours[:<cut>][@<cap GiB>]`: the default policy, or another cut or cap."""

    def __init__(self, geo: Geometry, variant: str, zero: bool = True) -> None:
        from extensible_kv import ExtensibleTensor, HandleSizing

        cut, _, cap_gib = variant.partition("@")
        sizing = HandleSizing(
            cut or "cap_aligned",  # type: ignore[arg-type]
            int(float(cap_gib) * GIB) if cap_gib else None,
        )
        self.t = ExtensibleTensor(
            geo.size,
            None,
            DEVICE,
            segment_capacities=list(geo.segment_capacities),
            handle_sizing=sizing,
            _profile=True,
        )
        self.zero = zero

    def grow(self, sizes: list[int]) -> None:
        self.t.resize_per_segment_(sizes, zero_new=self.zero)

    def handles(self) -> int:
        return int(self.t.num_handles)

    def segment(self, i: int) -> Any:
        return self.t.segment_view(i)

    def teardown(self) -> None:
        self.t.close()


class Vllm:
    cls: Any = None

    def __init__(self, geo: Geometry) -> None:
        self.t = Vllm.cls(geo.size, device=DEVICE, segment_capacities=list(geo.segment_capacities))

    def grow(self, sizes: list[int]) -> None:
        self.t.resize_segments_(sizes, zero_new=True)

    def handles(self) -> int:
        return int(self.t.num_physical_chunks)

    def segment(self, i: int) -> Any:
        return self.t.segment_view(i)

    def teardown(self) -> None:
        self.t.free()


def read_tbps(tensors: list[Any], num_bytes: int) -> float:
    """One read pass over the committed bytes (the first: TLB warm-up included)."""
    sync(torch.device(DEVICE))
    start = time.perf_counter()
    for t in tensors:
        if t.numel():
            t.view(torch.int64 if t.numel() % 8 == 0 else torch.uint8).max()
    sync(torch.device(DEVICE))
    return num_bytes / (time.perf_counter() - start) / 1e12


def one_extend(name: str, geo: Geometry, target: int, pause_s: float, read: bool) -> dict[str, Any]:
    """Reserve, commit the minimum, pause, extend to `target` blocks (timed), read, free."""
    kind, _, variant = name.partition(":")
    c: Ours | Vllm
    if kind == "ours":
        c = Ours(geo, variant)
    elif kind == "pages":
        c = Ours(geo, "whole_runs", zero=False)
    else:
        c = Vllm(geo)
    c.grow(geo.sizes(geo.min_blocks))
    settle(pause_s, torch.device(DEVICE))
    if isinstance(c, Ours):
        c.t._profile_report(reset=True)
    start = time.perf_counter()
    c.grow(geo.sizes(target))
    sync(torch.device(DEVICE))
    ms = (time.perf_counter() - start) * 1e3
    out: dict[str, Any] = {"ms": ms, "handles": c.handles()}
    if isinstance(c, Ours):
        ops = driver_profile(c.t)
        out["ops"] = ops
        out["create_ms"] = ops.get("create", [0, 0.0])[1]
    if read:
        views = [c.segment(i) for i in range(len(geo.segment_capacities))]
        out["read_tbps"] = read_tbps(views, sum(v.numel() for v in views))
        del views
    gc.collect()
    start = time.perf_counter()
    c.teardown()
    sync(torch.device(DEVICE))
    out["teardown_ms"] = (time.perf_counter() - start) * 1e3
    return out


def legacy_once(num_bytes: int, pause_s: float) -> float:
    settle(pause_s, torch.device(DEVICE))
    start = time.perf_counter()
    buf = torch.zeros(num_bytes, dtype=torch.uint8, device=DEVICE)
    sync(torch.device(DEVICE))
    ms = (time.perf_counter() - start) * 1e3
    del buf
    return ms


def floor_once(num_bytes: int, pause_s: float) -> dict[str, float]:
    """The driver's memset of a buffer allocated beforehand and written once already (torch's
    `zero_()` where cuda-python is absent), then torch's `zero_()` of it. The first memset
    (`first_touch_ms`) is not the floor: in a fresh process it took 43.5-53.6 ms for 120 GiB
    where the second took 27.9-28.1, and 23.8-30.5 ms for 8 GiB where the second took 1.9
    (2026-12-04, `--fresh`): a fixed cost of the process's first driver memset, not of the
    pages."""
    device = torch.device(DEVICE)
    buf = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    settle(pause_s, device)
    out: dict[str, float] = {}
    if device.type == "cuda":
        ptr, stream = buf.data_ptr(), torch.cuda.current_stream(device).cuda_stream
        with contextlib.suppress(ImportError):
            out["first_touch_ms"], _ = timed_ms(
                lambda: driver_memset(ptr, num_bytes, stream), device
            )
            out["ms"], _ = timed_ms(lambda: driver_memset(ptr, num_bytes, stream), device)
    out["torch_zero_ms"], _ = timed_ms(buf.zero_, device)
    out.setdefault("ms", out["torch_zero_ms"])
    del buf
    return out


def repetition(
    name: str, geo: Geometry, target: int, num_bytes: int, pause_s: float, read: bool
) -> dict[str, Any]:
    """One repetition of contender `name` after `pause_s` (steady state), or none (just
    freed: the memory freed just before is still being scrubbed)."""
    if name == "legacy":
        return {"ms": legacy_once(num_bytes, pause_s)}
    if name == "floor":
        return floor_once(num_bytes, pause_s)
    return one_extend(name, geo, target, pause_s, read and name != "pages")


def capacity_for(target: int) -> int:
    """The blocks a shape's allocation is reserved for: some room above the extend's target."""
    return int(target * 1.05) + 2


def fresh_repetition(args: argparse.Namespace, key: str, target: int, name: str) -> dict[str, Any]:
    """One repetition of contender `name` in a child process of its own (`--one-fresh`)."""
    command = [sys.executable, __file__, "--device", DEVICE, "--pause", str(args.pause)]
    command += ["--one-fresh", f"{key}:{target}:{name}"]
    command += [] if args.read else ["--no-read"]
    return child_json(command, f"{name}'s fresh process")


def one_fresh(spec: str, args: argparse.Namespace, granule: int) -> dict[str, Any]:
    """The child of `fresh_repetition`: the same geometry as its parent's, a warm-up of the
    contender's code paths on a small tensor (libcuda's and the memset's first calls), then
    one repetition."""
    key, target, name = spec.split(":", 2)
    geo = geometry(SHAPES[key], capacity_for(int(target)), granule)
    num_bytes = footprint(geo, int(target), granule)
    kind = name.partition(":")[0]
    if kind in ("ours", "pages", "vllm"):
        small = Geometry((2 * granule,), (granule,), 1)
        warm = Vllm(small) if kind == "vllm" else Ours(small, "")
        warm.grow([granule])
        warm.teardown()
    else:
        torch.zeros(granule, dtype=torch.uint8, device=DEVICE).zero_()
    settle(0, torch.device(DEVICE))
    return repetition(name, geo, int(target), num_bytes, args.pause, args.read)


def bench_shape(shape_key: str, args: argparse.Namespace, granule: int) -> dict[str, Any]:
    from extensible_kv import host_free_bytes

    shape = SHAPES[shape_key]
    strides = shape.block_strides()
    settle(0, torch.device(DEVICE))  # what torch cached for the previous shape is free memory too
    free_bytes = common.free_bytes(torch.device(DEVICE)) or host_free_bytes()
    margin = 6 * GIB if DEVICE != "cpu" else free_bytes // 2
    commit_bytes = min(int(args.commit_gib * GIB), free_bytes - margin)
    target = commit_bytes // sum(strides)
    geo = geometry(shape, capacity_for(target), granule)
    num_bytes = footprint(geo, target, granule)
    res: dict[str, Any] = {
        "shape": asdict(shape),
        "fresh": args.fresh,
        "segments": len(geo.segment_capacities),
        "target_blocks": target,
        "committed_bytes": num_bytes,
        "contenders": {},
    }
    log(
        f"== {shape.label}: {len(geo.segment_capacities)} segments, {target} blocks, "
        f"{num_bytes / GIB:.1f} GiB"
    )
    names = []
    for name in args.contenders.split(","):
        if name == "vllm" and Vllm.cls is None:
            res["contenders"][name] = {"skipped": "vLLM 0.34 baseline absent (.vendor)"}
            continue
        names.append(name)
        res["contenders"][name] = {"steady_ms": []}
    # Repetitions interleave the contenders in a shuffled order each time (seeded: a rerun
    # repeats it), so that no contender always follows the same one, whose free the driver
    # may still be scrubbing: a rotation kept every neighbour in place (docs/benchmarks.md).
    order = random.Random(f"{shape.label}/{args.reps}")
    for rep in range(args.reps):
        for name in order.sample(names, len(names)):
            entry = res["contenders"][name]
            if "error" in entry:
                continue
            try:
                if args.fresh:
                    run = fresh_repetition(args, shape_key, target, name)
                else:
                    run = repetition(name, geo, target, num_bytes, args.pause, args.read)
                entry["steady_ms"].append(run["ms"])
                if "handles" in run:
                    entry["handles"] = run["handles"]
                for key in (
                    "teardown_ms",
                    "read_tbps",
                    "create_ms",
                    "torch_zero_ms",
                    "first_touch_ms",
                ):
                    if key in run:
                        entry.setdefault(key, []).append(run[key])
                # Just freed: right after the contender's own teardown, as a stack that
                # sleeps and wakes sees it (after another's free, the first contender of a
                # fixed order paid for a 120 GiB cudaFree it did not make: 2026-12-03 run).
                if "ops" in run:
                    entry["ops"] = run["ops"]  # the last steady run's
                if rep == args.reps - 1 and name != "floor" and not args.fresh:
                    freed = repetition(name, geo, target, num_bytes, 0, False)
                    entry["just_freed_ms"] = freed["ms"]
                    if "create_ms" in freed:
                        entry["just_freed_create_ms"] = freed["create_ms"]
            except Exception as exc:  # one contender failing must not lose the others
                traceback.print_exc()
                entry["error"] = f"{type(exc).__name__}: {exc}"
                settle(0, torch.device(DEVICE))
    for name in names:
        entry = res["contenders"][name]
        log(f"  {name}: {json.dumps({k: v for k, v in entry.items() if k != 'ops'})}")
    return res


# --------------------------------------------------------------------------------------------
# report


def fmt(x: Any, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def table(res: dict[str, Any]) -> str:
    c = res["contenders"]
    num_bytes = res["committed_bytes"]

    def ms(name: str, key: str = "steady_ms") -> float:
        v = c.get(name, {}).get(key)
        return med(v) if isinstance(v, list) else (v if v is not None else float("nan"))

    lines = [
        f"### {res['shape']['label']}: {res['segments']} segments, "
        f"{num_bytes / GIB:.1f} GiB ({res['target_blocks']} blocks)"
        + ("; a fresh process per repetition" if res.get("fresh") else ""),
        "",
        "| contender | handles | steady ms (runs) | TB/s | create ms | just freed ms "
        "| teardown ms | first read TB/s | vLLM / it | legacy / it | it / floor "
        "| it / (pages + floor) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in c.items():
        if "steady_ms" not in e:
            lines.append(f"| {name} | {e.get('skipped') or e.get('error')} |||||||||")
            continue
        steady = med(e["steady_ms"])
        runs = ", ".join(f"{v:.1f}" for v in e["steady_ms"])
        fresh = e.get("just_freed_ms")
        ratio_v = ms("vllm") / steady
        ratio_l = ms("legacy") / steady
        ratio_f = steady / ms("floor")
        ratio_s = steady / (ms("pages") + ms("floor"))
        teardown = med(e.get("teardown_ms", []))
        create = med(e.get("create_ms", []))
        lines.append(
            f"| {name} | {e.get('handles', '-')} | {steady:.1f} ({runs}) "
            f"| {num_bytes / steady / 1e9:.2f} | {fmt(create)} | {fmt(fresh)} | {fmt(teardown)} "
            f"| {fmt(med(e.get('read_tbps', [])), 2)} | {fmt(ratio_v, 2)} | {fmt(ratio_l, 2)} "
            f"| {fmt(ratio_f, 2)} | {fmt(ratio_s, 2)} |"
        )
    just_freed = ms("vllm", "just_freed_ms") / ms("ours", "just_freed_ms")
    lines.append(f"\nJust freed: vLLM / ours (default) = {fmt(just_freed, 2)}")
    # The floor right after a free: its pages (their scrub then) and the memset.
    fresh_floor = ms("pages", "just_freed_ms") + ms("floor")
    fresh_ours = ms("ours", "just_freed_ms") / fresh_floor
    lines.append(f"Just freed: ours / (pages just freed + floor) = {fmt(fresh_ours, 2)}")
    torch_zero = c.get("floor", {}).get("torch_zero_ms")
    if torch_zero:
        lines.append(f"torch `zero_()` of the floor's buffer: {fmt(med(torch_zero))} ms")
    if first_touch := c.get("floor", {}).get("first_touch_ms"):
        lines.append(f"The floor buffer's first memset (not the floor): {fmt(med(first_touch))} ms")
    for name, e in c.items():
        if "ops" in e:
            ops = ", ".join(f"{op} {n}x {t:.1f} ms" for op, (n, t) in sorted(e["ops"].items()) if n)
            lines.append(f"\nDriver calls of {name}'s last steady extend: {ops}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global torch, DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_layouts"))
    parser.add_argument("--quick", action="store_true", help="two shapes, small, one rep")
    parser.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--contenders", default=CONTENDERS)
    parser.add_argument("--commit-gib", type=float, default=120.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--pause", type=float, default=3.0)
    parser.add_argument("--no-read", dest="read", action="store_false")
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (ours alone, small)")
    parser.add_argument(
        "--fresh", action="store_true", help="each repetition in a fresh process (a start)"
    )
    parser.add_argument("--one-fresh", help="(--fresh's child) SHAPE:TARGET:CONTENDER")
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes = args.shapes or QUICK_SHAPES
        args.commit_gib, args.reps, args.pause = min(args.commit_gib, 8.0), 1, 0.5
    shapes = (args.shapes or ",".join(SHAPES)).split(",")

    import torch as torch_module

    torch = torch_module
    from extensible_kv import ExtensibleTensor, vmm_unavailable_reason

    DEVICE = args.device
    if DEVICE == "cpu":  # a smoke run of this script on the host backend
        args.commit_gib, args.pause = min(args.commit_gib, 0.25), 0.0
    elif (reason := vmm_unavailable_reason(DEVICE)) is not None:
        log(f"no CUDA VMM device: {reason}")
        return 2
    with ExtensibleTensor(1, 1, DEVICE) as probe:
        granule = probe.granularity
    if DEVICE == "cpu":
        log("vLLM baseline skipped: it drives CUDA")
    elif (VENDOR / "extensible_tensor.py").exists():
        sys.path.insert(0, str(VENDOR))
        from extensible_tensor import ExtensibleTensor as VllmTensor  # type: ignore

        Vllm.cls = VllmTensor
    else:
        log(f"vLLM baseline skipped: {VENDOR} is absent")
    torch.zeros(1, device=DEVICE)
    if args.one_fresh:
        print(json.dumps(one_fresh(args.one_fresh, args, granule)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_layouts.json"
    results: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}}
    for key in shapes:
        try:
            results[key] = bench_shape(key, args, granule)
        except Exception as exc:
            traceback.print_exc()
            results[key] = {"error": f"{type(exc).__name__}: {exc}"}
        path.write_text(json.dumps(results, indent=2))
        if "contenders" in results[key]:
            print(table(results[key]), flush=True)
            print(flush=True)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
