"""A vLLM engine core in the node pool (`extensible_kv.vllm.pooled`, `EXTENSIBLE_KV_POOL`,
issue 53): its KV cache as a pool member drives it (`EngineCache`), on vLLM's own
`KVCacheManager` with the plugin's `ResizableBlockPool` and a host worker of vLLM's
`ExtensibleKVCache`, beside an engine of another model (our `ExtensibleKVCache`, another
block size) in one pool.

Every change keeps the scheduler's pool, the worker's count and the ledger in line: the
engine lends its free top blocks (the scheduler's pool ends where the loan begins), refuses
what requests hold, borrows (its pool grows by the blocks the loan holds in its layout),
gives back once idle, and asks for its waiting requests' need when the scheduler cannot
admit them; the blocks below every cut keep their bytes.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support.vllm_workers import BLOCK, Core, Workers, vllm_request
from support.vllm_workers import scheduler as make_scheduler

pytestmark = pytest.mark.vllm

POSIX_FD = 1
GRANULE = 2 << 20  # vLLM's granule on the host (the drop-in's): 256 of its 8 KiB blocks
STEP = 256  # the engine's blocks a handle


def our_cache(capacity: int) -> Any:
    """An engine of another model: our `ExtensibleKVCache`, 16 KiB a block (v's are 8 KiB a
    segment, 3 segments), on the same granularity."""
    import torch
    from extensible_kv import AttentionLayerSpec, ExtensibleKVCache, KVCacheTensorSpec

    spec = KVCacheTensorSpec(
        4 * 4096, {"attn": AttentionLayerSpec("FLASH_ATTN", 32, 4, 32, torch.bfloat16)}
    )
    return ExtensibleKVCache(
        (spec,), capacity, "cpu", granularity=GRANULE, export_handle_types="posix_fd"
    )


@pytest.fixture
def vllm_cases(vllm_plugin: Any) -> Any:
    from extensible_kv.vllm import plugin
    from support import vllm_cases

    assert plugin.register()
    return vllm_cases


def _engine(vllm_cases: Any, pool: Any, blocks: int, **settings: Any) -> SimpleNamespace:
    """A vLLM engine core of `blocks` blocks (committed in steps of `STEP`: each step a handle
    per segment, so that it may lend its top ones), joined to `pool` as `v`."""
    from extensible_kv.vllm.pooled import PooledPolicy, PoolSettings
    from extensible_kv.vllm.resize import KvResizer

    scheduler = make_scheduler(8)
    workers = Workers(vllm_cases, 1, capacity=1024, committed=8, export_handle_types=POSIX_FD)
    resizer = KvResizer(scheduler, workers.rpc)
    for size in range(STEP, blocks + 1, STEP):
        resizer.resize(size)
    core = Core(
        scheduler=scheduler,
        model_executor=SimpleNamespace(
            driver_worker=workers.workers[0], collective_rpc=workers.rpc
        ),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(world_size=1)),
    )
    policy = PooledPolicy(core, resizer, PoolSettings(pool, **settings), engine="v")
    return SimpleNamespace(
        scheduler=scheduler, workers=workers, resizer=resizer, policy=policy, core=core
    )


def _consistent(engine: SimpleNamespace) -> None:
    pool = engine.resizer.pool
    kv = engine.workers.kv(0)
    assert pool.num_gpu_blocks == kv.num_committed_blocks == engine.policy.cache.committed_blocks
    assert engine.scheduler.cache_config.num_gpu_blocks == pool.num_gpu_blocks
    assert len(pool.blocks) == pool.num_gpu_blocks


def test_a_vllm_engine_lends_to_an_engine_of_another_model_and_gets_it_back(
    vllm_cases: Any, tmp_path: Path
) -> None:
    from extensible_kv.pool import Pool, PoolMember, rules

    pool = Pool("test", directory=tmp_path)
    engine = _engine(vllm_cases, pool, 3 * STEP, min_blocks=8)
    v, member = engine.policy, engine.policy.member
    pool.set_cap("cpu", v.cache.physical_bytes)  # v's blocks take it all
    engine.workers.stamp(8)
    with our_cache(1024) as ce:
        e = PoolMember(pool, "e", ce, max_blocks=1024, free_tail_blocks=lambda: ce.committed_blocks)
        e.join()
        assert [d.action for d in e.request(200)] == ["ask"]
        v.before_step(in_flight=True)  # serves: lends its free top blocks, whole handles
        assert engine.resizer.num_blocks in (STEP, 2 * STEP)
        _consistent(engine)
        e.serve()  # borrows
        assert ce.committed_blocks >= 200
        assert rules.check(pool.snapshot()) == []
        assert engine.workers.stamped(8)  # the blocks below the cut kept their bytes
        # A burst at v: its waiting requests do not fit; it asks, recalling its loan.
        engine.scheduler.waiting = [vllm_request([5] * (40 * BLOCK), max_tokens=BLOCK)] * 20
        v.before_step(in_flight=False)
        assert member.asking
        e.serve()  # gives the loan back (e is idle: every block free)
        v.before_step(in_flight=False)  # reclaims
        assert engine.resizer.num_blocks == 3 * STEP
        _consistent(engine)
        assert engine.workers.stamped(8)
        engine.scheduler.waiting = []
        e.leave()
        v.leave()
    assert pool.snapshot().engines == {}


def test_a_vllm_engine_borrows_for_its_queue_and_gives_it_back_once_idle(
    vllm_cases: Any, tmp_path: Path
) -> None:
    from extensible_kv.pool import Pool, PoolMember, rules

    pool = Pool("test", directory=tmp_path)
    engine = _engine(vllm_cases, pool, STEP, min_blocks=8)
    v, member = engine.policy, engine.policy.member
    member.give_back_idle_s = 0.05
    pool.set_cap("cpu", v.cache.physical_bytes + 4 * GRANULE)
    with our_cache(512) as ce:
        e = PoolMember(
            pool,
            "e",
            ce,
            max_blocks=512,
            commit_step_blocks=GRANULE // (4 * 4096),  # a handle a granule
            free_tail_blocks=lambda: ce.committed_blocks,
        )
        e.join()
        assert e.grow(512) == 4 * GRANULE // (4 * 4096)  # the rest of the cap: v must borrow
        # Waiting requests past its free blocks: one ask for the queue, asked of e.
        engine.scheduler.waiting = [vllm_request([7] * (40 * BLOCK), max_tokens=BLOCK)] * 10
        v.before_step(in_flight=True)
        asks = [x for x in pool.snapshot().loans.values() if x.borrower == "v"]
        assert [x.state for x in asks] == ["asked"]
        assert member.asking
        e.serve()  # lends
        v.before_step(in_flight=True)  # borrows: the scheduler's pool grows with the cache
        assert engine.resizer.num_blocks == 2 * STEP  # 3 of e's 4 handles: a granule a segment
        _consistent(engine)
        assert rules.check(pool.snapshot()) == []
        # Its requests ran; idle past give_back_idle_s, the loan goes back.
        engine.scheduler.waiting = []
        v.before_step(in_flight=False)
        time.sleep(0.06)
        v.before_step(in_flight=False)
        assert engine.resizer.num_blocks == STEP
        _consistent(engine)
        e.serve()  # takes it back
        assert pool.snapshot().loans == {}
        e.leave()
        v.leave()


def test_blocks_requests_hold_are_never_lent(vllm_cases: Any, tmp_path: Path) -> None:
    from extensible_kv.pool import Pool, PoolMember

    pool = Pool("test", directory=tmp_path)
    engine = _engine(vllm_cases, pool, 2 * STEP, min_blocks=8)
    manager = engine.scheduler.kv_cache_manager
    holder = vllm_request([3] * ((2 * STEP - 1) * BLOCK))
    assert manager.allocate_slots(holder, (2 * STEP - 1) * BLOCK) is not None  # every block
    pool.set_cap("cpu", engine.policy.cache.physical_bytes)
    with our_cache(512) as ce:
        e = PoolMember(pool, "e", ce, max_blocks=512, free_tail_blocks=lambda: 0)
        e.join()
        engine.policy.before_step(in_flight=False)  # posts: nothing free at its top
        assert [d.action for d in e.request(100)] == ["wait"]
        assert engine.resizer.num_blocks == 2 * STEP
        with pytest.raises(ValueError, match="requests hold blocks past it"):
            engine.policy.cache.lend(STEP)
        _consistent(engine)
        manager.free(holder)
        e.leave()
        engine.policy.leave()


def test_an_engine_in_the_pool_refuses_to_sleep(vllm_cases: Any, tmp_path: Path) -> None:
    """vLLM's sleep releases the KV memory; in the pool its loans and the ledger's count
    would outlive it: `EngineCore.sleep` (wrapped by the plugin) refuses with a message the
    client gets. Without a hook, vLLM's sleep runs."""
    from extensible_kv._native import UnsupportedError
    from extensible_kv.pool import Pool
    from extensible_kv.vllm import engine as engine_module

    pool = Pool("test", directory=tmp_path)
    engine = _engine(vllm_cases, pool, STEP, min_blocks=8)
    sleep = engine_module.wrap_sleep(lambda core, level=1: f"slept {level}")
    assert sleep(Core(), 2) == "slept 2"
    engine_module._HOOKS[engine.core] = engine_module.StepHook(engine.core, engine.policy)
    with pytest.raises(UnsupportedError, match="node pool test"):
        sleep(engine.core, 1)
    engine.policy.leave()


def test_an_engine_of_several_ranks_or_mixed_strides_is_refused(
    vllm_cases: Any, tmp_path: Path
) -> None:
    from extensible_kv._native import UnsupportedError
    from extensible_kv.vllm.pooled import PooledPolicy, PoolSettings

    engine = SimpleNamespace(
        model_executor=SimpleNamespace(driver_worker=None),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(world_size=2)),
        scheduler=None,
    )
    with pytest.raises(UnsupportedError, match="one GPU only"):
        PooledPolicy(engine, None, PoolSettings("test"))  # type: ignore[arg-type]
    # A KV connector registered the memory at its size: refused, as a resize is.
    from extensible_kv.vllm import resize as resize_module

    one = SimpleNamespace(
        model_executor=SimpleNamespace(driver_worker=object()),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(world_size=1)),
        scheduler=None,
    )
    resizer = SimpleNamespace(workers=lambda: [resize_module.WorkerCache(64, 8, True)])
    with pytest.raises(UnsupportedError, match="KV connector"):
        PooledPolicy(one, resizer, PoolSettings("test"))  # type: ignore[arg-type]


def test_the_pool_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from extensible_kv.vllm.pooled import PoolSettings

    assert PoolSettings.from_environ({}) is None
    assert PoolSettings.from_environ({"EXTENSIBLE_KV_POOL": "node"}) == PoolSettings("node")
    got = PoolSettings.from_environ(
        {
            "EXTENSIBLE_KV_POOL": "node",
            "EXTENSIBLE_KV_POOL_MIN": "2GiB",
            "EXTENSIBLE_KV_POOL_MAX": "4000",
        }
    )
    assert got == PoolSettings("node", min_bytes=2 << 30, max_blocks=4000)
    with pytest.raises(ValueError, match="EXTENSIBLE_KV_POOL_MAX='lots'"):
        PoolSettings.from_environ({"EXTENSIBLE_KV_POOL": "n", "EXTENSIBLE_KV_POOL_MAX": "lots"})
