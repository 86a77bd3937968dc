"""transformers' continuous batching as the tests drive it, written once: tiny seeded models
(Llama-, Qwen3-, sliding-window- and DeepSeek-V3-shaped), their configs, the prompts, greedy
generation on transformers' own cache or ours, running managers and threads, and the
extensible side of a cache (`state`, through the package's `state_of`, not `cache._ekv`).

Every name takes transformers as `tf` (the `transformers_fixtures.tf` fixture) or imports it
lazily: importing this module never imports transformers.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

PAGE = 16
MAX_NEW_TOKENS = 10
NUM_BLOCKS = 48  # the cap in the ContinuousBatchingConfig, for both caches, on the host
# On CUDA a granule is 2 MiB, 512 blocks of these models: a cap of 4096 blocks spans 8 granules,
# so the extension and the suspension change the committed bytes (48 would fit in one granule).
CUDA_NUM_BLOCKS = 4096
PROMPT_LENGTHS = (5, 17, 33, 9, 40)

# `mla`: DeepSeek-V3-shaped (multi-head latent attention), which transformers serves from 5.25
# (`MLACacheAllocator`: one row of two latents per token); skipped before, where
# `test_an_mla_model_is_served_from_5_25_and_refused_before` checks the refusal instead.
KINDS = ["llama", "qwen3", "sliding", "mla"]
ATTENTIONS = ["sdpa", "eager"]
COMMON: dict[str, Any] = {
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def state(cache_or_manager: Any) -> Any:
    """The extensible side of a cache (`extensible_kv.transformers.state.CacheState`), or of a
    manager's cache."""
    from extensible_kv.transformers.state import state_of

    batch_processor = getattr(cache_or_manager, "batch_processor", None)
    cache = cache_or_manager if batch_processor is None else batch_processor.cache
    return state_of(cache)


# ---------------------------------------------------------------------------------------------
# models


def has_mla_layout() -> bool:
    """Whether the running transformers lays out MLA latents (5.25+)."""
    import transformers.generation.continuous_batching.cache_allocators as allocators

    return hasattr(allocators, "MLACacheAllocator")


def mla_config(tf: Any) -> Any:
    """A tiny DeepSeek-V3: MLA in both layers (latents of 32 + 8 per token), no MoE layer (every
    layer below `first_k_dense_replace` is dense). MLA expands its latents to every attention
    head, so there are as many key/value heads as query heads."""
    return tf.DeepseekV3Config(
        num_hidden_layers=2,
        first_k_dense_replace=2,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        **{**COMMON, "num_key_value_heads": COMMON["num_attention_heads"]},
    )


def build_model(tf: Any, kind: str, attention: str, device: str) -> Any:
    """A tiny model of `kind` from its config, random weights seeded the same every time."""
    import torch

    if kind == "llama":
        config = tf.LlamaConfig(num_hidden_layers=2, **COMMON)
    elif kind == "qwen3":
        config = tf.Qwen3Config(num_hidden_layers=2, head_dim=16, **COMMON)
    elif kind == "mla":
        if not has_mla_layout():
            pytest.skip(
                f"transformers {tf.__version__} has no MLA cache layout (5.25+); "
                "test_an_mla_model_is_served_from_5_25_and_refused_before checks the refusal"
            )
        config = mla_config(tf)
    else:
        config = tf.Qwen2Config(
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            use_sliding_window=True,
            sliding_window=24,  # shorter than the longest request: the window slides
            **COMMON,
        )
    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype)
    return model.to(device).eval()


# ---------------------------------------------------------------------------------------------
# what each transformers release does differently


def _release() -> tuple[int, ...] | None:
    from extensible_kv._plugins import version_tuple

    return version_tuple(sys.modules["transformers"].__version__)


def warmup_reads_whole_cache(tf: Any) -> bool:
    """Before 5.21 the padded warm-up's prefill request had the whole cache as its past (5.21
    caps it at one page)."""
    release = _release()
    return release is not None and release[:2] < (5, 21)


def restarts_wrong(tf: Any) -> bool:
    """transformers 5.18's own cache serves wrong tokens once a manager is stopped and started
    again, and its loop fails after `stop(keep_for_next_session=True)`; 5.19 fixed both
    (`test_transformers_own_restart_is_right_from_5_19` holds each version to it)."""
    release = _release()
    return release is not None and release[:2] < (5, 19)


def xfail_where_restarts_are_wrong(tf: Any) -> None:
    """Where transformers' own restart serves wrong tokens, what a restarted manager serves
    says nothing of ours: the test ends here as an expected failure."""
    if restarts_wrong(tf):
        pytest.xfail(
            f"transformers {tf.__version__}'s own cache serves wrong tokens after a stop and "
            "a start (fixed in 5.19)"
        )


# ---------------------------------------------------------------------------------------------
# configs, prompts and generation


def cb_config(tf: Any, device: str) -> Any:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    options: dict[str, Any] = {}
    if "auto_switch_to_flash" in inspect.signature(ContinuousBatchingConfig).parameters:
        # 5.19+; 5.18 switches to flash only where its kernels are installed (never here)
        options["auto_switch_to_flash"] = False
    return ContinuousBatchingConfig(
        num_blocks=num_blocks(device),
        max_batch_tokens=64,
        page_size=PAGE,
        use_cuda_graph=device != "cpu",
        **options,
    )


def num_blocks(device: str) -> int:
    return CUDA_NUM_BLOCKS if device != "cpu" else NUM_BLOCKS


def gen_config(tf: Any, new_tokens: int = MAX_NEW_TOKENS) -> Any:
    return tf.GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )


@contextlib.contextmanager
def serving(tf: Any, model: Any, device: str, **options: Any) -> Iterator[Any]:
    """`model`'s continuous-batching manager on `extensible_kv.transformers`, enabled with
    `options` for its life: greedy `gen_config`, this module's `cb_config(device)`."""
    from extensible_kv import transformers as ekt

    with (
        ekt.enabled(**options),
        model.continuous_batching_context_manager(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, device)
        ) as manager,
    ):
        yield manager


def enable_options(device: str) -> dict[str, Any]:
    """The host backend has no free-memory figure: a budget (in small granules) stands in."""
    return {"budget_bytes": 1 << 24, "granularity": 4096} if device == "cpu" else {}


def prompts(vocab_size: int = 160) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(1)
    return [
        torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS
    ]


def generate(tf: Any, model: Any, device: str, new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """The prompts' greedy tokens through `generate_batch` (transformers' own cache, or ours
    while enabled)."""
    outputs = model.generate_batch(
        prompts(),
        generation_config=gen_config(tf, new_tokens),
        continuous_batching_config=cb_config(tf, device),
    )
    assert len(outputs) == len(PROMPT_LENGTHS)
    tokens = [output.generated_tokens for output in outputs.values()]
    assert all(len(t) == new_tokens for t in tokens)
    return tokens


def generate_with(tf: Any, model: Any, **kwargs: Any) -> Any:
    return model.generate_batch(
        prompts(),
        generation_config=gen_config(tf),
        continuous_batching_config=cb_config(tf, "cpu"),
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------
# running managers


def run(manager: Any, new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """The prompts through a running manager, in order."""
    return collect(manager, manager.add_requests(prompts(), max_new_tokens=new_tokens))


def collect(manager: Any, ids: list[str]) -> list[list[int]]:
    """The tokens of requests `ids`, in order, once each has finished."""
    results: dict[str, list[int]] = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=30)
        assert result is not None, "the manager returned nothing in 30 s"
        if result.is_finished():
            results[result.request_id] = result.generated_tokens
    return [results[i] for i in ids]


def warmed_up(tf: Any, model: Any) -> Any:
    """A manager of `model` (the host's configs), warmed up and not started."""
    manager = model.init_continuous_batching(
        generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
    )
    manager.warmup()
    return manager


def requests_holding_blocks(cache: Any) -> bool:
    return any(a.block_table for a in cache.cache_allocators.values())


# ---------------------------------------------------------------------------------------------
# threads


def in_thread(call: Any) -> None:
    """`call()` on a thread that then ends (as a worker or an executor would run it); its
    exception, if any, raised here."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            call()
        except BaseException as error:  # handed to the caller
            errors.append(error)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the call did not return in 60 s"
    if errors:
        raise errors[0]


def stop_within(manager: Any, seconds: float = 60, **kwargs: Any) -> None:
    """`manager.stop(block=True, **kwargs)`, failing (not hanging) when it takes too long."""
    in_thread(lambda: manager.stop(block=True, **kwargs))
    assert not manager.is_running()


class Call:
    """`call()` on a thread of its own, started at once; its exceptions in `errors`."""

    def __init__(self, call: Any) -> None:
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call: Any) -> None:
        try:
            call()
        except BaseException as error:  # handed to the test
            self.errors.append(error)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def add_on_top_sectors(
    manager: Any, requests: list[list[int]], new_tokens: int
) -> tuple[list[str], list[int]]:
    """Adds `requests` to a running manager with the lower half of its free sectors out of
    reach until they hold blocks, so that they take the top ones (blocks kept only for prefix
    sharing are forgotten first): their ids, and the sectors kept out meanwhile."""
    import time

    from extensible_kv.transformers import sectors

    cache = manager.batch_processor.cache
    pool = cache.pool
    with manager.pause():
        sectors.evict_cached_blocks(cache, 0)
        pool.try_to_free_sectors()
        low = sorted(pool.free_sectors)[: len(pool.free_sectors) // 2]
        pool.free_sectors[:] = [s for s in pool.free_sectors if s not in low]
    ids = manager.add_requests(requests, max_new_tokens=new_tokens)
    deadline = time.monotonic() + 30
    while not requests_holding_blocks(cache) and time.monotonic() < deadline:
        time.sleep(0.001)
    with manager.pause():
        pool.free_sectors.extend(low)
    return ids, low


def resizable(tf: Any, kind: str) -> tuple[Any, list[list[int]], dict[str, Any]]:
    """A model, its tokens on transformers' own cache, and `enable` options that extend the
    cache to 16 of its 48 blocks of capacity (8 KiB each on the llama: 2 trash + 16)."""
    model = build_model(tf, kind, "sdpa", "cpu")
    own = generate(tf, model, "cpu")
    sector = 8192 if kind == "llama" else None
    if sector is None:
        with model.continuous_batching_context_manager(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
        ) as manager:
            sector = int(manager.batch_processor.cache.bytes_per_sector)
    return model, own, {"budget_bytes": 18 * sector, "granularity": 4096}


def state_blocks(cache: Any, data_sectors: int) -> int:
    """The blocks `data_sectors` sectors past the trash hold."""
    return int(state(cache).blocks(data_sectors))
