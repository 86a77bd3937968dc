"""SGLang 0.5.23's own post-capture KV arena (`kv_vmm_backing.KvVmmBufferOwner`) against
extensible-kv's owner (`extensible_kv.sglang.KvVmmBufferOwner`), side by side in one process.

    python3 benchmarks/bench_sglang.py --out DIR [--quick] [--reps 2] [--pause 3] [--gib 120]
        [--tms] [--contenders ours,tms]

Shapes (the buffers `MHATokenToKVPool` describes with post-capture active: K then V per layer,
rows of one token, bf16): `8b` (32 layers, 8 KV heads of 128) and `70b_tp8` (80 layers, one KV
head of 128 per rank). The reservation is the device's total memory (SGLang's VA upper bound).
Per shape, repetition and contender -- SGLang's class, ours like for like (no zeroing, as
SGLang's arena), ours zeroing -- the steps, each timed with `time.perf_counter()` around the
call and a `torch.cuda.synchronize()`:
  construct   the owner: reserve, place the buffers, back one page (slot 0). SGLang's first
              construct in the process also compiles its bump allocator (`load_inline`): that
              one is reported apart as `first_construct`, and never counted in `construct`;
  warmup      `ensure_prefix(4096)`: what capture and warm-up touch;
  finalize    `finalize(n)` for n tokens of about `--gib` GiB (less when the free memory, less a
              2 GiB margin, is smaller), after a pause (the driver scrubs memory freed earlier);
  release, resume   give every byte back, then recommit at the same addresses (SGLang's
              arena cannot): ours, and with `--tms` torch_memory_saver, what SGLang releases
              its KV cache with under `--enable-memory-saver` -- like for like: the same
              buffers made at the finalize's size (`torch.empty`, in its `kv_cache` region;
              that allocation is its `finalize` time), `pause("kv_cache")`, a pause,
              `resume("kv_cache")` (not zeroed, contents lost, as ours without zeroing). It
              runs in a child process of its own (its pluggable allocator and pools live as
              long as the process), from SGLang's vendored wheels;
  close       `close()`.
Medians over the repetitions; markdown tables on stdout, DIR/bench_sglang.json. SGLang comes
installed or from `.vendor` (tests/support/sglang_env.py: `scripts/vendor-sglang`).

`--device cpu` runs ours alone on the host backend with small shapes: a smoke test.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
# common is found next to this file when it runs as a script, not when a test loads it by path.
sys.path.insert(0, str(REPO / "benchmarks"))

from common import GIB, log, timed_ms  # noqa: E402
from support import sglang_env  # noqa: E402  (after the path: it lives with the tests)

MARGIN = 2 * GIB
PAGE = 1
WARMUP_TOKENS = 4096
# name -> (layers, KV heads per rank, head size)
SHAPES = {"8b": (32, 8, 128), "70b_tp8": (80, 1, 128)}
STEPS = ("construct", "warmup", "finalize", "release", "resume", "close")
LABELS = {
    "sglang": "SGLang 0.5.23 arena",
    "tms": "torch_memory_saver 0.0.10 (SGLang's memory saver)",
    "ours": "ours (no zeroing, like for like)",
    "ours_zero": "ours (zeroing)",
}

torch: Any = None


def descs(layers: int, heads: int, head_dim: int, tokens: int) -> list[Any]:
    """`MHATokenToKVPool._build_kv_buffer_descs` for the NHD layout: k0..k{L-1}, v0..v{L-1}."""
    from sglang.srt.mem_cache.memory_pool import KvBufferDesc

    shape = (tokens + PAGE, heads, head_dim)
    row_bytes = heads * head_dim * 2
    return [
        KvBufferDesc(f"{kind}{i}", shape, row_bytes=row_bytes, tokens_per_row=1)
        for kind in ("k", "v")
        for i in range(layers)
    ]


def one_run(cls: Any, shape: str, args: argparse.Namespace, zero: bool | None) -> dict[str, Any]:
    layers, heads, head_dim = SHAPES[shape]
    per_token = 2 * layers * heads * head_dim * 2
    total = torch.cuda.mem_get_info()[1] if args.device != "cpu" else args.gib * GIB * 2
    reserved = total // per_token
    kwargs = {"zero_new": zero} if zero is not None else {}
    times: dict[str, Any] = {}
    made: list[Any] = []
    device = torch.device(args.device)

    def construct() -> None:
        made.append(
            cls(
                device=args.device,
                device_id=0,
                store_dtype=torch.bfloat16,
                page_size=PAGE,
                reserved_num_tokens=reserved,
                buffer_descs=descs(layers, heads, head_dim, reserved),
                **kwargs,
            )
        )

    times["construct"] = timed_ms(construct, device)[0]
    owner = made.pop()
    times["warmup"] = timed_ms(lambda: owner.ensure_prefix(WARMUP_TOKENS), device)[0]
    time.sleep(args.pause)
    free = torch.cuda.mem_get_info()[0] if args.device != "cpu" else args.gib * GIB * 2
    target = min(args.gib * GIB, free - MARGIN)
    final = min(reserved, max(WARMUP_TOKENS, target // per_token - PAGE))
    times["finalize"] = timed_ms(lambda: owner.finalize(final), device)[0]
    times["backed_gib"] = owner.backed_bytes / GIB
    times["tokens"] = final
    buffer = getattr(owner, "buffer", None)
    if buffer is not None:
        times["handles"] = buffer.num_handles
    if hasattr(owner, "suspend"):
        times["release"] = timed_ms(owner.suspend, device)[0]
        time.sleep(args.pause)
        times["resume"] = timed_ms(owner.resume, device)[0]
    times["close"] = timed_ms(owner.close, device)[0]
    made.clear()
    gc.collect()
    time.sleep(args.pause)
    return times


def tms_run(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    """torch_memory_saver's steps (module docstring) in a child process: its last stdout line."""
    command = [sys.executable, __file__, "--out", str(args.out), "--tms-child", shape]
    command += ["--gib", str(args.gib), "--pause", str(args.pause), "--device", args.device]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"torch_memory_saver child: exit {done.returncode}: {done.stderr[-2000:]}"
        )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def tms_child(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    from torch_memory_saver import torch_memory_saver as saver

    saver.hook_mode = "torch"  # its pluggable allocator: no LD_PRELOAD
    layers, heads, head_dim = SHAPES[shape]
    per_token = 2 * layers * heads * head_dim * 2
    device = torch.device(args.device)
    torch.zeros(1, device=device)
    time.sleep(args.pause)
    target = min(args.gib * GIB, torch.cuda.mem_get_info()[0] - MARGIN)
    tokens = target // per_token - PAGE

    def make() -> list[Any]:
        with saver.region(tag="kv_cache"):
            shape_ = (tokens + PAGE, heads, head_dim)
            return [
                torch.empty(shape_, dtype=torch.bfloat16, device=device) for _ in range(2 * layers)
            ]

    times: dict[str, Any] = {"tokens": tokens, "handles": 2 * layers}
    times["finalize"], buffers = timed_ms(make, device)
    times["backed_gib"] = sum(b.numel() * b.element_size() for b in buffers) / GIB
    times["release"] = timed_ms(lambda: saver.pause("kv_cache"), device)[0]
    time.sleep(args.pause)
    times["resume"] = timed_ms(lambda: saver.resume("kv_cache"), device)[0]
    return times


def capped(cls: Any, cap: str) -> Any:
    """Our owner whose tensor's handles are capped at `cap` GiB, or cut only between runs
    (`whole`): its module's `ExtensibleTensor` takes the option while one is built."""
    from extensible_kv import HandleSizing
    from extensible_kv.sglang import owner as owner_module

    sizing = (
        HandleSizing("whole_runs")
        if cap == "whole"
        else HandleSizing("cap_aligned", int(cap) * GIB)
    )
    option: dict[str, Any] = {"handle_sizing": sizing}

    class Capped(cls):  # type: ignore[misc, valid-type]
        def __init__(self, **kwargs: Any) -> None:
            tensor = owner_module.ExtensibleTensor

            def with_option(*args: Any, **options: Any) -> Any:
                return tensor(*args, **{**options, **option})

            owner_module.ExtensibleTensor = with_option  # type: ignore[misc, assignment]
            try:
                super().__init__(**kwargs)
            finally:
                owner_module.ExtensibleTensor = tensor  # type: ignore[misc]

    return Capped


def first_construct(cls: Any, args: argparse.Namespace) -> float:
    """SGLang's first owner in the process: its bump allocator is compiled (`load_inline`)."""
    times = one_run(cls, "8b", argparse.Namespace(**{**vars(args), "gib": 1}), None)
    return float(times["construct"])


def table(results: dict[str, Any]) -> str:
    lines = []
    for shape, per in results["shapes"].items():
        lines.append(f"### {shape} ({SHAPES[shape][0]} layers)")
        lines.append("| contender | " + " | ".join(f"{s} ms" for s in STEPS) + " | GiB | handles |")
        lines.append("|---" * (len(STEPS) + 3) + "|")
        for name, runs in per.items():
            if "error" in runs:
                lines.append(f"| {LABELS[name]} | error: {runs['error']} |")
                continue
            cells = []
            for step in STEPS:
                values = [r[step] for r in runs["runs"] if step in r]
                cells.append(f"{statistics.median(values):.2f}" if values else "n/a")
            gib, handles = runs["runs"][0]["backed_gib"], runs["runs"][0].get("handles", "")
            lines.append(f"| {LABELS[name]} | " + " | ".join(cells) + f" | {gib:.1f} | {handles} |")
    if "sglang_first_construct_ms" in results:
        first = results["sglang_first_construct_ms"]
        lines.append(f"\nSGLang's first construct (compiles its allocator): {first:.0f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global torch
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--quick", action="store_true", help="1 rep, 16 GiB, short pauses")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--pause", type=float, default=3.0)
    parser.add_argument("--gib", type=int, default=120)
    parser.add_argument(
        "--tms", action="store_true", help="torch_memory_saver's pause and resume too (GPU)"
    )
    parser.add_argument("--tms-child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--contenders",
        help="comma-separated subset of sglang,ours,ours_zero,tms,ours_cap* (default: all)",
    )
    parser.add_argument(
        "--caps",
        default="",
        help="comma-separated handle caps in GiB, or `whole` (one handle per run): one more "
        "'ours' contender (no zeroing) each",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.gib, args.pause = 1, 16, 0.5
    if args.device == "cpu":
        args.gib, args.pause = min(args.gib, 1), 0.0
    # The memory saver's child needs torch_memory_saver alone, from SGLang's wheels if it is
    # not installed.
    tms_alone = args.tms_child and importlib.util.find_spec("torch_memory_saver") is not None
    reason = None if tms_alone else sglang_env.load()
    if reason is not None:
        log(f"cannot run: {reason}")
        return 1
    import torch as _torch

    torch = _torch
    if args.tms_child:
        print(json.dumps(tms_child(args.tms_child, args)), flush=True)
        # torch_memory_saver's torch hook frees only inside its region, and its pools free
        # at interpreter exit, outside it (exit 1, "only support interesting region"). SGLang
        # keeps its KV cache to the end of the process too: leave as it does, without the frees.
        os._exit(0)
    from extensible_kv.sglang import KvVmmBufferOwner as Ours
    from sglang.srt.mem_cache.kv_vmm_backing import KvVmmBufferOwner as Sglangs

    log(f"SGLang from {sglang_env.source()}")
    contenders: dict[str, tuple[Any, bool | None]] = {
        "ours": (Ours, False),
        "ours_zero": (Ours, True),
    }
    for cap in filter(None, args.caps.split(",")):
        name = f"ours_cap{cap}"
        what = "a handle per run" if cap == "whole" else f"{cap} GiB handles"
        LABELS[name] = f"ours, {what} (no zeroing)"
        contenders[name] = (capped(Ours, cap), False)
    results: dict[str, Any] = {"device": args.device, "reps": args.reps, "shapes": {}}
    if args.device != "cpu":
        contenders = {"sglang": (Sglangs, None), **contenders}
        if args.tms:
            contenders["tms"] = (None, None)
        results["device_name"] = torch.cuda.get_device_name(0)
    if args.contenders:
        wanted = args.contenders.split(",")
        unknown = sorted(set(wanted) - set(contenders))
        if unknown:
            parser.error(f"--contenders: unknown {', '.join(unknown)} (of {', '.join(contenders)})")
        contenders = {name: contenders[name] for name in wanted}
    if "sglang" in contenders:
        try:
            results["sglang_first_construct_ms"] = first_construct(Sglangs, args)
        except Exception as exc:
            results["sglang_first_construct_error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = ["8b"] if args.device == "cpu" and args.quick else list(SHAPES)
    for shape in shapes:
        per: dict[str, Any] = {}
        for rep in range(args.reps):
            for name, (cls, zero) in contenders.items():  # interleaved: same memory state
                entry = per.setdefault(name, {"runs": []})
                if "error" in entry:
                    continue
                try:
                    if name == "tms":
                        entry["runs"].append(tms_run(shape, args))
                    else:
                        entry["runs"].append(one_run(cls, shape, args, zero))
                    log(shape, rep, name, entry["runs"][-1])
                except Exception as exc:
                    entry["error"] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
        results["shapes"][shape] = per
        (args.out / "bench_sglang.json").write_text(json.dumps(results, indent=2))
    print(table(results))
    print(f"JSON: {args.out / 'bench_sglang.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
