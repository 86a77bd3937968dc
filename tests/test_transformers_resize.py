"""Resizing a live transformers cache while requests run (`extensible_kv.transformers.resize`)
and the automatic policy (`enable(auto_resize=AutoResize(...))`): the tokens stay those of
transformers' own cache, the pool and the committed bytes follow, a shrink waits for live
blocks or moves them down, resizes and the policy take turns under one lock.

Tiny seeded models (`support.transformers_models`) on the host backend, and on CUDA where
there is one. Skipped, with the reason, where transformers >=5.18,<5.26 is absent; CI sets
EKV_REQUIRE_TRANSFORMERS=1, which turns the skip into a failure.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import pytest
from support import transformers_fixtures
from support.transformers_models import (
    KINDS,
    MAX_NEW_TOKENS,
    NUM_BLOCKS,
    Call,
    add_on_top_sectors,
    build_model,
    collect,
    generate,
    prompts,
    requests_holding_blocks,
    resizable,
    run,
    serving,
    state_blocks,
)
from support.transformers_models import (
    state as state_of,
)

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.transformers

# The fixtures every transformers test module shares (`support.transformers_fixtures`).
disabled_after = transformers_fixtures.disabled_after
tf = transformers_fixtures.tf


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", KINDS)
def test_resize_a_live_manager_keeps_the_tokens(tf: Any, kind: str) -> None:
    """Grow and shrink while the prompts are in flight: the same tokens as transformers' own
    cache; the pool, the committed bytes and the reports follow."""
    from extensible_kv import transformers as ekt

    model, own, options = resizable(tf, kind)
    with serving(tf, model, "cpu", **options) as manager:
        cache = manager.batch_processor.cache
        state = state_of(cache)
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
    with serving(tf, model, "cpu", **options) as manager:
        cache = manager.batch_processor.cache
        state = state_of(cache)
        ekt.resize(manager, NUM_BLOCKS)
        # Two long requests: admitted, they hold blocks for a few hundred steps.
        long_ids = manager.add_requests(prompts()[:2], max_new_tokens=400)
        deadline = time.monotonic() + 30
        while not requests_holding_blocks(cache) and time.monotonic() < deadline:
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
    with serving(tf, model, "cpu", **options) as manager:
        cache = manager.batch_processor.cache
        ekt.resize(manager, NUM_BLOCKS)
        reference = collect(manager, manager.add_requests(long, max_new_tokens=200))
        ids, low = add_on_top_sectors(manager, long, 200)
        cut = min(low) + len(low) - 2  # every sector the requests hold is at or past it
        report = ekt.resize(manager, state_blocks(cache, cut), move=True, timeout=0)
        assert report.blocks_after == cache.num_blocks < report.blocks_before
        assert collect(manager, ids) == reference
    assert any(r.getMessage().startswith("Moved ") for r in caplog.records)


@pytest.mark.timeout(120)
def test_a_resize_that_waited_for_another_reads_the_size_it_left(tf: Any) -> None:
    """A resize waits for one in flight (the policy's, another thread's): it must size from
    what that one left, not from what it read before waiting. Here the cache grows to 24
    sectors while a resize to 12 waits: the resize shrinks to 12, and transformers' pool holds
    exactly the 12 committed sectors."""
    from extensible_kv import transformers as ekt
    from extensible_kv.transformers.resizing import grow_live

    model, own, options = resizable(tf, "llama")
    with serving(tf, model, "cpu", **options) as manager:
        cache = manager.batch_processor.cache
        state = state_of(cache)
        ekt.resize(manager, 8)
        with state.resizing:  # a resize in flight
            waiting = Call(lambda: ekt.resize(manager, state_blocks(cache, 12), timeout=30))
            time.sleep(0.2)
            assert waiting.is_alive()  # blocked on the lock
            with manager.pause():
                grow_live(cache, state, 24)
        waiting.join(timeout=60)
        assert not waiting.is_alive() and not waiting.errors, waiting.errors
        assert state.final_sectors == state.committed_sectors == cache.num_sectors == 12
        assert state.tensor.bytes_per_segment == (2 + 12) * state.bytes_per_sector
        assert sorted(cache.pool.free_sectors) == list(range(2, 2 + 12))
        assert run(manager) == own


def test_resize_refuses_bad_sizes_before_anything_changes(tf: Any) -> None:
    from extensible_kv import transformers as ekt

    model, _, options = resizable(tf, "llama")
    with serving(tf, model, "cpu", **options) as manager:
        cache = manager.batch_processor.cache
        before = (cache.num_blocks, state_of(cache).tensor.physical_bytes)
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
        ekt.suspend(manager)
        with pytest.raises(RuntimeError, match=r"suspended: resume\(manager\)"):
            ekt.resize(manager, 4)
        ekt.resume(manager)
        assert (cache.num_blocks, state_of(cache).tensor.physical_bytes) == before


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
    with serving(tf, model, device, **options, auto_resize=policy) as manager:
        cache = manager.batch_processor.cache
        state = state_of(cache)
        least = state.blocks(state.sizer.min_sectors)  # where the extension starts, or above
        report = ekt.last_report()
        assert report is not None and least <= cache.num_blocks < report.fit_blocks
        for burst in range(3):
            assert run(manager) == own, burst
            assert state.final_sectors > state.sizer.min_sectors  # it grew for the burst
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
    with serving(tf, model, "cpu", **options, auto_resize=policy, driver_rate=rate) as manager:
        state = state_of(manager)
        assert state.tensor.driver_rate == rate
        assert run(manager) == own
        least = state.blocks(state.sizer.min_sectors)
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
    from extensible_kv.transformers.state import GROW_BELOW_FREE

    model, _, options = resizable(tf, "llama")
    auto = {"auto_resize": ekt.AutoResize(min_blocks=2, idle_s=600)} if policy else {}
    with serving(tf, model, "cpu", **options, **auto) as manager:
        cache = manager.batch_processor.cache
        free, before = cache.pool.free_sectors, cache.num_sectors
        held = [free.pop() for _ in range(len(free))]  # all held, as by decoding requests
        try:
            ratio = cache.compute_free_capacity()
            if policy:
                assert cache.num_sectors >= 2 * before  # the policy's grow doubles
                assert ratio >= GROW_BELOW_FREE
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
