"""The engine core's step boundaries and the automatic resize policy on them
(`extensible_kv.vllm.engine`, issue 53): on vLLM's own `KVCacheManager` with the plugin's
`ResizableBlockPool`, host workers of vLLM's `ExtensibleKVCache` behind a `collective_rpc`,
and an engine core's attributes the hook uses (vLLM's `EngineCore` needs a model to build).

The policy grows the cache when the scheduler's waiting requests do not fit (by what they
need, at least a step and doubling, up to its most), and when running requests have fewer
free blocks than they are; it shrinks to its least after idle, keeping the blocks below. A
shrink's end waits for an empty batch queue, which the hook drains for it; an idle engine is
woken for its shrink through vLLM's idle-state callbacks and `WAKEUP` sentinel.
"""

from __future__ import annotations

import collections
import queue
import time
from types import SimpleNamespace
from typing import Any

import pytest
from support.vllm_workers import BLOCK, Core, Workers, vllm_request
from support.vllm_workers import scheduler as make_scheduler

pytestmark = pytest.mark.vllm


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def vllm_cases(vllm_plugin: Any) -> Any:
    from extensible_kv.vllm import plugin
    from support import vllm_cases

    assert plugin.register()
    return vllm_cases


def _engine(vllm_cases: Any, blocks: int = 8, **settings: Any) -> SimpleNamespace:
    from extensible_kv.vllm.engine import AutoPolicy, AutoSettings
    from extensible_kv.vllm.resize import KvResizer

    scheduler = make_scheduler(blocks)
    workers = Workers(vllm_cases, 2, capacity=64, committed=blocks)
    resizer = KvResizer(scheduler, workers.rpc)
    clock = Clock()
    policy = AutoPolicy(resizer, scheduler, AutoSettings(**settings), clock=clock)
    return SimpleNamespace(
        scheduler=scheduler, workers=workers, resizer=resizer, policy=policy, clock=clock
    )


def test_the_settings_come_from_the_environment_variable_or_say_what_is_wrong() -> None:
    from extensible_kv.vllm.engine import AutoSettings

    for off in ("", "0", "off", " false "):
        assert AutoSettings.parse(off) is None
    assert AutoSettings.parse("1") == AutoSettings()
    assert AutoSettings.parse("min_blocks=64, idle_s=2.5") == AutoSettings(64, idle_s=2.5)
    for bad, match in (
        ("min_blocks=x", "min_blocks is not a number"),
        ("size=3", "key=value pairs of min_blocks"),
        ("min_blocks", "key=value pairs"),
        ("min_blocks=1", "at least 2"),
        ("min_blocks=8,max_blocks=4", "below min_blocks"),
        ("idle_s=nan", "idle_s"),
        ("step_blocks=0", "step_blocks"),
    ):
        with pytest.raises(ValueError, match=match) as raised:
            AutoSettings.parse(bad)
        assert "EXTENSIBLE_KV_VLLM_AUTO" in str(raised.value)


def test_waiting_requests_that_do_not_fit_grow_the_cache_by_what_they_need(
    vllm_cases: Any,
) -> None:
    engine = _engine(vllm_cases, 8, min_blocks=4, max_blocks=48, step_blocks=4)
    policy, resizer, workers = engine.policy, engine.resizer, engine.workers
    assert (policy.min_blocks, policy.max_blocks) == (4, 48)
    workers.stamp(8)
    policy.before_step(in_flight=False)  # nothing waits: nothing changes
    assert resizer.num_blocks == 8
    # Three requests of 64 prompt tokens and 4 new: 5 blocks each, 15; 7 free.
    engine.scheduler.waiting = [vllm_request([1] * 64) for _ in range(3)]
    policy.before_step(in_flight=True)  # a grow needs no empty batch queue
    assert resizer.num_blocks == 16  # by 8: the need (15 - 7), doubling (8)
    assert workers.committed() == [16, 16] and workers.stamped(8)
    assert resizer.free_blocks == 15
    policy.before_step(in_flight=False)  # they fit now
    assert resizer.num_blocks == 16
    # A need past the most stops there.
    engine.scheduler.waiting = [vllm_request([1] * 640) for _ in range(3)]
    policy.before_step(in_flight=False)
    assert resizer.num_blocks == 48 and workers.committed() == [48, 48]
    policy.before_step(in_flight=False)
    assert resizer.num_blocks == 48


def test_running_requests_short_of_a_free_block_each_grow_it(vllm_cases: Any) -> None:
    engine = _engine(vllm_cases, 8, min_blocks=4, max_blocks=40, step_blocks=4)
    manager = engine.scheduler.kv_cache_manager
    running = []
    for _ in range(3):  # 2 blocks each: 6 of the 7
        request = vllm_request([2] * (2 * BLOCK))
        assert manager.allocate_slots(request, 2 * BLOCK) is not None
        running.append(request)
    engine.scheduler.running = running
    assert engine.resizer.free_blocks == 1
    engine.policy.before_step(in_flight=True)
    assert engine.resizer.num_blocks == 16  # at least a step, doubling


def test_an_idle_engine_shrinks_to_its_least_keeping_the_blocks_below(vllm_cases: Any) -> None:
    engine = _engine(vllm_cases, 32, min_blocks=6, idle_s=5.0)
    policy, resizer, workers, clock = engine.policy, engine.resizer, engine.workers, engine.clock
    workers.stamp(6)
    engine.scheduler.running = [object()]
    policy.before_step(in_flight=False)  # busy: the idle time starts when it ends
    engine.scheduler.running = []
    clock.now += 4.9
    assert policy.next_idle_call() == pytest.approx(0.1)
    policy.idle()
    assert resizer.num_blocks == 32
    clock.now += 0.2
    assert policy.next_idle_call() == 0.0
    policy.before_step(in_flight=True)  # a batch in flight: not now
    assert resizer.num_blocks == 32
    policy.idle()
    assert resizer.num_blocks == 6 and workers.committed() == [6, 6] and workers.stamped(6)
    assert policy.next_idle_call() is None  # at its least: nothing to do while idle


def test_asleep_the_policy_changes_nothing(vllm_cases: Any) -> None:
    """vLLM's sleep released the memory: no grow, no idle shrink until it wakes."""
    engine = _engine(vllm_cases, 8, min_blocks=4, max_blocks=48, step_blocks=4, idle_s=1.0)
    asleep = {"now": True}
    engine.resizer._is_sleeping = lambda: asleep["now"]
    engine.scheduler.waiting = [vllm_request([1] * 64) for _ in range(3)]
    engine.policy.before_step(in_flight=False)
    assert engine.resizer.num_blocks == 8
    asleep["now"] = False
    engine.policy.before_step(in_flight=False)
    assert engine.resizer.num_blocks == 16


def test_a_grow_the_device_refuses_leaves_the_size_and_is_logged_once(
    vllm_cases: Any, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _engine(vllm_cases, 8, min_blocks=4, max_blocks=40, step_blocks=4)
    engine.workers.fail_rank, engine.workers.fail_at = 1, 16
    engine.scheduler.waiting = [vllm_request([1] * 64) for _ in range(3)]
    for _ in range(3):
        engine.policy.before_step(in_flight=False)
    assert engine.resizer.num_blocks == 8 and engine.workers.committed() == [8, 8]
    warned = [r for r in caplog.records if "could not grow" in r.getMessage()]
    assert len(warned) == 1
    engine.workers.fail_rank = None
    engine.policy.before_step(in_flight=False)
    assert engine.resizer.num_blocks == 16


def test_the_hook_drains_the_batch_queue_for_a_shrinks_end(vllm_cases: Any) -> None:
    """Under async scheduling the queue is never empty while the engine is busy; a drained
    shrink's end needs it empty (a batch in flight may write a finished request's blocks), so
    the hook's next step schedules nothing and finishes the oldest batch, and the step after
    it ends the shrink."""
    from extensible_kv.vllm.engine import StepHook

    engine = _engine(vllm_cases, 16, min_blocks=4)
    manager = engine.scheduler.kv_cache_manager
    holder = vllm_request([3] * (15 * BLOCK))
    assert manager.allocate_slots(holder, 15 * BLOCK) is not None  # blocks 1..15
    engine.resizer.resize(8)  # begins: blocks past 8 are held
    assert engine.resizer.shrinking_to == 8 and not engine.policy.wants_drain()
    manager.free(holder)
    assert engine.policy.wants_drain()
    core = Core(scheduler=engine.scheduler, batch_queue=collections.deque(["in flight"]))
    hook = StepHook(core, engine.policy)
    seen = []

    def step(core: Any) -> str:
        seen.append(core.scheduler.has_requests())
        if core.batch_queue:
            core.batch_queue.pop()
        return "outputs"

    engine.scheduler.running = [object()]  # busy: it would schedule
    assert hook.step(step, core) == "outputs"
    assert seen == [False] and "has_requests" not in vars(engine.scheduler)
    assert engine.resizer.shrinking_to == 8  # not yet: the step finished the batch
    assert hook.step(step, core) == "outputs"
    assert seen == [False, True]
    assert engine.resizer.shrinking_to is None and engine.resizer.num_blocks == 8
    assert engine.workers.committed() == [8, 8]


def test_an_idle_engine_core_is_woken_for_its_shrink(vllm_cases: Any) -> None:
    """The core waits on its input queue while idle: the hook's pacer appends a callback to
    the core's idle-state callbacks (which vLLM's loop runs while it has no work) and puts
    vLLM's WAKEUP sentinel on the queue; the callback shrinks. The pacer ends with the core."""
    from extensible_kv.vllm.engine import StepHook
    from vllm.v1.engine import EngineCoreRequestType

    engine = _engine(vllm_cases, 16, min_blocks=4, idle_s=0.05)
    engine.policy.clock = time.monotonic
    engine.policy.last_active = time.monotonic()
    running = {"now": True}
    core = Core(
        scheduler=engine.scheduler,
        batch_queue=None,
        input_queue=queue.Queue(),
        _idle_state_callbacks=[],
        is_running=lambda: running["now"],
    )
    hook = StepHook(core, engine.policy)
    started = time.monotonic()
    assert core.input_queue.get(timeout=5) == (EngineCoreRequestType.WAKEUP, None)
    assert time.monotonic() - started >= 0.04
    (callback,) = core._idle_state_callbacks
    core._idle_state_callbacks.clear()
    assert engine.resizer.num_blocks == 16
    callback(core)  # vLLM's loop: _notify_idle_state_callbacks
    assert engine.resizer.num_blocks == 4 and engine.workers.committed() == [4, 4]
    running["now"] = False
    assert hook._pacer is not None
    hook._wanted.set()
    hook._pacer.join(timeout=5)
    assert not hook._pacer.is_alive()


def test_the_plugin_puts_the_step_hook_in_place_only_when_asked(
    vllm_plugin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from extensible_kv.vllm import plugin
    from vllm.v1.engine.core import EngineCore

    names = ("step", "step_with_batch_queue", "shutdown", "sleep")
    vllms = {name: vars(EngineCore)[name] for name in names}
    plugin.unregister()
    try:
        monkeypatch.delenv(plugin.AUTO_ENV_VAR, raising=False)
        assert plugin.register()
        assert {n: vars(EngineCore)[n] for n in vllms} == vllms
        plugin.unregister()
        monkeypatch.setenv(plugin.AUTO_ENV_VAR, "min_blocks=8")
        assert plugin.register()
        for name, original in vllms.items():
            assert vars(EngineCore)[name].__wrapped__ is original
        plugin.unregister()
        assert {n: vars(EngineCore)[n] for n in vllms} == vllms
        # In a pool: the pool's policy, and the cache exports its handles as fds.
        from vllm.v1.worker import extensible_kv_cache as vkv

        vllms_export = vkv.kv_cache_export_handle_types
        config = SimpleNamespace(kv_transfer_config=None)
        assert vllms_export(config) == 0
        monkeypatch.setenv(plugin.POOL_ENV_VAR, "node")
        assert plugin.register()
        assert vkv.kv_cache_export_handle_types(config) == 1
        assert vars(EngineCore)["step"].__wrapped__ is vllms["step"]
        plugin.unregister()
        assert vkv.kv_cache_export_handle_types is vllms_export
        monkeypatch.delenv(plugin.POOL_ENV_VAR)
        monkeypatch.setenv(plugin.AUTO_ENV_VAR, "min_blocks=one")
        with pytest.raises(ValueError, match="EXTENSIBLE_KV_VLLM_AUTO='min_blocks=one'"):
            plugin.register()
        plugin.unregister()
    finally:
        monkeypatch.delenv(plugin.AUTO_ENV_VAR, raising=False)
        monkeypatch.delenv(plugin.POOL_ENV_VAR, raising=False)
        assert plugin.register()
