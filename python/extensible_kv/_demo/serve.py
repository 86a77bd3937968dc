"""The main job, `python -m extensible_kv demo`: transformers' continuous batching served twice,
on transformers' own KV cache and on extensible-kv's (`extensible_kv.transformers`).

A model built from a config with seeded random weights (Llama-shaped by default, Qwen3 with
`model="qwen3"`, every other layer a sliding window with `sliding_window`) serves the same
greedy requests on a manager with transformers' own cache (sized before its warm-up from
`max_memory_percent` of free memory), then on one whose cache is reserved, warmed up (CUDA
graphs captured on a GPU) and extended after the warm-up from the memory really left. For each
it measures the blocks, the KV bytes, the free memory after start-up, the start-up, tokens/s,
and what giving the KV memory back and taking it again costs: transformers' own way is to stop
and re-create the manager (graphs re-captured); ours is `suspend` + `resume` on the live
manager (the report's "release" figures). The tokens must be identical, own against ours
and ours after the resume.

Without a GPU it runs on the host backend with a small model, a budget and a block cap (with
no cap, transformers' own sizing takes 60% of the host's memory for the cache).
`benchmarks/bench_transformers.py` runs the same contenders on an 8B shape and writes JSON.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from extensible_kv import sizing, vmm_unavailable_reason

__all__ = [
    "Contender",
    "DemoOptions",
    "DemoResult",
    "build_model",
    "format_report",
    "pick_device",
    "run",
    "run_extensible",
    "run_own",
]

GIB = 1 << 30
MIB = 1 << 20
MODELS = ("llama", "qwen3")
# The GPU's default shape is an 8B one (Llama 3 8B, Qwen3 8B); the host's is tiny.
GPU_SHAPES: dict[str, dict[str, int]] = {
    "llama": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
    },
    "qwen3": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 8192,
    },
}
HOST_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 160,
    "max_position_embeddings": 1024,
}


@dataclass(frozen=True)
class DemoOptions:
    """What to run. `None` picks per device (GPU / host): `device` cuda:0 when usable;
    `layers` the shape's (32 or 36 / 2); `prompts` 64 / 8 of `min_prompt` to `max_prompt`
    tokens (64-512 / 5-40); `new_tokens` 128 / 16; `num_blocks` no cap / 64 (a cap for both
    caches). `budget_mib` is the host backend's budget for our cache, in all (`None`: measure
    `host_free_bytes()` less the margin); a GPU measures. `sliding_window` makes every other
    layer a sliding window of that many tokens (Llama-shaped: transformers' Qwen2)."""

    device: str | None = None
    model: str = "llama"
    sliding_window: int | None = None
    layers: int | None = None
    attn: str = "sdpa"
    prompts: int | None = None
    min_prompt: int | None = None
    max_prompt: int | None = None
    new_tokens: int | None = None
    max_batch_tokens: int | None = None
    num_blocks: int | None = None
    budget_mib: int | None = 64
    seed: int = 0
    progress: bool = True

    def resolved(self) -> DemoOptions:
        """These options with every per-device default filled in."""
        device = pick_device(self.device)
        gpu = torch.device(device).type == "cuda"
        shape = GPU_SHAPES[self.model] if gpu else HOST_SHAPE
        return DemoOptions(
            device=device,
            model=self.model,
            sliding_window=self.sliding_window,
            layers=self.layers or shape["num_hidden_layers"],
            attn=self.attn,
            prompts=self.prompts or (64 if gpu else 8),
            min_prompt=self.min_prompt or (64 if gpu else 5),
            max_prompt=self.max_prompt or (512 if gpu else 40),
            new_tokens=self.new_tokens or (128 if gpu else 16),
            max_batch_tokens=self.max_batch_tokens or (None if gpu else 64),
            num_blocks=self.num_blocks or (None if gpu else 64),
            budget_mib=self.budget_mib,
            seed=self.seed,
            progress=self.progress,
        )


@dataclass
class Contender:
    """One cache's run. `restart_ms`: own, stop + destroy + a new manager + its warm-up +
    start; ours, `suspend` + `resume` on the running manager, after which the prompts run
    again (`tokens_after_restart`, ours only)."""

    name: str
    blocks: int = 0
    gib: float = 0.0
    free_after_gib: float | None = None
    max_tokens_read: int = 0
    cache_ms: float = 0.0
    warmup_ms: float = 0.0
    extend_ms: float = 0.0
    startup_ms: float = 0.0
    generate_s: float = 0.0
    tokens_per_s: float = 0.0
    restart_ms: float = 0.0
    tokens: list[list[int]] = field(default_factory=list, repr=False)
    tokens_after_restart: list[list[int]] = field(default_factory=list, repr=False)
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """The figures, flat (what the bench writes as JSON)."""
        skip = {"name", "tokens", "tokens_after_restart", "extra"}
        row = {k: v for k, v in vars(self).items() if k not in skip}
        return {**row, **self.extra}


@dataclass
class DemoResult:
    options: DemoOptions
    description: str
    own: Contender
    ours: Contender

    @property
    def identical(self) -> bool:
        """Own against ours, and ours after release + resume against before."""
        return self.own.tokens == self.ours.tokens == self.ours.tokens_after_restart


def pick_device(device: str | None) -> str:
    """`device`, or cuda:0 when torch sees a GPU with VMM support, else cpu."""
    if device is not None:
        return device
    if torch.cuda.is_available() and vmm_unavailable_reason("cuda:0") is None:
        return "cuda:0"
    return "cpu"


def build_model(options: DemoOptions) -> Any:
    """The model of `options` (resolved), random weights seeded, made where it runs (no host
    copy of an 8B model's weights)."""
    transformers: Any = importlib.import_module("transformers")

    device = torch.device(options.device or "cpu")
    gpu = device.type == "cuda"
    shape: dict[str, Any] = dict(GPU_SHAPES[options.model] if gpu else HOST_SHAPE)
    shape["num_hidden_layers"] = options.layers or shape["num_hidden_layers"]
    if options.model == "qwen3" and "head_dim" not in shape:
        shape["head_dim"] = shape["hidden_size"] // shape["num_attention_heads"]
    config_class = transformers.LlamaConfig
    if options.model == "qwen3":
        config_class = transformers.Qwen3Config
    if options.sliding_window is not None:
        if options.model == "llama":  # Llama-shaped with sliding layers: transformers' Qwen2
            config_class = transformers.Qwen2Config
        layers = shape["num_hidden_layers"]
        shape.update(
            layer_types=["sliding_attention", "full_attention"] * (layers // 2)
            + ["sliding_attention"] * (layers % 2),
            use_sliding_window=True,
            sliding_window=options.sliding_window,
        )
    torch.manual_seed(options.seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config_class(**shape),
            attn_implementation=options.attn,
            dtype=torch.bfloat16 if gpu else torch.float32,
        )
    return model.eval()


def describe(model: Any, options: DemoOptions) -> str:
    config = model.config
    window = f", sliding window {options.sliding_window}" if options.sliding_window else ""
    return (
        f"{type(config).__name__.removesuffix('Config')} {config.num_hidden_layers} layers, hidden "
        f"{config.hidden_size}, {config.num_attention_heads} heads ({config.num_key_value_heads} "
        f"KV), {str(model.dtype).removeprefix('torch.')}, random weights (seed {options.seed}), "
        f"{options.attn}{window}, on {options.device}"
    )


def make_prompts(options: DemoOptions, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(options.seed + 1)
    low, high = options.min_prompt or 1, max(options.max_prompt or 1, options.min_prompt or 1)
    lengths = torch.randint(low, high + 1, (options.prompts or 1,), generator=generator)
    return [torch.randint(1, vocab, (int(n),), generator=generator).tolist() for n in lengths]


def _cb_config(options: DemoOptions, device: torch.device) -> Any:
    configuration: Any = importlib.import_module("transformers.generation.configuration_utils")
    ContinuousBatchingConfig = configuration.ContinuousBatchingConfig
    config: dict[str, Any] = {"use_cuda_graph": device.type == "cuda"}
    if "auto_switch_to_flash" in inspect.signature(ContinuousBatchingConfig).parameters:
        config["auto_switch_to_flash"] = False  # 5.19+: flash kernels are not assumed
    if options.max_batch_tokens:
        config["max_batch_tokens"] = options.max_batch_tokens
    if options.num_blocks:
        config["num_blocks"] = options.num_blocks
    if device.type != "cuda":
        config["page_size"] = 16
    return ContinuousBatchingConfig(**config)


def new_manager(model: Any, options: DemoOptions, prompts: list[list[int]]) -> Any:
    """A manager as `generate_batch` makes one (with its workload hints where it has them)."""
    transformers: Any = importlib.import_module("transformers")

    hints: dict[str, Any] = {}
    api = sys.modules["transformers.generation.continuous_batching.continuous_api"]
    if hasattr(api, "WorkloadHints"):
        hints["workload_hints"] = api.WorkloadHints(
            max_prompt_length=max(len(p) for p in prompts),
            max_generated_length=options.new_tokens,
            num_requests=len(prompts),
        )
    gen = transformers.GenerationConfig(
        max_new_tokens=options.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    return model.init_continuous_batching(
        generation_config=gen,
        continuous_batching_config=_cb_config(options, model.device),
        **hints,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_ms(call: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    start = time.perf_counter()
    result = call()
    _sync(device)
    return (time.perf_counter() - start) * 1e3, result


def free_gib(device: torch.device) -> float:
    """The device's free memory once torch's cache is given back (the host's
    `host_free_bytes()`)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0] / GIB
    return sizing.host_free_bytes() / GIB


def _start_up(manager: Any, row: Contender, device: torch.device, extensible: bool) -> None:
    """The batch processor (cache and IO buffers), then the warm-up (with our extension after
    it), timed apart."""
    from extensible_kv.transformers import last_report, patch
    from extensible_kv.transformers.state import is_extensible, state_of

    # The manager's own warmup() builds the processor under this flag: set it here too, so
    # that ours is extended after the warm-up, not when the processor is built.
    token = patch._IN_WARMUP.set(True)
    try:
        row.cache_ms, processor = _timed_ms(manager._create_batch_processor, device)
    finally:
        patch._IN_WARMUP.reset(token)
    manager.batch_processor = processor
    warmup_ms, _ = _timed_ms(manager.warmup, device)
    if extensible:
        report = last_report()
        assert report is not None, "the extensible cache was not extended"
        row.extend_ms = report.total_ms
    row.warmup_ms = warmup_ms - row.extend_ms
    row.startup_ms = row.cache_ms + warmup_ms
    cache = processor.cache
    committed = (
        state_of(cache).tensor.physical_bytes
        if is_extensible(cache)
        else cache.cache_tensor.numel()
    )
    row.blocks, row.gib = int(cache.num_blocks), committed / GIB
    row.free_after_gib = free_gib(device)
    row.max_tokens_read = int(cache.max_tokens_read)


def generate(
    manager: Any, prompts: list[list[int]], options: DemoOptions, label: str
) -> tuple[list[list[int]], float, float]:
    """The prompts through the running manager, in order: (tokens, seconds, tokens/s). With
    `options.progress` and a terminal on stderr, one line there follows the requests."""
    device = manager.model.device
    progress = options.progress and sys.stderr.isatty()  # a line redrawn in place
    start = time.perf_counter()
    ids = manager.add_requests(prompts, max_new_tokens=options.new_tokens)
    results: dict[str, list[int]] = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=60)
        if result is None:
            raise RuntimeError(f"no result in 60 s ({len(results)} of {len(ids)} done)")
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            results[result.request_id] = result.generated_tokens
            if progress:
                done = sum(map(len, results.values()))
                print(
                    f"\r  {label}: {len(results)}/{len(ids)} requests, {done} tokens",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
    _sync(device)
    seconds = time.perf_counter() - start
    if progress:
        print(file=sys.stderr)
    tokens = [results[i] for i in ids]
    return tokens, seconds, sum(map(len, tokens)) / seconds


def run_own(model: Any, options: DemoOptions, prompts: list[list[int]]) -> Contender:
    """transformers' own cache: start up, serve, then stop and re-create the manager (timed:
    what giving its KV memory back and taking it again costs it)."""
    device = model.device
    row = Contender("transformers' own")
    manager = new_manager(model, options, prompts)
    _start_up(manager, row, device, extensible=False)
    manager.start()
    try:
        row.tokens, row.generate_s, row.tokens_per_s = generate(manager, prompts, options, "own")
    except BaseException:
        manager.stop(block=True)
        manager.destroy()
        raise

    def restart() -> Any:
        manager.stop(block=True)
        manager.destroy()
        fresh = new_manager(model, options, prompts)
        fresh.warmup()
        fresh.start()
        return fresh

    row.restart_ms, fresh = _timed_ms(restart, device)
    fresh.stop(block=True)
    fresh.destroy()
    return row


def run_extensible(model: Any, options: DemoOptions, prompts: list[list[int]]) -> Contender:
    """extensible-kv's cache: reserve, warm up, extend; serve; suspend + resume; serve again."""
    import extensible_kv.transformers as ekt
    from extensible_kv.transformers.state import state_of

    device = model.device
    row = Contender("extensible-kv")
    enable: dict[str, Any] = {}
    if device.type != "cuda":
        if options.budget_mib is None:
            enable["host_free"] = True
        else:
            enable["budget_bytes"] = options.budget_mib * MIB
    with ekt.enabled(**enable):
        manager = new_manager(model, options, prompts)
        _start_up(manager, row, device, extensible=True)
        report = ekt.last_report()
        assert report is not None
        row.extra.update(
            blocks_before=report.blocks_before,
            margin_gib=report.margin_bytes / GIB,
            handles=report.handles_after,
            commit_ms=report.commit_ms,
            budget_asked_bytes=report.budget_asked_bytes,
        )
        manager.start()
        try:
            row.tokens, row.generate_s, row.tokens_per_s = generate(
                manager, prompts, options, "extensible-kv"
            )
            release_ms, _ = _timed_ms(lambda: ekt.suspend(manager), device)
            state = state_of(manager.batch_processor.cache)
            row.extra.update(
                release_ms=release_ms,
                released_gib=state.tensor.physical_bytes / GIB,
                free_released_gib=free_gib(device),
            )
            resume_ms, _ = _timed_ms(lambda: ekt.resume(manager), device)
            row.extra["resume_ms"] = resume_ms
            row.restart_ms = release_ms + resume_ms
            row.tokens_after_restart, _, _ = generate(
                manager, prompts, options, "extensible-kv, resumed"
            )
        finally:
            manager.stop(block=True)
            manager.destroy()
    return row


def run(options: DemoOptions) -> DemoResult:
    """Both contenders on one model, own first."""
    options = options.resolved()
    model = build_model(options)
    prompts = make_prompts(options, model.config.vocab_size)
    own = run_own(model, options, prompts)
    ours = run_extensible(model, options, prompts)
    return DemoResult(options, describe(model, options), own, ours)


ROWS = [
    ("KV cache blocks", "blocks", "{:.0f}"),
    ("KV cache (GiB)", "gib", "{:.3f}"),
    ("free memory after start-up (GiB)", "free_after_gib", "{:.2f}"),
    ("start-up (ms)", "startup_ms", "{:.0f}"),
    ("tokens/s", "tokens_per_s", "{:.0f}"),
    ("give the KV memory back and take it again (ms)", "restart_ms", "{:.1f}"),
]


def format_report(result: DemoResult) -> str:
    """The summary: one row per figure, both caches, and `identical: yes` or `no`."""
    own, ours = result.own.row(), result.ours.row()
    lines = [
        f"model: {result.description}",
        f"requests: {result.options.prompts} prompts of {result.options.min_prompt}-"
        f"{result.options.max_prompt} tokens, {result.options.new_tokens} greedy tokens each",
        "",
        f"{'':48}{'transformers own':>18}{'extensible-kv':>16}",
    ]
    for label, key, fmt in ROWS:
        cells = [fmt.format(r[key]) if r.get(key) is not None else "-" for r in (own, ours)]
        lines.append(f"{label:48}{cells[0]:>18}{cells[1]:>16}")
    gained = ours["blocks"] - own["blocks"]
    lines += [
        "",
        f"extensible-kv: {ours['blocks_before']} blocks after the warm-up, extended to "
        f"{ours['blocks']} ({gained:+d} against transformers' own sizing); release "
        f"{ours['release_ms']:.1f} ms (down to {ours['released_gib']:.3f} GiB) + resume "
        f"{ours['resume_ms']:.1f} ms, against {own['restart_ms']:.0f} ms to stop and re-create "
        f"the manager ({own['restart_ms'] / max(ours['restart_ms'], 1e-3):.0f}x)",
        f"identical: {'yes' if result.identical else 'no'}",
    ]
    return "\n".join(lines)
