"""transformers' continuous batching on extensible-kv (`extensible_kv.transformers`): the
tokens, the extension after the warm-up, budgets, the options, and `enable` / `disable` (the
suspension: `test_transformers_suspend.py`; resizes and the automatic policy:
`test_transformers_resize.py`; a node pool: `test_pool_transformers.py`).

transformers' own model code runs: Llama-, Qwen3- and sliding-window-shaped (Qwen2 with
`sliding_attention` layers, transformers' `SlidingAttentionCacheAllocator`) models built from
configs with seeded random weights (`support.transformers_models`), `sdpa` and `eager`
(continuous batching runs them as its paged forms). Greedy `generate_batch` gives the same
tokens with the extensible cache as with transformers' own; `disable()` leaves transformers as
it was; an unsupported version is refused. On CPU the warm-up runs no forward pass (no
graphs): the `padded` runs force transformers' padded warm-up, the CPU stand-in for CUDA
graphs, so the lowest-first commit during warm-up is exercised too. The `cuda` params run the
same bodies with `use_cuda_graph=True`.

Skipped, with the reason, where transformers >=5.18,<5.26 is absent; CI sets
EKV_REQUIRE_TRANSFORMERS=1, which turns the skip into a failure.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from extensible_kv import UnsupportedError
from support import transformers_fixtures, transformers_models
from support.transformers_models import (
    ATTENTIONS,
    KINDS,
    MAX_NEW_TOKENS,
    NUM_BLOCKS,
    PAGE,
    PROMPT_LENGTHS,
    build_model,
    cb_config,
    enable_options,
    gen_config,
    generate,
    generate_with,
    has_mla_layout,
    mla_config,
    num_blocks,
    prompts,
    run,
    warmup_reads_whole_cache,
)
from support.transformers_models import (
    state as state_of,
)

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.transformers

# The fixtures every transformers test module shares (`support.transformers_fixtures`).
disabled_after = transformers_fixtures.disabled_after
padded = transformers_fixtures.padded
tf = transformers_fixtures.tf

# tests/test_sector_borrow.py builds its models through this module's names too.
COMMON = transformers_models.COMMON
warmed_up = transformers_models.warmed_up


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
            assert allocator.bytes_per_block == 2 * PAGE * 40 * 4 == state_of(cache).bytes_per_block
            assert (
                allocator.cache_tensor.data_ptr() == state_of(cache).tensor.full_view().data_ptr()
            )
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
    tests = sorted(p.name for p in (root / "tests").glob("test_*transformers*.py"))
    assert len(tests) >= 4, tests
    for test in (*tests, "test_demo.py"):
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
            ekt.suspend(manager, keep_blocks=np.int32(3))
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
