"""The node pool bench's models, which of them fit a card, and its trace (`bench_pool.py`).

**Models** are configs written from the published shapes (no download: random weights, one
seed), built with transformers' own classes: `GPU_MODELS` in bf16 on a GPU, `SMALL_MODELS`
(`--small`, float32 on a GPU: the tokens' identity run) and `HOST_MODELS` (the host backend's
tiny ones, float32). Each engine is one of them; a transformers block (`page_size` tokens of K
and V of every layer, what `enable(min_blocks=...)` counts) differs from model to model, so the
bench sizes every setup in bytes.

**Which fit** (`pick_models`): on a card of 120 GiB or more (an H200) the seven of
`H200_SET`; on a smaller one (an H100) the five of `H100_SET`, each leaving out models past the
memory the card has for weights once the engines' overhead and the setups' KV are counted:
`fit` says which were left out and why.

**The trace** (`make_trace`): rounds in which each engine bursts in turn, a burst's size drawn
(seeded) per burst from `--burst-requests` (one value, or a range), its arrivals uniform within
`--burst-s`, prompts log-uniform within the bounds; outside its own bursts an engine gets a
Poisson trickle. The same requests at the same times in every setup.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class ModelShape:
    """A model's published shape (`source`), built with transformers' `arch` config class.
    `sliding` lists the layer types' pattern (repeated over the layers) where some layers
    attend within `sliding_window` tokens."""

    name: str
    source: str
    arch: str  # "llama", "qwen2", "qwen3"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    sliding_window: int | None = None
    sliding: tuple[str, ...] = field(default=())

    def layer_types(self) -> list[str] | None:
        if not self.sliding:
            return None
        pattern = list(self.sliding)
        return [pattern[i % len(pattern)] for i in range(self.layers)]

    def params(self) -> int:
        """Parameters, as the config builds them (biases and norms left out)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (attention + mlp) + embed

    def weight_bytes(self, itemsize: int) -> int:
        return self.params() * itemsize

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * itemsize

    def block_bytes(self, itemsize: int, page_size: int) -> int:
        """transformers' whole-model block: `page_size` tokens of K and V of every layer
        (`PagedAttentionCache`'s `bytes_per_block`, what `num_blocks` and `enable`'s limits
        count)."""
        return self.kv_bytes_per_token(itemsize) * page_size

    def describe(self) -> str:
        window = ""
        if self.sliding_window:
            local = sum(t == "sliding_attention" for t in self.sliding)
            window = f", sliding window {self.sliding_window} ({local}:{len(self.sliding) - local})"
        return (
            f"{self.name} ({self.source}: {self.arch}, {self.layers} layers, hidden "
            f"{self.hidden}, {self.heads} heads, {self.kv_heads} KV of {self.head_dim}{window})"
        )


def _gpu(*shapes: ModelShape) -> dict[str, ModelShape]:
    return {s.name: s for s in shapes}


SLIDING_5_1 = ("sliding_attention",) * 5 + ("full_attention",)
# Published shapes (their config.json); random weights.
GPU_MODELS = _gpu(
    ModelShape("llama3-8b", "Meta-Llama-3-8B", "llama", 4096, 14336, 32, 32, 8, 128, 128256, False),
    ModelShape("qwen3-4b", "Qwen3-4B", "qwen3", 2560, 9728, 36, 32, 8, 128, 151936, True),
    ModelShape("llama3.2-1b", "Llama-3.2-1B", "llama", 2048, 8192, 16, 32, 8, 64, 128256, True),
    ModelShape("qwen2.5-0.5b", "Qwen2.5-0.5B", "qwen2", 896, 4864, 24, 14, 2, 64, 151936, True),
    # Gemma-3-1B's attention (26 layers, 4 heads, 1 KV head of 256, a 512-token window on five
    # layers of six) on Qwen3's code, which takes layer types and a head size of its own.
    ModelShape(
        "gemma3-1b-sliding",
        "gemma-3-1b-pt's attention",
        "qwen3",
        1152,
        6912,
        26,
        4,
        1,
        256,
        262144,
        True,
        512,
        SLIDING_5_1,
    ),
    ModelShape("qwen3-0.6b", "Qwen3-0.6B", "qwen3", 1024, 3072, 28, 16, 8, 128, 151936, True),
    ModelShape("smollm2-360m", "SmolLM2-360M", "llama", 960, 2560, 32, 15, 5, 64, 49152, True),
)
H100_SET = ("llama3-8b", "qwen3-4b", "llama3.2-1b", "qwen2.5-0.5b", "gemma3-1b-sliding")
H200_SET = (*H100_SET, "qwen3-0.6b", "smollm2-360m")

# float32 on a GPU (`--small`): every request's tokens against the same request alone.
SMALL_MODELS = _gpu(
    ModelShape("small-llama", "small", "llama", 256, 512, 4, 4, 2, 64, 1024),
    ModelShape("small-qwen3", "small", "qwen3", 256, 512, 6, 8, 2, 32, 1024),
    ModelShape("small-qwen2", "small", "qwen2", 192, 384, 3, 4, 4, 48, 1024),
    ModelShape(
        "small-sliding", "small", "qwen3", 256, 512, 6, 4, 1, 64, 1024, True, 64, SLIDING_5_1
    ),
    ModelShape("small-llama-mha", "small", "llama", 128, 256, 2, 4, 4, 32, 1024),
)

# The host backend's (float32, 16-token pages): blocks of 8,192, 12,288 and 16,384 bytes.
HOST_MODELS = _gpu(
    ModelShape("tiny-llama", "tiny", "llama", 64, 128, 2, 4, 2, 16, 160),
    ModelShape("tiny-qwen3", "tiny", "qwen3", 64, 128, 3, 4, 2, 16, 160),
    ModelShape(
        "tiny-sliding",
        "tiny",
        "qwen3",
        64,
        128,
        4,
        4,
        1,
        32,
        160,
        False,
        24,
        ("sliding_attention",) * 3 + ("full_attention",),
    ),
    ModelShape("tiny-qwen2", "tiny", "qwen2", 96, 128, 2, 4, 4, 24, 160),
)
HOST_SET = ("tiny-llama", "tiny-qwen3", "tiny-sliding")
SMALL_SET = tuple(SMALL_MODELS)


def catalog(device: str, small: bool) -> dict[str, ModelShape]:
    if small:
        return SMALL_MODELS
    return GPU_MODELS if device.startswith("cuda") else HOST_MODELS


def build_model(shape: ModelShape, device: str, dtype: Any, seed: int) -> Any:
    """`shape` with random weights (`seed`), made where it runs, in `eval` mode."""
    import torch
    import transformers

    config: dict[str, Any] = {
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": shape.tied,
    }
    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    if shape.arch in ("llama", "qwen3"):
        config["head_dim"] = shape.head_dim
    elif shape.hidden != shape.heads * shape.head_dim:
        raise ValueError(f"{shape.name}: Qwen2 has no head size of its own")
    if shape.sliding:
        config.update(
            layer_types=shape.layer_types(),
            use_sliding_window=True,
            sliding_window=shape.sliding_window,
        )
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            classes[shape.arch](**config), attn_implementation="sdpa", dtype=dtype
        )
    return model.eval()


@dataclass(frozen=True)
class Fit:
    """The models an engine each, and those left out with the reason."""

    models: tuple[str, ...]
    left_out: dict[str, str]
    note: str


def pick_models(
    names: list[str] | None,
    device: str,
    small: bool,
    total_bytes: int | None,
    kv_bytes: int,
    overhead_bytes: int,
    itemsize: int,
) -> Fit:
    """The models to run: `names`, or the card's set (see the module's docstring). On a GPU
    of `total_bytes`, models past what is left for weights once every engine's overhead
    (`overhead_bytes`: context, activations, graphs) and `kv_bytes` of KV are counted are
    left out, largest first, and `Fit.left_out` says why."""
    models = catalog(device, small)
    if names:
        unknown = [n for n in names if n not in models]
        if unknown:
            raise SystemExit(f"unknown models {unknown}; known here: {', '.join(models)}")
        chosen = list(names)
        note = "the models named"
    elif small:
        chosen, note = list(SMALL_SET), "the small float32 models"
    elif not device.startswith("cuda"):
        chosen, note = list(HOST_SET), "the host's three tiny models"
    elif total_bytes is not None and total_bytes >= 120 * GIB:
        chosen, note = list(H200_SET), "seven models: a card of 120 GiB or more (H200)"
    else:
        chosen, note = list(H100_SET), "five models: a card under 120 GiB (H100)"
    left: dict[str, str] = {}
    if total_bytes is not None and device.startswith("cuda"):
        while len(chosen) > 1:
            weights = sum(models[n].weight_bytes(itemsize) for n in chosen)
            need = weights + len(chosen) * overhead_bytes + kv_bytes
            if need <= total_bytes:
                break
            largest = max(chosen, key=lambda n: models[n].weight_bytes(itemsize))
            chosen.remove(largest)
            left[largest] = (
                f"{need / GIB:.1f} GiB needed ({weights / GIB:.1f} weights, "
                f"{overhead_bytes / GIB:.1f} an engine beside them, {kv_bytes / GIB:.1f} of KV) "
                f"of the card's {total_bytes / GIB:.1f}: the largest ({largest}, "
                f"{models[largest].weight_bytes(itemsize) / GIB:.1f} GiB) left out"
            )
    return Fit(tuple(chosen), left, note)


# ---------------------------------------------------------------------------------------------
# the trace


@dataclass(frozen=True)
class Request:
    rid: str
    engine: int
    arrival_s: float  # from the trace's start
    prompt: list[int]
    new_tokens: int
    burst: int | None  # the index of its burst, None for the trickle


@dataclass(frozen=True)
class Burst:
    engine: int
    start_s: float
    end_s: float
    requests: int = 0


def burst_range(args: argparse.Namespace) -> tuple[int, int]:
    value = args.burst_requests
    values = [value] if isinstance(value, int) else list(value)
    low, high = min(values), max(values)
    if low < 1:
        raise SystemExit("--burst-requests must be at least 1")
    return low, high


def make_trace(
    args: argparse.Namespace, vocab: int | list[int], engines: int = 3
) -> tuple[list[Burst], list[Request]]:
    """The seeded trace: bursts in turn (each of a size drawn from `--burst-requests`), each
    engine's trickle outside its own bursts. `vocab`: each engine's (or one for all)."""
    rng = random.Random(args.seed)
    vocabs = [vocab] * engines if isinstance(vocab, int) else list(vocab)
    engines = len(vocabs)
    low, high = burst_range(args)
    bursts: list[Burst] = []
    arrivals: list[tuple[float, int, int | None]] = []
    for r in range(args.rounds):
        for engine in range(engines):
            start = args.lead_s + (r * engines + engine) * args.period_s
            size = rng.randint(low, high)
            bursts.append(Burst(engine, start, start + args.burst_s, size))
            for _ in range(size):
                arrivals.append((start + rng.uniform(0, args.burst_s), engine, len(bursts) - 1))
    span = args.lead_s + args.rounds * engines * args.period_s
    if args.trickle_per_s > 0:
        for engine in range(engines):
            own = [b for b in bursts if b.engine == engine]
            t = rng.expovariate(args.trickle_per_s)
            while t < span:
                if not any(b.start_s <= t <= b.end_s for b in own):
                    arrivals.append((t, engine, None))
                t += rng.expovariate(args.trickle_per_s)
    arrivals.sort()
    low_len, high_len = math.log(args.min_prompt), math.log(args.max_prompt)
    requests = []
    counts = [0] * engines
    for arrival, engine, burst in arrivals:
        length = round(math.exp(rng.uniform(low_len, high_len)))
        prompt = [rng.randrange(1, vocabs[engine]) for _ in range(length)]
        rid = f"e{engine}-{counts[engine]}"
        counts[engine] += 1
        requests.append(Request(rid, engine, arrival, prompt, args.new_tokens, burst))
    return bursts, requests


def check_sample(
    requests: list[Request], per_engine: int, seed: int, engines: int = 3
) -> list[Request]:
    """`per_engine` burst requests of each engine, seeded (0: every request of the trace):
    the requests run alone for the tokens."""
    if per_engine <= 0:
        return list(requests)
    rng = random.Random(seed + 1)
    sample: list[Request] = []
    for engine in range(engines):
        mine = [r for r in requests if r.engine == engine and r.burst is not None]
        sample += rng.sample(mine, min(per_engine, len(mine)))
    return sorted(sample, key=lambda r: r.arrival_s)
