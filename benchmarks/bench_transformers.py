"""transformers' continuous batching with its own KV cache and with extensible-kv's, side by
side in one process, on an 8B-shaped Llama (32 layers, 32 heads, 8 KV heads, hidden 4096, bf16,
random weights built on the GPU) serving 64 prompts with CUDA graphs.

    python3 benchmarks/bench_transformers.py --out DIR [--quick] [--attn sdpa]

For each contender -- `own` (transformers' `PagedAttentionCache`, sized before warm-up from
`max_memory_percent` of free memory) then `extensible` (`extensible_kv.transformers.enable()`:
reserved, warmed up, extended after warm-up) -- on a manager from `init_continuous_batching`:
  cache        the batch processor: the cache and the IO buffers (`_create_batch_processor`);
  warmup       `manager.warmup()`: graphs captured at the largest sizes (ours: less `extend`);
  extend       ours: measure and commit after warm-up (`last_report().total_ms`);
  startup      their sum; free memory after it (`torch.cuda.mem_get_info`, cache emptied);
  blocks, GiB  the cache's whole-model blocks and committed bytes;
  generate     the prompts through the running manager: wall time, generated tokens/s;
  restart      own: stop and destroy the manager, build a new one and warm it up (what an RL
               loop does today to give the KV memory back); ours: `release` + `resume` on the
               running manager, then the prompts again.
Outputs are compared token for token (own vs ours, ours after resume vs before). Prints a
markdown table and writes DIR/bench_transformers.json. transformers must be 5.18 to 5.25
(on the GPU machine: the wheel `scripts/vendor-transformers` leaves in .vendor/transformers,
put first on PYTHONPATH by scripts/gpu-check).

`--device cpu` runs a tiny model on the host backend (a smoke test of this script). The
contenders are the demo's (`extensible_kv._demo.serve`, `python -m extensible_kv demo`): this
script runs them on the 8B shape and writes their figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from common import log

ROWS = [
    ("blocks", "blocks", "{:.0f}"),
    ("KV cache (GiB)", "gib", "{:.2f}"),
    ("free after startup (GiB)", "free_after_gib", "{:.2f}"),
    ("reads per batch (tokens)", "max_tokens_read", "{:.0f}"),
    ("cache + IO buffers (ms)", "cache_ms", "{:.0f}"),
    ("warm-up (ms)", "warmup_ms", "{:.0f}"),
    ("extend (ms)", "extend_ms", "{:.1f}"),
    ("startup (ms)", "startup_ms", "{:.0f}"),
    ("generate (s)", "generate_s", "{:.2f}"),
    ("tokens/s", "tokens_per_s", "{:.0f}"),
    ("give memory back and take it again (ms)", "restart_ms", "{:.1f}"),
]


def report(results: dict[str, Any]) -> str:
    own, ours = results["own"], results["extensible"]
    lines = [
        f"### transformers {results['environment']['transformers']} continuous batching, "
        f"{results['environment']['shape']}, {results['environment']['prompts']} prompts",
        "",
        "| | transformers' own | extensible-kv | ratio |",
        "|---|---:|---:|---:|",
    ]
    for label, key, fmt in ROWS:
        a, b = own.get(key), ours.get(key)
        ratio = f"{b / a:.3f}" if a and b is not None else ""
        cells = [fmt.format(v) if v is not None else "" for v in (a, b)]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {ratio} |")
    n = results["environment"]["prompts"]
    lines += [
        "",
        f"Identical outputs: {results['identical']}/{n} (own vs extensible), "
        f"{ours['identical_after_resume']}/{n} (extensible after release + resume vs before). "
        f"Ours: {ours['blocks_before']} blocks committed by the warm-up, margin "
        f"{ours['margin_gib']:.2f} GiB, {ours['handles']} handles, commit {ours['commit_ms']:.1f} "
        f"ms; release {ours['release_ms']:.1f} ms (down to {ours['released_gib']:.2f} GiB, "
        f"{ours['free_released_gib']:.2f} GiB free), resume {ours['resume_ms']:.1f} ms; own "
        f"restart = stop + destroy + new manager + warm-up + start.",
    ]
    return "\n".join(lines)


def same(a: list[list[int]], b: list[list[int]]) -> int:
    """How many outputs of `a` and `b` are identical, in order."""
    return sum(x == y for x, y in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON")
    parser.add_argument("--quick", action="store_true", help="4 layers, 16 prompts, 32 tokens")
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (a tiny model)")
    parser.add_argument("--attn", default="sdpa", help="sdpa or eager (run as paged forms)")
    parser.add_argument("--prompts", type=int, help="number of prompts (64; 16 with --quick)")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per prompt (128)")
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--max-batch-tokens", type=int, help="transformers' default if unset")
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (16 if args.quick else 64)
    args.new_tokens = args.new_tokens or (32 if args.quick else 128)

    import torch
    import transformers
    from extensible_kv._demo import serve

    if torch.device(args.device).type == "cpu":
        args.min_prompt, args.max_prompt = min(args.min_prompt, 8), min(args.max_prompt, 40)
        args.new_tokens = min(args.new_tokens, 8)
    options = serve.DemoOptions(
        device=args.device,
        layers=4 if args.quick else None,
        attn=args.attn,
        prompts=args.prompts,
        min_prompt=args.min_prompt,
        max_prompt=args.max_prompt,
        new_tokens=args.new_tokens,
        max_batch_tokens=args.max_batch_tokens,
        progress=False,
    ).resolved()
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_transformers.json"
    start = time.perf_counter()
    model = serve.build_model(options)
    layers = model.config.num_hidden_layers
    results: dict[str, Any] = {
        "environment": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "shape": f"Llama {layers} layers, hidden {model.config.hidden_size}, "
            f"{model.config.num_key_value_heads} KV heads, {model.dtype}, {args.attn}",
            "prompts": args.prompts,
            "new_tokens": args.new_tokens,
            "model_s": time.perf_counter() - start,
        }
    }
    log(json.dumps(results["environment"]))
    prompts = serve.make_prompts(options, model.config.vocab_size)
    own = serve.run_own(model, options, prompts)
    results["own"] = own.row()
    log("own:", json.dumps(results["own"]))
    path.write_text(json.dumps(results, indent=2, default=str))
    ours = serve.run_extensible(model, options, prompts)
    results["extensible"] = ours.row()
    results["extensible"]["identical_after_resume"] = same(ours.tokens, ours.tokens_after_restart)
    log("extensible:", json.dumps(results["extensible"]))
    results["identical"] = same(own.tokens, ours.tokens)
    path.write_text(json.dumps(results, indent=2, default=str))
    print(report(results))
    print(f"\nJSON: {path}")
    return 0 if results["identical"] == args.prompts else 1


if __name__ == "__main__":
    sys.exit(main())
