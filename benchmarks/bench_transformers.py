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
markdown table and writes DIR/bench_transformers.json. transformers must be 5.18 to 5.24
(on the GPU machine: the wheel `scripts/vendor-transformers` leaves in .vendor/transformers,
put first on PYTHONPATH by scripts/gpu-check).

`--device cpu` runs a tiny model on the host backend (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any

import common
from common import GIB, log, sync, timed_ms

torch: Any = None


def free_bytes(device: Any) -> int | None:
    """The device's free bytes once torch's cache is given back; None on the host."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    return common.free_bytes(device)


def build_model(args: argparse.Namespace, device: Any) -> Any:
    import transformers

    if device.type == "cuda":
        shape = {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 4 if args.quick else 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
        }
        dtype = torch.bfloat16
    else:
        shape = {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 160,
            "max_position_embeddings": 1024,
        }
        dtype = torch.float32
    config = transformers.LlamaConfig(**shape)
    torch.manual_seed(0)
    with torch.device(device):  # random weights made where they run: no 16 GB host copy
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=args.attn, dtype=dtype
        )
    return model.eval()


def cb_config(args: argparse.Namespace, device: Any) -> Any:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    options: dict[str, Any] = {"use_cuda_graph": device.type == "cuda"}
    if "auto_switch_to_flash" in inspect.signature(ContinuousBatchingConfig).parameters:
        options["auto_switch_to_flash"] = False
    if args.max_batch_tokens:
        options["max_batch_tokens"] = args.max_batch_tokens
    if device.type != "cuda":
        options.update(num_blocks=64, max_batch_tokens=64, page_size=16)
    return ContinuousBatchingConfig(**options)


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(
        args.min_prompt, args.max_prompt + 1, (args.prompts,), generator=generator
    )
    return [torch.randint(1, vocab, (int(n),), generator=generator).tolist() for n in lengths]


def new_manager(model: Any, args: argparse.Namespace, device: Any, prompts: list[list[int]]) -> Any:
    import transformers

    hints: dict[str, Any] = {}
    api = sys.modules["transformers.generation.continuous_batching.continuous_api"]
    if hasattr(api, "WorkloadHints"):  # what generate_batch passes
        hints["workload_hints"] = api.WorkloadHints(
            max_prompt_length=max(len(p) for p in prompts),
            max_generated_length=args.new_tokens,
            num_requests=len(prompts),
        )
    gen = transformers.GenerationConfig(
        max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    return model.init_continuous_batching(
        generation_config=gen, continuous_batching_config=cb_config(args, device), **hints
    )


def start_up(manager: Any, device: Any, extensible: bool) -> dict[str, Any]:
    """Batch processor, then warm-up (with our extension after it), timed apart."""
    from extensible_kv.transformers import last_report, patch

    # The manager's own warmup() builds the batch processor under this flag: set it here too,
    # so that ours is extended after the warm-up, not when the processor is built.
    token = patch._IN_WARMUP.set(True)
    try:
        cache_ms, processor = timed_ms(manager._create_batch_processor, device)
    finally:
        patch._IN_WARMUP.reset(token)
    manager.batch_processor = processor
    warmup_ms, _ = timed_ms(manager.warmup, device)
    extend_ms = 0.0
    if extensible:
        report = last_report()
        assert report is not None, "the extensible cache was not extended"
        extend_ms = report.total_ms
    cache = processor.cache
    state = getattr(cache, "_ekv", None)
    committed = state.tensor.physical_bytes if state is not None else cache.cache_tensor.numel()
    return {
        "cache_ms": cache_ms,
        "warmup_ms": warmup_ms - extend_ms,
        "extend_ms": extend_ms,
        "startup_ms": cache_ms + warmup_ms,
        "blocks": int(cache.num_blocks),
        "gib": committed / GIB,
        "free_after_gib": (free_bytes(device) or 0) / GIB,
        "max_tokens_read": int(cache.max_tokens_read),
    }


def generate(manager: Any, prompts: list[list[int]], args: argparse.Namespace, device: Any):
    start = time.perf_counter()
    ids = manager.add_requests(prompts, max_new_tokens=args.new_tokens)
    results: dict[str, list[int]] = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=60)
        if result is None:
            raise RuntimeError(f"no result in 60 s ({len(results)} of {len(ids)} done)")
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            results[result.request_id] = result.generated_tokens
    sync(device)
    seconds = time.perf_counter() - start
    tokens = [results[i] for i in ids]
    return tokens, {"generate_s": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds}


def run_own(model: Any, args: argparse.Namespace, device: Any, prompts: list[list[int]]):
    manager = new_manager(model, args, device, prompts)
    row = start_up(manager, device, extensible=False)
    manager.start()
    tokens, gen = generate(manager, prompts, args, device)
    row.update(gen)

    def restart() -> Any:
        manager.stop(block=True)
        manager.destroy()
        fresh = new_manager(model, args, device, prompts)
        fresh.warmup()
        fresh.start()
        return fresh

    row["restart_ms"], fresh = timed_ms(restart, device)
    fresh.stop(block=True)
    fresh.destroy()
    return row, tokens


def run_extensible(model: Any, args: argparse.Namespace, device: Any, prompts: list[list[int]]):
    import extensible_kv.transformers as ekt

    options = {} if device.type == "cuda" else {"budget_bytes": 1 << 20, "granularity": 4096}
    with ekt.enabled(**options):
        manager = new_manager(model, args, device, prompts)
        row = start_up(manager, device, extensible=True)
        report = ekt.last_report()
        assert report is not None
        row.update(
            blocks_before=report.blocks_before,
            margin_gib=report.margin_bytes / GIB,
            handles=report.handles_after,
            commit_ms=report.commit_ms,
        )
        manager.start()
        tokens, gen = generate(manager, prompts, args, device)
        row.update(gen)
        row["release_ms"], _ = timed_ms(lambda: ekt.release(manager), device)
        row["released_gib"] = manager.batch_processor.cache._ekv.tensor.physical_bytes / GIB
        row["free_released_gib"] = (free_bytes(device) or 0) / GIB
        row["resume_ms"], _ = timed_ms(lambda: ekt.resume(manager), device)
        row["restart_ms"] = row["release_ms"] + row["resume_ms"]
        again, _ = generate(manager, prompts, args, device)
        manager.stop(block=True)
        manager.destroy()
    row["identical_after_resume"] = sum(a == b for a, b in zip(tokens, again, strict=True))
    return row, tokens


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

    global torch
    import torch as torch_module

    torch = torch_module
    import transformers

    device = torch.device(args.device)
    if device.type == "cpu":
        args.min_prompt, args.max_prompt = min(args.min_prompt, 8), min(args.max_prompt, 40)
        args.new_tokens = min(args.new_tokens, 8)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_transformers.json"
    start = time.perf_counter()
    model = build_model(args, device)
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
    prompts = make_prompts(args, model.config.vocab_size)
    results["own"], own_tokens = run_own(model, args, device, prompts)
    log("own:", json.dumps(results["own"]))
    path.write_text(json.dumps(results, indent=2, default=str))
    results["extensible"], ext_tokens = run_extensible(model, args, device, prompts)
    log("extensible:", json.dumps(results["extensible"]))
    results["identical"] = sum(a == b for a, b in zip(own_tokens, ext_tokens, strict=True))
    path.write_text(json.dumps(results, indent=2, default=str))
    print(report(results))
    print(f"\nJSON: {path}")
    return 0 if results["identical"] == args.prompts else 1


if __name__ == "__main__":
    sys.exit(main())
