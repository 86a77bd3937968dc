"""Suspending a live transformers cache (`extensible_kv.transformers.suspend` / `resume`): the
memory goes and comes back at the same addresses, the tokens stay the same, any thread may
suspend or resume, the manager can be stopped and restarted while suspended, each mistake
gets its own message, and `release`, the old name, still works and warns.

Tiny seeded models (`support.transformers_models`) on the host backend, and on CUDA where
there is one. Skipped, with the reason, where transformers >=5.18,<5.26 is absent; CI sets
EKV_REQUIRE_TRANSFORMERS=1, which turns the skip into a failure.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import transformers_fixtures
from support.transformers_models import (
    ATTENTIONS,
    KINDS,
    Call,
    build_model,
    cb_config,
    enable_options,
    gen_config,
    generate,
    in_thread,
    resizable,
    restarts_wrong,
    run,
    serving,
    state_blocks,
    stop_within,
    warmed_up,
    xfail_where_restarts_are_wrong,
)
from support.transformers_models import (
    state as state_of,
)

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.transformers

# The fixtures every transformers test module shares (`support.transformers_fixtures`).
disabled_after = transformers_fixtures.disabled_after
tf = transformers_fixtures.tf


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_suspend_resume_same_tokens(tf: Any, kind: str, attention: str, device: str) -> None:
    """suspend / resume on the manager `continuous_batching_context_manager` yields, running:
    the memory goes and comes back at the same addresses, the tokens stay the same."""
    from extensible_kv import transformers as ekt

    model = build_model(tf, kind, attention, device)
    own = generate(tf, model, device)
    with serving(tf, model, device, **enable_options(device)) as manager:
        assert run(manager) == own
        cache = manager.batch_processor.cache
        state = state_of(cache)
        address, full_bytes, num_blocks = (
            cache.cache_tensor.data_ptr(),
            state.tensor.physical_bytes,
            cache.num_blocks,
        )
        ekt.suspend(manager)
        assert state.tensor.physical_bytes < full_bytes
        assert cache.pool.num_free_sectors == 0
        ekt.resume(manager)
        assert cache.cache_tensor.data_ptr() == address
        assert (state.tensor.physical_bytes, cache.num_blocks) == (full_bytes, num_blocks)
        assert run(manager) == own
        ekt.suspend(manager, keep_blocks=3)
        assert (
            cache.pool.num_free_sectors * cache.bytes_per_sector
            >= 3 * state_of(cache).bytes_per_block
        )
        ekt.resume(manager)
        assert run(manager) == own


@pytest.mark.timeout(120)
def test_stopping_a_suspended_manager_ends_the_pause(tf: Any) -> None:
    """Leaving `continuous_batching_context_manager` while the cache is suspended stops the
    manager (transformers refuses to stop inside a pause: the suspension's pause ends first),
    even after `disable()`; the cache stays suspended, and a kept manager resumes and serves
    again.
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
            ekt.suspend(manager)
            in_thread(lambda: ekt.resume(manager))  # another thread than suspend's
            assert run(manager) == own
            ekt.suspend(manager)
            # The guard is the manager's own, not transformers' class's: it outlives disable().
            assert "stop" in vars(manager)
            ekt.disable()
        assert not manager.is_running()
        state = state_of(manager)
        assert state.suspended and state.suspension.pause is None
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
def test_a_suspend_from_an_ended_thread_never_strands_the_manager(tf: Any) -> None:
    """`suspend` in a thread that then ends (a `threading.Thread`, an executor's worker): the
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
            in_thread(lambda: ekt.suspend(manager))
            ekt.resume(manager)
            assert run(manager) == own
            in_thread(lambda: ekt.suspend(manager))
            stop_within(manager, keep_for_next_session=True)
            in_thread(lambda: ekt.resume(manager))
            manager.start()
            xfail_where_restarts_are_wrong(tf)
            assert run(manager) == own
        finally:
            stop_within(manager)
            manager.destroy()


def test_a_suspended_interpreter_exits(tf: Any, tmp_path: Any) -> None:
    """A process whose manager was suspended from a worker thread and stopped from the main
    thread (leaving `continuous_batching_context_manager`) exits: nothing is left parked."""
    import subprocess
    import textwrap

    script = tmp_path / "suspended.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, threading
            sys.path[:0] = {[str(Path(__file__).parent)]!r}
            import transformers as tf
            from support import transformers_models as t
            from extensible_kv import transformers as ekt

            model = t.build_model(tf, "llama", "sdpa", "cpu")
            with ekt.enabled(**t.enable_options("cpu")):
                with model.continuous_batching_context_manager(
                    generation_config=t.gen_config(tf),
                    continuous_batching_config=t.cb_config(tf, "cpu"),
                ) as manager:
                    t.run(manager)
                    worker = threading.Thread(target=ekt.suspend, args=(manager,))
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
def test_stop_without_keep_while_suspended_drops_the_cache(tf: Any) -> None:
    """transformers' default `stop` drops the batch processor, and with it the suspended cache:
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
            ekt.suspend(manager)
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


def test_a_suspended_manager_that_was_not_running_refuses_to_start(tf: Any) -> None:
    """Suspended after its warm-up but before `start` (no pause to hold): its pool is empty, so
    starting it would serve from a cache of no block; `start` refuses until `resume`."""
    from extensible_kv import transformers as ekt

    model = build_model(tf, "llama", "sdpa", "cpu")
    own = generate(tf, model, "cpu")
    with ekt.enabled(**enable_options("cpu")):
        manager = warmed_up(tf, model)
        ekt.suspend(manager)
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
            ekt.suspend(wrong)
        with pytest.raises(TypeError, match="ContinuousBatchingManager"):
            ekt.resume(wrong)
    model = build_model(tf, "llama", "sdpa", "cpu")
    with ekt.enabled(**enable_options("cpu")):
        manager = model.init_continuous_batching(
            generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
        )
        with pytest.raises(RuntimeError, match="no KV cache yet: warm it up"):
            ekt.suspend(manager)
        # Just after start(), before the loop's thread has built its batch processor.
        monkeypatch.setattr(manager, "is_running", lambda: True)
        with pytest.raises(RuntimeError, match="loop's own thread after start"):
            ekt.suspend(manager)


def test_suspend_refuses_what_it_cannot_do(tf: Any) -> None:
    from extensible_kv import transformers as ekt

    model = build_model(tf, "llama", "sdpa", "cpu")
    own_tokens = generate(tf, model, "cpu")
    with model.continuous_batching_context_manager(
        generation_config=gen_config(tf), continuous_batching_config=cb_config(tf, "cpu")
    ) as own:
        with pytest.raises(ValueError, match="not extensible"):
            ekt.suspend(own)
    with serving(tf, model, "cpu", **enable_options("cpu")) as manager:
        with pytest.raises(RuntimeError, match="not suspended"):
            ekt.resume(manager)
        with pytest.raises(ValueError, match="keep_blocks"):
            ekt.suspend(manager, keep_blocks=-1)
        with pytest.raises(TypeError, match="keep_blocks"):
            ekt.suspend(manager, keep_blocks=1.5)  # type: ignore[arg-type]
        ekt.suspend(manager)
        with pytest.raises(RuntimeError, match="already suspended"):
            ekt.suspend(manager)
        ekt.resume(manager)
        assert run(manager) == own_tokens


def test_release_is_the_deprecated_name_of_suspend(tf: Any) -> None:
    """`release(manager, keep_blocks)`, the name before `suspend` ("release" is the driver's
    word: memory given back for good), warns (`DeprecationWarning`, naming `suspend`) and
    suspends: the same memory given back, the same refusals, the same `resume`."""
    from extensible_kv import transformers as ekt

    model = build_model(tf, "llama", "sdpa", "cpu")
    own = generate(tf, model, "cpu")
    with serving(tf, model, "cpu", **enable_options("cpu")) as manager:
        assert run(manager) == own
        state = state_of(manager)
        full = state.tensor.physical_bytes
        ekt.suspend(manager, keep_blocks=3)
        suspended = (state.tensor.physical_bytes, state.committed_sectors)
        ekt.resume(manager)
        assert state.tensor.physical_bytes == full
        with pytest.warns(DeprecationWarning, match=r"release\(manager\) is deprecated: call "):
            ekt.release(manager, keep_blocks=3)
        assert state.suspended
        assert (state.tensor.physical_bytes, state.committed_sectors) == suspended
        with (
            pytest.warns(DeprecationWarning),
            pytest.raises(RuntimeError, match="already suspended"),
        ):
            ekt.release(manager)
        with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="keep_blocks"):
            ekt.release(manager, keep_blocks=1.5)  # type: ignore[arg-type]
        ekt.resume(manager)
        assert state.tensor.physical_bytes == full and run(manager) == own
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="ContinuousBatching"):
        ekt.release("manager")


def test_suspend_and_resume_read_the_size_under_the_lock(tf: Any) -> None:
    """`suspend(keep_blocks=...)` waiting for a resize keeps at most what that resize left,
    and a second `resume` that waited for the first says there is nothing to resume."""
    from extensible_kv import transformers as ekt

    model, own, options = resizable(tf, "llama")
    with serving(tf, model, "cpu", **options) as manager:
        cache = manager.batch_processor.cache
        state = state_of(cache)
        ekt.resize(manager, state_blocks(cache, 16))
        with state.resizing:
            waiting = Call(lambda: ekt.suspend(manager, keep_blocks=state_blocks(cache, 16)))
            time.sleep(0.2)
            assert waiting.is_alive()
            with manager.pause():
                assert ekc_take_out_and_unmap(cache, state, 4)
        waiting.join(timeout=60)
        assert not waiting.errors, waiting.errors
        assert state.suspended and state.committed_sectors == cache.num_sectors == 4
        assert state.tensor.bytes_per_segment == (2 + 4) * state.bytes_per_sector
        with state.resizing:
            first = Call(lambda: ekt.resume(manager))
            second = Call(lambda: ekt.resume(manager))
            time.sleep(0.2)
        first.join(timeout=60)
        second.join(timeout=60)
        errors = first.errors + second.errors
        assert len(errors) == 1 and "nothing to resume" in str(errors[0]), errors
        assert not state.suspended and cache.num_sectors == state.final_sectors == 4
        assert run(manager) == own


def ekc_take_out_and_unmap(cache: Any, state: Any, target: int) -> bool:
    """A shrink's two steps, as `resize` takes them under the lock."""
    from extensible_kv.transformers import sectors

    if not sectors.take_out_of_pool(cache, state, target):
        return False
    sectors.unmap_past(cache, state, target)
    return True
