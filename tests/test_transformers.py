"""transformers' continuous batching on extensible-kv (`extensible_kv.transformers`).

transformers' own model code runs: Llama-, Qwen3- and sliding-window-shaped (Qwen2 with
`sliding_attention` layers, transformers' `SlidingAttentionCacheAllocator`) models built from
configs with seeded random weights, `sdpa` and `eager` (continuous batching runs them as its
paged forms). Greedy `generate_batch` gives the same tokens with the extensible cache as with
transformers' own; release / resume keeps them; `disable()` leaves transformers as it was; an
unsupported version is refused. On CPU the warm-up runs no forward pass (no graphs): the
`padded` runs force transformers' padded warm-up, the CPU stand-in for CUDA graphs, so the
lowest-first commit during warm-up is exercised too. The `cuda` params run the same bodies
with `use_cuda_graph=True`.

Skipped, with the reason, where transformers >=5.18,<5.26 is absent; CI sets
EKV_REQUIRE_TRANSFORMERS=1, which turns the skip into a failure.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from extensible_kv import UnsupportedError
from support import stack_env

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.transformers

PAGE = 16
MAX_NEW_TOKENS = 10
NUM_BLOCKS = 48  # the cap in the ContinuousBatchingConfig, for both caches, on the host
# On CUDA a granule is 2 MiB, 512 blocks of these models: a cap of 4096 blocks spans 8 granules,
# so the extension and the release change the committed bytes (48 would fit in one granule).
CUDA_NUM_BLOCKS = 4096
PROMPT_LENGTHS = (5, 17, 33, 9, 40)


@pytest.fixture(scope="module")
def tf() -> Any:
    """transformers, supported by extensible_kv.transformers; a skip (a failure where
    EKV_REQUIRE_TRANSFORMERS is set) otherwise."""
    stack_env.require_transformers()
    import transformers

    return transformers


@pytest.fixture(autouse=True)
def _disabled_after() -> Iterator[None]:
    yield
    from extensible_kv import transformers as ekt

    ekt.disable()


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


def warmup_reads_whole_cache(tf: Any) -> bool:
    """Before 5.21 the padded warm-up's prefill request had the whole cache as its past (5.21
    caps it at one page)."""
    from extensible_kv._plugins import version_tuple

    release = version_tuple(sys.modules["transformers"].__version__)
    return release is not None and release[:2] < (5, 21)


def restarts_wrong(tf: Any) -> bool:
    """transformers 5.18's own cache serves wrong tokens once a manager is stopped and started
    again, and its loop fails after `stop(keep_for_next_session=True)`; 5.19 fixed both
    (`test_transformers_own_restart_is_right_from_5_19` holds each version to it)."""
    from extensible_kv._plugins import version_tuple

    release = version_tuple(sys.modules["transformers"].__version__)
    return release is not None and release[:2] < (5, 19)


def xfail_where_restarts_are_wrong(tf: Any) -> None:
    """Where transformers' own restart serves wrong tokens, what a restarted manager serves
    says nothing of ours: the test ends here as an expected failure."""
    if restarts_wrong(tf):
        pytest.xfail(
            f"transformers {tf.__version__}'s own cache serves wrong tokens after a stop and "
            "a start (fixed in 5.19)"
        )


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


def prompts(vocab_size: int = 160) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [
        torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS
    ]


def generate(tf: Any, model: Any, device: str, new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    outputs = model.generate_batch(
        prompts(),
        generation_config=gen_config(tf, new_tokens),
        continuous_batching_config=cb_config(tf, device),
    )
    assert len(outputs) == len(PROMPT_LENGTHS)
    tokens = [output.generated_tokens for output in outputs.values()]
    assert all(len(t) == new_tokens for t in tokens)
    return tokens


def enable_options(device: str) -> dict[str, Any]:
    """The host backend has no free-memory figure: a budget (in small granules) stands in."""
    return {"budget_bytes": 1 << 24, "granularity": 4096} if device == "cpu" else {}


@pytest.fixture(params=[False, True], ids=["plain", "padded"])
def padded(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tf: Any) -> bool:
    """`padded`: transformers' padded warm-up runs on CPU too (its CUDA-graph path without the
    graphs), for both caches."""
    if request.param:
        module = importlib.import_module("transformers.generation.continuous_batching.model_runner")
        init = module.ModelRunner.__init__

        def padded_init(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.pad_inputs = True

        monkeypatch.setattr(module.ModelRunner, "__init__", padded_init)
    return bool(request.param)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_same_tokens_and_more_blocks(
    tf: Any,
    kind: str,
    attention: str,
    device: str,
    padded: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from extensible_kv import transformers as ekt

    if padded and device != "cpu":
        pytest.skip("on cuda the warm-up is padded by use_cuda_graph=True already")
    model = build_model(tf, kind, attention, device)
    own = generate(tf, model, device)
    with (
        caplog.at_level(logging.INFO, logger="extensible_kv"),
        ekt.enabled(**enable_options(device)),
    ):
        extensible = generate(tf, model, device)
    assert extensible == own
    report = ekt.last_report()
    assert report is not None
    assert report.blocks_after <= num_blocks(device)
    if not (padded or device != "cpu"):
        assert report.blocks_before == 0 < report.blocks_after  # no warm-up request ran
    elif warmup_reads_whole_cache(tf):
        # 5.18 to 5.20 warm up with one request over transformers' whole size (here the cap)
        assert report.blocks_before == report.blocks_after == num_blocks(device)
    else:
        # 5.21+: the warm-up committed what its requests touched, not transformers' own size
        assert 0 < report.blocks_before < report.blocks_after
        assert report.bytes_before < report.bytes_after
    lines = [r.getMessage() for r in caplog.records if r.name == "extensible_kv"]
    assert (
        f"Extended KV cache to {report.blocks_after} blocks ({report.gib_after:.2f} GiB)" in lines
    )


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_an_mla_model_is_served_from_5_25_and_refused_before(
    tf: Any, attention: str, caplog: pytest.LogCaptureFixture
) -> None:
    """From 5.25 an MLA model's cache is transformers' `MLACacheAllocator` over our reservation
    (one row of both latents per token, no block table), extended past the warm-up, with
    transformers' own cache's tokens, which are also plain `generate`'s. Before 5.25
    transformers has no layout for the latents: its own cache fails every request (no token),
    and ours is refused at the warm-up with `UnsupportedError` naming why, before anything is
    reserved; a model of another shape is then served as usual."""
    from extensible_kv import transformers as ekt

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(
        mla_config(tf), attn_implementation=attention, dtype=torch.float32
    ).eval()
    if not has_mla_layout():
        with caplog.at_level(logging.ERROR):
            outputs = model.generate_batch(
                prompts(),
                generation_config=gen_config(tf),
                continuous_batching_config=cb_config(tf, "cpu"),
            )
        assert len(outputs) == len(PROMPT_LENGTHS)
        assert all(not output.generated_tokens for output in outputs.values())
        llama = build_model(tf, "llama", attention, "cpu")
        own = generate(tf, llama, "cpu")
        report = ekt.last_report()
        with ekt.enabled(**enable_options("cpu")):
            with pytest.raises(UnsupportedError, match=r"MLA .*kv_lora_rank=32.*5\.25") as error:
                generate(tf, model, "cpu")
            assert tf.__version__ in str(error.value)
            assert ekt.last_report() is report  # nothing was extended
            assert generate(tf, llama, "cpu") == own
        return
    own = generate(tf, model, "cpu")
    first = prompts()[0]
    plain = model.generate(
        torch.tensor([first]), max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS
    )
    assert plain[0, len(first) :].tolist() == own[0]
    with ekt.enabled(**enable_options("cpu")):
        with model.continuous_batching_context_manager(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
        ) as manager:
            cache = manager.batch_processor.cache
            (allocator,) = cache.cache_allocators.values()
            assert type(allocator).__name__ == "MLACacheAllocator"
            assert not allocator.supports_block_table
            # One row per token, both latents (32 + 8 float32), for each of a block's 2 layers.
            assert allocator.bytes_per_block == 2 * PAGE * 40 * 4 == cache._ekv.bytes_per_block
            assert allocator.cache_tensor.data_ptr() == cache._ekv.tensor.full_view().data_ptr()
            assert run(manager) == own
        assert generate(tf, model, "cpu") == own
    report = ekt.last_report()
    assert report is not None and 0 < report.blocks_after <= NUM_BLOCKS


def test_budget_limits_the_extension(tf: Any) -> None:
    """On the host the budget is what the cache may hold in all after warm-up (as
    `extend_to_fit` takes it): the extension takes the most sectors whose granule-rounded
    footprint, with what warm-up committed, fits, below the cap."""
    from extensible_kv import transformers as ekt

    model = build_model(tf, "llama", "sdpa", "cpu")
    own = generate(tf, model, "cpu")
    sector = 8192  # a sector of this model is one 8 KiB block
    budget = (2 + 12) * sector + 100  # the two trash sectors and 12 blocks
    with ekt.enabled(budget_bytes=budget, granularity=4096):
        assert generate(tf, model, "cpu") == own
    report = ekt.last_report()
    assert report is not None
    assert report.budget_source == "given"
    assert report.budget_bytes == budget - report.bytes_before
    assert report.blocks_after == report.fit_blocks == 12 < report.capacity_blocks == NUM_BLOCKS
    assert report.bytes_after <= budget < report.bytes_after + sector


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_release_resume_same_tokens(tf: Any, kind: str, attention: str, device: str) -> None:
    """release / resume on the manager `continuous_batching_context_manager` yields, running:
    the memory goes and comes back at the same addresses, the tokens stay the same."""
    from extensible_kv import transformers as ekt

    model = build_model(tf, kind, attention, device)
    own = generate(tf, model, device)
    with (
        ekt.enabled(**enable_options(device)),
        model.continuous_batching_context_manager(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, device)
        ) as manager,
    ):
        assert run(manager) == own
        cache = manager.batch_processor.cache
        state = cache._ekv
        address, full_bytes, num_blocks = (
            cache.cache_tensor.data_ptr(),
            state.tensor.physical_bytes,
            cache.num_blocks,
        )
        ekt.release(manager)
        assert state.tensor.physical_bytes < full_bytes
        assert cache.pool.num_free_sectors == 0
        ekt.resume(manager)
        assert cache.cache_tensor.data_ptr() == address
        assert (state.tensor.physical_bytes, cache.num_blocks) == (full_bytes, num_blocks)
        assert run(manager) == own
        ekt.release(manager, keep_blocks=3)
        assert cache.pool.num_free_sectors * cache.bytes_per_sector >= 3 * full_block_bytes(cache)
        ekt.resume(manager)
        assert run(manager) == own


def full_block_bytes(cache: Any) -> int:
    return int(cache._ekv.bytes_per_block)


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


def in_thread(call: Any) -> None:
    """`call()` on a thread that then ends (as a worker or an executor would run it); its
    exception, if any, raised here."""
    import threading

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


@pytest.mark.timeout(120)
def test_stopping_a_released_manager_ends_the_pause(tf: Any) -> None:
    """Leaving `continuous_batching_context_manager` while the cache is released stops the
    manager (transformers refuses to stop inside a pause: release's pause ends first), even
    after `disable()`; the cache stays released, and a kept manager resumes and serves again.
    The pause is not the releasing thread's: `resume` from another thread works."""
    from extensible_kv import transformers as ekt

    model = build_model(tf, "llama", "sdpa", "cpu")
    own = generate(tf, model, "cpu")
    with ekt.enabled(**enable_options("cpu")):
        with model.continuous_batching_context_manager(
            generation_config=gen_config(tf),
            continuous_batching_config=cb_config(tf, "cpu"),
            persistent_manager=True,
        ) as manager:
            assert run(manager) == own
            ekt.release(manager)
            in_thread(lambda: ekt.resume(manager))  # another thread than release's
            assert run(manager) == own
            ekt.release(manager)
            # The guard is the manager's own, not transformers' class's: it outlives disable().
            assert "stop" in vars(manager)
            ekt.disable()
        assert not manager.is_running()
        state = manager.batch_processor.cache._ekv
        assert state.released and state.pause is None
        with pytest.raises(RuntimeError, match=r"resume\(manager\) before starting"):
            manager.start()
        ekt.resume(manager)
        assert "stop" not in vars(manager) and "start" not in vars(manager)
        manager.start()
        try:
            xfail_where_restarts_are_wrong(tf)
            assert run(manager) == own
        finally:
            manager.stop(block=True)
            manager.destroy()


@pytest.mark.timeout(120)
def test_a_release_from_an_ended_thread_never_strands_the_manager(tf: Any) -> None:
    """`release` in a thread that then ends (a `threading.Thread`, an executor's worker): the
    pause it holds is not that thread's, so `resume` and `stop` from any other thread work, and
    the loop does not stay parked."""
    from extensible_kv import transformers as ekt

    model = build_model(tf, "llama", "sdpa", "cpu")
    own = generate(tf, model, "cpu")
    with ekt.enabled(**enable_options("cpu")):
        manager = warmed_up(tf, model)
        manager.start()
        try:
            assert run(manager) == own
            in_thread(lambda: ekt.release(manager))
            ekt.resume(manager)
            assert run(manager) == own
            in_thread(lambda: ekt.release(manager))
            stop_within(manager, keep_for_next_session=True)
            in_thread(lambda: ekt.resume(manager))
            manager.start()
            xfail_where_restarts_are_wrong(tf)
            assert run(manager) == own
        finally:
            stop_within(manager)
            manager.destroy()


def test_a_released_interpreter_exits(tf: Any, tmp_path: Any) -> None:
    """A process whose manager was released from a worker thread and stopped from the main
    thread (leaving `continuous_batching_context_manager`) exits: nothing is left parked."""
    import subprocess
    import textwrap

    script = tmp_path / "released.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, threading
            sys.path[:0] = {[str(Path(__file__).parent)]!r}
            import transformers as tf
            import test_transformers as t
            from extensible_kv import transformers as ekt

            model = t.build_model(tf, "llama", "sdpa", "cpu")
            with ekt.enabled(**t.enable_options("cpu")):
                with model.continuous_batching_context_manager(
                    generation_config=t.gen_config(tf),
                    continuous_batching_config=t.cb_config(tf, "cpu"),
                ) as manager:
                    t.run(manager)
                    worker = threading.Thread(target=ekt.release, args=(manager,))
                    worker.start()
                    worker.join()
            print("left the context")
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "left the context" in result.stdout


@pytest.mark.timeout(120)
def test_stop_without_keep_while_released_drops_the_cache(tf: Any) -> None:
    """transformers' default `stop` drops the batch processor, and with it the released cache:
    `resume` says there is nothing to resume, and the next start builds a new cache that
    serves."""
    from extensible_kv import transformers as ekt

    model = build_model(tf, "llama", "sdpa", "cpu")
    own = generate(tf, model, "cpu")
    with ekt.enabled(**enable_options("cpu")):
        manager = warmed_up(tf, model)
        manager.start()
        try:
            assert run(manager) == own
            ekt.release(manager)
            stop_within(manager)
            assert manager.batch_processor is None
            with pytest.raises(RuntimeError, match="nothing to resume"):
                ekt.resume(manager)
            manager.start()  # not guarded any more: a new cache is built
            xfail_where_restarts_are_wrong(tf)
            assert run(manager) == own
        finally:
            stop_within(manager)
            manager.destroy()


@pytest.mark.timeout(120)
def test_transformers_own_restart_is_right_from_5_19(tf: Any) -> None:
    """What `xfail_where_restarts_are_wrong` rests on, with extensible_kv off: from 5.19 a
    manager stopped and started again serves the same tokens; 5.18 serves others."""
    model = build_model(tf, "llama", "sdpa", "cpu")
    own = generate(tf, model, "cpu")
    manager = warmed_up(tf, model)
    manager.start()
    try:
        assert run(manager) == own
        stop_within(manager)
        manager.start()
        assert (run(manager) == own) is not restarts_wrong(tf)
    finally:
        stop_within(manager)
        manager.destroy()


def test_a_released_manager_that_was_not_running_refuses_to_start(tf: Any) -> None:
    """Released after its warm-up but before `start` (no pause to hold): its pool is empty, so
    starting it would serve from a cache of no block; `start` refuses until `resume`."""
    from extensible_kv import transformers as ekt

    model = build_model(tf, "llama", "sdpa", "cpu")
    own = generate(tf, model, "cpu")
    with ekt.enabled(**enable_options("cpu")):
        manager = warmed_up(tf, model)
        ekt.release(manager)
        with pytest.raises(RuntimeError, match=r"resume\(manager\)"):
            manager.start()
        assert not manager.is_running()
        ekt.resume(manager)
        manager.start()
        try:
            assert run(manager) == own
        finally:
            stop_within(manager)
            manager.destroy()


def test_each_mistake_gets_its_own_message(tf: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from extensible_kv import transformers as ekt

    for wrong in (None, "manager", 3):
        with pytest.raises(TypeError, match="ContinuousBatchingManager"):
            ekt.release(wrong)
        with pytest.raises(TypeError, match="ContinuousBatchingManager"):
            ekt.resume(wrong)
    model = build_model(tf, "llama", "sdpa", "cpu")
    with ekt.enabled(**enable_options("cpu")):
        manager = model.init_continuous_batching(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
        )
        with pytest.raises(RuntimeError, match="no KV cache yet: warm it up"):
            ekt.release(manager)
        # Just after start(), before the loop's thread has built its batch processor.
        monkeypatch.setattr(manager, "is_running", lambda: True)
        with pytest.raises(RuntimeError, match="loop's own thread after start"):
            ekt.release(manager)


def test_release_refuses_what_it_cannot_do(tf: Any) -> None:
    from extensible_kv import transformers as ekt

    model = build_model(tf, "llama", "sdpa", "cpu")
    own_tokens = generate(tf, model, "cpu")
    with model.continuous_batching_context_manager(
        generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
    ) as own:
        with pytest.raises(ValueError, match="not extensible"):
            ekt.release(own)
    with (
        ekt.enabled(**enable_options("cpu")),
        model.continuous_batching_context_manager(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
        ) as manager,
    ):
        with pytest.raises(RuntimeError, match="not released"):
            ekt.resume(manager)
        with pytest.raises(ValueError, match="keep_blocks"):
            ekt.release(manager, keep_blocks=-1)
        with pytest.raises(TypeError, match="keep_blocks"):
            ekt.release(manager, keep_blocks=1.5)  # type: ignore[arg-type]
        ekt.release(manager)
        with pytest.raises(RuntimeError, match="already released"):
            ekt.release(manager)
        ekt.resume(manager)
        assert run(manager) == own_tokens


def bindings(tf: Any) -> dict[tuple[str, str], Any]:
    """Every object `enable` may replace, by (module or class, name)."""
    import transformers.generation.continuous_batching.continuous_api as api

    found: dict[tuple[str, str], Any] = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("transformers.generation.continuous_batching"):
            for attr in ("PagedAttentionCache", "PagedAttentionMemoryHandler"):
                if attr in vars(module):
                    found[(name, attr)] = vars(module)[attr]
    for attr in (
        "warmup",
        "_create_batch_processor",
        "_run_generation_loop",
        "_generation_loop_body",
        "pause",
        "stop",
    ):
        found[("ContinuousBatchingManager", attr)] = vars(api.ContinuousBatchingManager)[attr]
    return found


def test_disable_restores_every_binding(tf: Any) -> None:
    import transformers.generation.continuous_batching.cache as cache_module
    import transformers.generation.continuous_batching.continuous_api as api
    from extensible_kv import transformers as ekt

    before = bindings(tf)
    original = cache_module.PagedAttentionCache
    ekt.enable(budget_bytes=1 << 20)
    assert ekt.is_enabled()
    assert api.PagedAttentionCache is not original
    assert issubclass(api.PagedAttentionCache, original)
    assert cache_module.PagedAttentionCache is original  # the class's home keeps it
    changed = {key for key, value in bindings(tf).items() if value is not before[key]}
    assert (
        "transformers.generation.continuous_batching.continuous_api",
        "PagedAttentionCache",
    ) in changed
    assert ("ContinuousBatchingManager", "warmup") in changed
    ekt.enable(budget_bytes=2 << 20)  # again: new options, the same patches
    assert {k for k, v in bindings(tf).items() if v is not before[k]} == changed
    ekt.disable()
    assert not ekt.is_enabled()
    after = bindings(tf)
    assert after.keys() == before.keys()
    assert all(after[key] is before[key] for key in before)
    with ekt.enabled(budget_bytes=1 << 20):
        assert api.PagedAttentionCache is not original
    assert all(bindings(tf)[key] is before[key] for key in before)


def test_disabled_managers_get_transformers_cache(tf: Any) -> None:
    from extensible_kv import transformers as ekt

    model = build_model(tf, "llama", "sdpa", "cpu")
    with ekt.enabled(**enable_options("cpu")):
        pass
    with model.continuous_batching_context_manager(
        generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
    ) as manager:
        cache = manager.batch_processor.cache
        import transformers.generation.continuous_batching.cache as cache_module

        assert type(cache) is cache_module.PagedAttentionCache
        assert not hasattr(cache, "_ekv")


@pytest.mark.parametrize("version", ["5.17.0", "5.26.0", "4.57.6", "6.0.0", "not-a-version"])
def test_unsupported_version_is_refused(
    tf: Any, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    from extensible_kv import transformers as ekt

    before = bindings(tf)
    # Building a model can replace sys.modules["transformers"] (transformers' lazy module):
    # patch the one `import transformers` finds now.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    with pytest.raises(
        UnsupportedError, match=r"transformers >=5\.18,<5\.26 \(5\.18\.0 to 5\.25\.x\)"
    ) as error:
        ekt.enable(budget_bytes=1 << 20)
    assert version in str(error.value)
    assert not ekt.is_enabled()
    assert all(bindings(tf)[key] is value for key, value in before.items())


def test_every_text_names_the_supported_range() -> None:
    """The range is written once (`MIN_VERSION`, `MAX_VERSION`); what installs it and what
    names it must say the same, so that a widened range leaves no text behind."""
    import tomllib

    from extensible_kv import transformers as ekt
    from extensible_kv.transformers import patch

    assert ekt.SUPPORTED == ">=5.18,<5.26"
    assert [patch._supports(v) for v in ("5.17.9", "5.18.0", "5.25.0", "5.25.9", "5.26.0")] == [
        False,
        True,
        True,
        True,
        False,
    ]
    root = Path(__file__).parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    assert f"transformers{ekt.SUPPORTED}" in extras["transformers"]
    assert f"transformers{ekt.SUPPORTED}" in extras["demo"]
    (marker,) = (
        m for m in project["tool"]["pytest"]["ini_options"]["markers"] if m.startswith("transf")
    )
    assert f"transformers {ekt.SUPPORTED} is absent" in marker
    words = f"transformers {ekt.SUPPORTED} is absent"
    for test in ("test_transformers.py", "test_pool_transformers.py", "test_demo.py"):
        assert words in " ".join((root / "tests" / test).read_text().split()), test
    assert "transformers 5.18 to 5.25." in " ".join((ekt.__doc__ or "").split())


def test_options_are_checked_before_anything_changes(tf: Any) -> None:
    from extensible_kv import transformers as ekt

    with pytest.raises(ValueError, match="budget_bytes"):
        ekt.enable(budget_bytes=-1)
    with pytest.raises(TypeError, match="granularity"):
        ekt.enable(granularity="4k")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ekt.enable(budget=1)  # type: ignore[call-arg]
    assert not ekt.is_enabled()


def test_options_take_any_integer_the_core_takes(tf: Any) -> None:
    """numpy and torch integers are sizes, as the core takes them (`operator.index`); a
    granularity that is no power of two is refused at `enable`, not inside `generate_batch`."""
    import numpy as np
    from extensible_kv import transformers as ekt

    model = build_model(tf, "llama", "sdpa", "cpu")
    own = generate(tf, model, "cpu")
    with ekt.enabled(budget_bytes=np.int64(1 << 24), granularity=torch.tensor(4096)):
        options = ekt.patch.current_options()
        assert options is not None
        assert (type(options.budget_bytes), type(options.granularity)) == (int, int)
        assert generate(tf, model, "cpu") == own
        with model.continuous_batching_context_manager(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
        ) as manager:
            ekt.release(manager, keep_blocks=np.int32(3))
            ekt.resume(manager)
            assert run(manager) == own
    with pytest.raises(ValueError, match="granularity 3000 must be a power of two"):
        ekt.enable(granularity=3000)
    with pytest.raises(TypeError, match="budget_bytes"):
        ekt.enable(budget_bytes=True)
    with pytest.raises(TypeError, match="host_free"):
        ekt.enable(host_free=1)  # type: ignore[arg-type]
    assert not ekt.is_enabled()


def test_enabled_restores_the_state_before_it(tf: Any) -> None:
    from extensible_kv import transformers as ekt

    ekt.enable(budget_bytes=1 << 20)
    with ekt.enabled(budget_bytes=2 << 20):
        ekt.disable()
    assert ekt.is_enabled()
    options = ekt.patch.current_options()
    assert options is not None and options.budget_bytes == 1 << 20
    with ekt.enabled(budget_bytes=2 << 20):
        ekt.enable(budget_bytes=3 << 20)
    options = ekt.patch.current_options()
    assert options is not None and options.budget_bytes == 1 << 20
    ekt.disable()
    with ekt.enabled(budget_bytes=2 << 20):
        ekt.disable()
    assert not ekt.is_enabled() and ekt.patch.current_options() is None


def generate_with(tf: Any, model: Any, **kwargs: Any) -> Any:
    return model.generate_batch(
        prompts(),
        generation_config=gen_config(tf),
        continuous_batching_config=cb_config(tf, "cpu"),
        **kwargs,
    )


@pytest.mark.parametrize("budget", [0, 1 << 12, (2 << 13) + 100])
def test_a_budget_of_no_block_is_refused_before_the_warmup(tf: Any, budget: int) -> None:
    """A budget below the trash sectors and one sector (8 KiB each here) is an
    `OutOfMemoryError` naming the budget and what one block needs, before the warm-up: never a
    cache of 0 blocks that fails every request inside transformers' scheduler."""
    from extensible_kv import OutOfMemoryError
    from extensible_kv import transformers as ekt

    model = build_model(tf, "llama", "sdpa", "cpu")
    with (
        ekt.enabled(budget_bytes=budget, granularity=4096),
        pytest.raises(OutOfMemoryError, match=f"budget_bytes={budget}, where one block needs") as e,
    ):
        generate_with(tf, model)
    assert e.value.requested_bytes == 3 * 8192


def test_too_little_free_memory_is_refused(tf: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured budgets: free memory under the margin is refused before the warm-up; free
    memory that is gone by the extension is refused there, in `warmup()` (no cache of 0
    blocks is ever served)."""
    from extensible_kv import OutOfMemoryError, sizing
    from extensible_kv import transformers as ekt

    model = build_model(tf, "llama", "sdpa", "cpu")
    monkeypatch.setattr(sizing, "host_free_bytes", lambda: 512 << 20)  # under the 1 GiB margin
    with (
        ekt.enabled(host_free=True, granularity=4096),
        pytest.raises(OutOfMemoryError, match="less a margin of at least 1073741824"),
    ):
        generate_with(tf, model)
    figures = iter([64 << 20])  # free at the cache's construction; nothing at the extension

    monkeypatch.setattr(sizing, "host_free_bytes", lambda: next(figures, 0))
    with (
        ekt.enabled(host_free=True, margin_bytes=0, granularity=4096),
        pytest.raises(OutOfMemoryError, match=r"0 bytes free \(host_free_bytes\)"),
    ):
        generate_with(tf, model)


def test_a_budget_beyond_free_memory_is_refused_before_the_warmup(tf: Any) -> None:
    """`budget_bytes=1 << 50` with no `num_blocks` cap: refused at once, naming the free memory,
    rather than failing with out of memory after the warm-up."""
    import time

    from extensible_kv import OutOfMemoryError
    from extensible_kv import transformers as ekt
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = build_model(tf, "llama", "sdpa", "cpu")
    config = cb_config(tf, "cpu")
    uncapped = ContinuousBatchingConfig(
        **{**{k: getattr(config, k) for k in ("max_batch_tokens", "page_size")}, "num_blocks": None}
    )
    start = time.perf_counter()
    with (
        ekt.enabled(budget_bytes=1 << 50),
        pytest.raises(OutOfMemoryError, match=r"more than the \d+ bytes free"),
    ):
        model.generate_batch(
            prompts(), generation_config=gen_config(tf), continuous_batching_config=uncapped
        )
    assert time.perf_counter() - start < 10


def test_the_report_shows_the_budget_asked_and_used(tf: Any) -> None:
    from extensible_kv import transformers as ekt

    model = build_model(tf, "llama", "sdpa", "cpu")
    with ekt.enabled(budget_bytes=1 << 24, granularity=4096):
        generate_with(tf, model)
    report = ekt.last_report()
    assert report is not None
    assert report.budget_asked_bytes == 1 << 24
    assert report.budget_bytes == (1 << 24) - report.bytes_before
    assert report.bytes_after <= report.budget_asked_bytes


def test_host_backend_needs_a_budget(tf: Any) -> None:
    from extensible_kv import transformers as ekt

    model = build_model(tf, "llama", "sdpa", "cpu")
    with ekt.enabled(), pytest.raises(ValueError, match="budget_bytes"):
        model.generate_batch(
            prompts(),
            generation_config=gen_config(tf),
            continuous_batching_config=cb_config(tf, "cpu"),
        )


def test_without_warmup_the_generation_loop_extends(tf: Any) -> None:
    """`warmup=False`: the generation loop builds the batch processor itself, and the cache is
    extended there, before the first step."""
    from extensible_kv import transformers as ekt

    model = build_model(tf, "qwen3", "sdpa", "cpu")
    own = generate(tf, model, "cpu")
    with ekt.enabled(**enable_options("cpu")):
        outputs = model.generate_batch(
            prompts(),
            generation_config=gen_config(tf),
            continuous_batching_config=cb_config(tf, "cpu"),
            warmup=False,
        )
    assert [o.generated_tokens for o in outputs.values()] == own
    report = ekt.last_report()
    assert report is not None and report.blocks_before == 0 < report.blocks_after


# ---------------------------------------------------------------------------------------------
# resize while requests run


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


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", KINDS)
def test_resize_a_live_manager_keeps_the_tokens(tf: Any, kind: str) -> None:
    """Grow and shrink while the prompts are in flight: the same tokens as transformers' own
    cache; the pool, the committed bytes and the reports follow."""
    from extensible_kv import transformers as ekt

    model, own, options = resizable(tf, kind)
    with (
        ekt.enabled(**options),
        model.continuous_batching_context_manager(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
        ) as manager,
    ):
        cache = manager.batch_processor.cache
        state = cache._ekv
        first = cache.num_blocks
        assert 0 < first < NUM_BLOCKS
        for size in (NUM_BLOCKS, 4, first):
            ids = manager.add_requests(prompts(), max_new_tokens=MAX_NEW_TOKENS)
            physical = state.tensor.physical_bytes
            report = ekt.resize(manager, size, timeout=60)  # the prompts run meanwhile
            assert ekt.last_report() is report and report.budget_source == "resize"
            assert report.blocks_after == cache.num_blocks >= size
            assert cache.num_sectors == cache.pool.num_sectors == state.final_sectors
            bigger = size > report.blocks_before
            assert (state.tensor.physical_bytes > physical) == bigger, (size, report)
            assert collect(manager, ids) == own, size
        assert manager.continuous_batching_config.num_blocks == cache.num_blocks


@pytest.mark.timeout(120)
def test_a_shrink_past_live_blocks_waits_then_names_them(tf: Any) -> None:
    """Blocks requests hold are not taken: past the timeout the shrink names the requests and
    changes nothing; once they finish it goes through, and the smaller cache serves."""
    from extensible_kv import transformers as ekt

    model, own, options = resizable(tf, "llama")
    with (
        ekt.enabled(**options),
        model.continuous_batching_context_manager(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
        ) as manager,
    ):
        cache = manager.batch_processor.cache
        state = cache._ekv
        ekt.resize(manager, NUM_BLOCKS)
        # Two long requests: admitted, they hold blocks for a few hundred steps.
        long_ids = manager.add_requests(prompts()[:2], max_new_tokens=400)
        deadline = time.monotonic() + 30
        while not _requests_holding_blocks(cache) and time.monotonic() < deadline:
            time.sleep(0.001)
        before = (cache.num_blocks, state.tensor.physical_bytes)
        with pytest.raises(TimeoutError, match=r"requests hold blocks past block 1 \(") as error:
            ekt.resize(manager, 1, timeout=0)
        assert "nothing changed" in str(error.value)
        assert any(request_id in str(error.value) for request_id in long_ids)
        assert (cache.num_blocks, state.tensor.physical_bytes) == before
        assert all(len(tokens) == 400 for tokens in collect(manager, long_ids))
        report = ekt.resize(manager, 8, timeout=0)  # free now (prefix-cached blocks evicted)
        assert report.blocks_after == cache.num_blocks == 8
        assert state.tensor.physical_bytes < before[1]
        assert run(manager) == own  # eight blocks serve the prompts, a few at a time


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
def test_a_shrink_with_move_copies_live_blocks_down(
    tf: Any, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`move=True`: requests that hold sectors past the new size are not waited for; their
    sectors are copied below and their block tables renamed mid-generation, and their tokens
    equal the same requests' run on an unmoved cache."""
    from extensible_kv import transformers as ekt

    model, _, options = resizable(tf, kind)
    caplog.set_level(logging.INFO, logger="extensible_kv")
    long = prompts()[:3]
    with (
        ekt.enabled(**options),
        model.continuous_batching_context_manager(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
        ) as manager,
    ):
        cache = manager.batch_processor.cache
        ekt.resize(manager, NUM_BLOCKS)
        reference = collect(manager, manager.add_requests(long, max_new_tokens=200))
        ids, low = add_on_top_sectors(manager, long, 200)
        cut = min(low) + len(low) - 2  # every sector the requests hold is at or past it
        report = ekt.resize(manager, state_blocks(cache, cut), move=True, timeout=0)
        assert report.blocks_after == cache.num_blocks < report.blocks_before
        assert collect(manager, ids) == reference
    assert any(r.getMessage().startswith("Moved ") for r in caplog.records)


def add_on_top_sectors(
    manager: Any, requests: list[list[int]], new_tokens: int
) -> tuple[list[str], list[int]]:
    """Adds `requests` to a running manager with the lower half of its free sectors out of
    reach until they hold blocks, so that they take the top ones (blocks kept only for prefix
    sharing are forgotten first): their ids, and the sectors kept out meanwhile."""
    from extensible_kv.transformers import cache as ekc

    cache = manager.batch_processor.cache
    pool = cache.pool
    with manager.pause():
        ekc._evict_cached_blocks(cache, 0)
        pool.try_to_free_sectors()
        low = sorted(pool.free_sectors)[: len(pool.free_sectors) // 2]
        pool.free_sectors[:] = [s for s in pool.free_sectors if s not in low]
    ids = manager.add_requests(requests, max_new_tokens=new_tokens)
    deadline = time.monotonic() + 30
    while not _requests_holding_blocks(cache) and time.monotonic() < deadline:
        time.sleep(0.001)
    with manager.pause():
        pool.free_sectors.extend(low)
    return ids, low


def state_blocks(cache: Any, data_sectors: int) -> int:
    """The blocks `data_sectors` sectors past the trash hold."""
    return int(cache._ekv.blocks(data_sectors))


def _requests_holding_blocks(cache: Any) -> bool:
    return any(a.block_table for a in cache.cache_allocators.values())


@pytest.mark.timeout(120)
def test_a_resize_that_waited_for_another_reads_the_size_it_left(tf: Any) -> None:
    """A resize waits for one in flight (the policy's, another thread's): it must size from
    what that one left, not from what it read before waiting. Here the cache grows to 24
    sectors while a resize to 12 waits: the resize shrinks to 12, and transformers' pool holds
    exactly the 12 committed sectors."""
    from extensible_kv import transformers as ekt
    from extensible_kv.transformers import cache as ekc

    model, own, options = resizable(tf, "llama")
    with (
        ekt.enabled(**options),
        model.continuous_batching_context_manager(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
        ) as manager,
    ):
        cache = manager.batch_processor.cache
        state = cache._ekv
        ekt.resize(manager, 8)
        with state.resizing:  # a resize in flight
            waiting = _start(lambda: ekt.resize(manager, state_blocks(cache, 12), timeout=30))
            time.sleep(0.2)
            assert waiting.is_alive()  # blocked on the lock
            with manager.pause():
                ekc._grow_live(cache, state, 24)
        waiting.join(timeout=60)
        assert not waiting.is_alive() and not waiting.errors, waiting.errors
        assert state.final_sectors == state.committed_sectors == cache.num_sectors == 12
        assert state.tensor.bytes_per_segment == (2 + 12) * state.bytes_per_sector
        assert sorted(cache.pool.free_sectors) == list(range(2, 2 + 12))
        assert run(manager) == own


def test_release_and_resume_read_the_size_under_the_lock(tf: Any) -> None:
    """`release(keep_blocks=...)` waiting for a resize keeps at most what that resize left,
    and a second `resume` that waited for the first says there is nothing to resume."""
    from extensible_kv import transformers as ekt

    model, own, options = resizable(tf, "llama")
    with (
        ekt.enabled(**options),
        model.continuous_batching_context_manager(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
        ) as manager,
    ):
        cache = manager.batch_processor.cache
        state = cache._ekv
        ekt.resize(manager, state_blocks(cache, 16))
        with state.resizing:
            waiting = _start(lambda: ekt.release(manager, keep_blocks=state_blocks(cache, 16)))
            time.sleep(0.2)
            assert waiting.is_alive()
            with manager.pause():
                assert ekc_take_out_and_unmap(cache, state, 4)
        waiting.join(timeout=60)
        assert not waiting.errors, waiting.errors
        assert state.released and state.committed_sectors == cache.num_sectors == 4
        assert state.tensor.bytes_per_segment == (2 + 4) * state.bytes_per_sector
        with state.resizing:
            first = _start(lambda: ekt.resume(manager))
            second = _start(lambda: ekt.resume(manager))
            time.sleep(0.2)
        first.join(timeout=60)
        second.join(timeout=60)
        errors = first.errors + second.errors
        assert len(errors) == 1 and "nothing to resume" in str(errors[0]), errors
        assert not state.released and cache.num_sectors == state.final_sectors == 4
        assert run(manager) == own


def ekc_take_out_and_unmap(cache: Any, state: Any, target: int) -> bool:
    """A shrink's two steps, as `resize` takes them under the lock."""
    from extensible_kv.transformers import cache as ekc

    if not ekc.take_out_of_pool(cache, state, target):
        return False
    ekc.unmap_past(cache, state, target)
    return True


class _Call:
    """`call()` on a thread of its own; its exceptions in `errors`."""

    def __init__(self, call: Any) -> None:
        import threading

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


def _start(call: Any) -> _Call:
    return _Call(call)


def test_resize_refuses_bad_sizes_before_anything_changes(tf: Any) -> None:
    from extensible_kv import transformers as ekt

    model, _, options = resizable(tf, "llama")
    with (
        ekt.enabled(**options),
        model.continuous_batching_context_manager(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
        ) as manager,
    ):
        cache = manager.batch_processor.cache
        before = (cache.num_blocks, cache._ekv.tensor.physical_bytes)
        with pytest.raises(TypeError, match="num_blocks"):
            ekt.resize(manager, 2.5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="num_blocks must be at least 1"):
            ekt.resize(manager, 0)
        with pytest.raises(ValueError, match=r"more than the reservation holds \(48 blocks"):
            ekt.resize(manager, NUM_BLOCKS + 1)
        with pytest.raises(ValueError, match="timeout"):
            ekt.resize(manager, 4, timeout=-1)
        with pytest.raises(TypeError, match="timeout"):
            ekt.resize(manager, 4, timeout="1")  # type: ignore[arg-type]
        ekt.release(manager)
        with pytest.raises(RuntimeError, match="resume"):
            ekt.resize(manager, 4)
        ekt.resume(manager)
        assert (cache.num_blocks, cache._ekv.tensor.physical_bytes) == before


# ---------------------------------------------------------------------------------------------
# the automatic policy


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", KINDS)
def test_auto_resize_follows_a_bursty_load(
    tf: Any, kind: str, device: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Bursts of requests with idle time between them: the cache starts at its least, grows
    on demand within a burst (no request waits for memory that is there), shrinks back when
    idle, and every burst's tokens equal transformers' own cache's. On CUDA the decode steps
    replay CUDA graphs captured before the growth."""
    from extensible_kv import transformers as ekt

    if device == "cpu":
        model, own, options = resizable(tf, kind)
        policy = ekt.AutoResize(min_blocks=2, idle_s=0.2)
    else:  # the extension measures; a 2 MiB granule holds 256 blocks of these models
        model = build_model(tf, kind, "sdpa", device)
        own, options = generate(tf, model, device), {}
        policy = ekt.AutoResize(min_blocks=1, step_blocks=16, idle_s=0.2)
    caplog.set_level(logging.INFO, logger="extensible_kv")
    with (
        ekt.enabled(**options, auto_resize=policy),
        model.continuous_batching_context_manager(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, device)
        ) as manager,
    ):
        cache = manager.batch_processor.cache
        state = cache._ekv
        least = state.blocks(state.auto.min_sectors)  # where the extension starts, or above
        report = ekt.last_report()
        assert report is not None and least <= cache.num_blocks < report.fit_blocks
        for burst in range(3):
            assert run(manager) == own, burst
            assert state.final_sectors > state.auto.min_sectors  # it grew for the burst
            assert cache.num_blocks <= report.fit_blocks
            deadline = time.monotonic() + 10
            while cache.num_blocks != least and time.monotonic() < deadline:
                time.sleep(0.02)
            assert cache.num_blocks == least, "the idle cache did not shrink back"
    messages = [r.getMessage() for r in caplog.records if r.name == "extensible_kv"]
    # Every burst after an idle shrink grew; the first may fit in what the warm-up committed
    # (on CUDA the graphs' warm-up commits what its requests touch).
    grew = [m for m in messages if m.startswith("Grew KV cache on demand")]
    assert len(grew) >= 2
    for message in grew:  # each grow at least doubles, up to what fits
        before, after = map(int, re.findall(r"from (\d+) to (\d+) blocks", message)[0])
        assert after >= min(2 * before, report.fit_blocks), message
    assert sum(m.startswith("Shrank idle KV cache") for m in messages) >= 3


@pytest.mark.timeout(120)
def test_a_driver_rate_reaches_the_cache_and_the_tokens_stay_the_same(tf: Any) -> None:
    """`enable(driver_rate=...)` paces what the cache gives back (its tensor's
    `driver_rate`); the policy's idle shrink still happens and the tokens are the cache's
    own. A rate that is no positive int is refused at `enable`."""
    from extensible_kv import transformers as ekt

    for wrong, error in ((0, ValueError), (-1, ValueError), (1.5, TypeError)):
        with pytest.raises(error, match="driver_rate"):
            ekt.enable(driver_rate=wrong)  # type: ignore[arg-type]
    assert not ekt.is_enabled()
    model, own, options = resizable(tf, "llama")
    rate = 64 << 20
    policy = ekt.AutoResize(min_blocks=2, idle_s=0.2)
    with (
        ekt.enabled(**options, auto_resize=policy, driver_rate=rate),
        model.continuous_batching_context_manager(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
        ) as manager,
    ):
        state = manager.batch_processor.cache._ekv
        assert state.tensor.driver_rate == rate
        assert run(manager) == own
        least = state.blocks(state.auto.min_sectors)
        deadline = time.monotonic() + 10
        while manager.batch_processor.cache.num_blocks != least and time.monotonic() < deadline:
            time.sleep(0.02)
        assert manager.batch_processor.cache.num_blocks == least


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", [True, False], ids=["auto_resize", "fixed"])
def test_the_schedulers_margin_check_grows_the_cache_under_the_policy(
    tf: Any, policy: bool
) -> None:
    """transformers' FIFO scheduler admits no new request while others decode once under 15%
    of the cache is free, so it never asks `can_store_request_tokens` for one: under the
    policy its margin check (`compute_free_capacity`) grows the cache first, to at least
    `GROW_BELOW_FREE` free; a fixed cache stays as it is."""
    from extensible_kv import transformers as ekt
    from extensible_kv.transformers import cache as ekt_cache

    model, _, options = resizable(tf, "llama")
    auto = {"auto_resize": ekt.AutoResize(min_blocks=2, idle_s=600)} if policy else {}
    with (
        ekt.enabled(**options, **auto),
        model.continuous_batching_context_manager(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
        ) as manager,
    ):
        cache = manager.batch_processor.cache
        free, before = cache.pool.free_sectors, cache.num_sectors
        held = [free.pop() for _ in range(len(free))]  # all held, as by decoding requests
        try:
            ratio = cache.compute_free_capacity()
            if policy:
                assert cache.num_sectors >= 2 * before  # the policy's grow doubles
                assert ratio >= ekt_cache.GROW_BELOW_FREE
                assert len(free) == cache.num_sectors - before
            else:
                assert (cache.num_sectors, ratio, len(free)) == (before, 0.0, 0)
        finally:
            free.extend(held)
        assert sorted(free) == list(range(2, 2 + cache.num_sectors))  # every sector free once


def test_auto_resize_options_are_checked(tf: Any) -> None:
    from extensible_kv import transformers as ekt

    with pytest.raises(TypeError, match="auto_resize"):
        ekt.enable(auto_resize="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_blocks 1 is below min_blocks 2"):
        ekt.AutoResize(min_blocks=2, max_blocks=1)
    with pytest.raises(ValueError, match="idle_s"):
        ekt.AutoResize(idle_s=-1)
    with pytest.raises(TypeError, match="idle_s"):
        ekt.AutoResize(idle_s="60")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="idle_s must be a number of seconds"):
        ekt.AutoResize(idle_s=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step_blocks"):
        ekt.AutoResize(step_blocks=1.5)  # type: ignore[arg-type]
    ekt.enable(budget_bytes=1 << 20, auto_resize=True)
    options = ekt.patch.current_options()
    assert options is not None and options.auto_resize == ekt.AutoResize()
