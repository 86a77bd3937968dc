"""Run-time resize of a vLLM 0.34 engine core's KV cache: the scheduler's block pool
(`ResizableBlockPool`, which the plugin puts where vLLM builds its pool) and the workers'
`ExtensibleKVCache`s together (`KvResizer`), on vLLM's own `KVCacheManager` and cache.

The workers here are vLLM's `ExtensibleKVCache` on our drop-in (host backend), reached through
a `collective_rpc` of the executor's shape; a worker's memory is checked byte for byte below
the count across every grow, shrink and failed change.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from support.vllm_workers import BLOCK, Workers, kv_manager, vllm_request

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_modules(vllm_plugin: Any) -> SimpleNamespace:
    """vLLM's manager and request types, with the plugin's block pool in place."""
    from extensible_kv.vllm import plugin
    from extensible_kv.vllm.block_pool import ResizableBlockPool
    from vllm.v1.core import kv_cache_coordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    assert plugin.register()
    assert kv_cache_coordinator.BlockPool is ResizableBlockPool
    return SimpleNamespace(KVCacheManager=KVCacheManager, ResizableBlockPool=ResizableBlockPool)


def _manager(modules: SimpleNamespace, num_blocks: int, groups: str = "full") -> Any:
    return kv_manager(num_blocks, groups)


def _admit(manager: Any, tokens: list[int]) -> tuple[Any, list[int]]:
    request = vllm_request(tokens)
    computed, num_computed, _ = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(request, len(tokens) - num_computed, num_computed, computed)
    assert blocks is not None, "no room"
    return request, list(manager.get_block_ids(request.request_id)[0])


def _check_queue(pool: Any) -> None:
    """The invariants `ResizableBlockPool` states: ids, and the free queue's exact contents."""
    assert len(pool.blocks) == pool.num_gpu_blocks
    assert [block.block_id for block in pool.blocks] == list(range(pool.num_gpu_blocks))
    queued = pool.free_block_queue.get_all_free_blocks()
    assert len(queued) == pool.free_block_queue.num_free_blocks
    expected = {
        block.block_id
        for block in pool.blocks
        if block.ref_cnt == 0 and not block.is_null and block.block_id not in pool._retired
    }
    assert {block.block_id for block in queued} == expected
    if pool.shrinking_to is not None:
        assert all(i >= pool.shrinking_to for i in pool._retired)
        assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool._retired.values())


# ---- the scheduler's pool --------------------------------------------------------------
@pytest.mark.parametrize("groups", ["full", "hybrid"])
def test_a_grown_pool_hands_out_its_new_blocks_before_evicting_a_cached_one(
    vllm_modules: SimpleNamespace, groups: str
) -> None:
    manager = _manager(vllm_modules, 10, groups)
    pool = manager.block_pool
    assert isinstance(pool, vllm_modules.ResizableBlockPool)
    cached, _ = _admit(manager, [1] * (4 * BLOCK))  # blocks 1..4 (and the window's)
    manager.free(cached)
    assert pool.grow(20) == 10
    _check_queue(pool)
    assert pool.get_num_free_blocks() == 19
    _, ids = _admit(manager, [2] * (3 * BLOCK))
    assert min(ids) >= 10, ids  # new blocks first: the cached prefix is kept
    _, again = _admit(manager, [1] * (4 * BLOCK))
    assert again[:3] == [1, 2, 3]  # the prefix cache still holds the first request's blocks
    assert pool.grow(20) == 0
    _check_queue(pool)


def test_a_shrink_drains_the_blocks_past_the_cut_and_hands_out_only_blocks_below_it(
    vllm_modules: SimpleNamespace,
) -> None:
    manager = _manager(vllm_modules, 16)
    pool = manager.block_pool
    low, low_ids = _admit(manager, list(range(3 * BLOCK)))  # blocks 1..3
    high, high_ids = _admit(manager, list(range(100, 100 + 8 * BLOCK)))  # blocks 4..11
    assert max(high_ids) == 11
    cached, _ = _admit(manager, list(range(500, 500 + 2 * BLOCK)))  # 12, 13: cached, freed
    manager.free(cached)
    assert pool.cached_block_hash_to_block.get_one_block(pool.blocks[12].block_hash) is not None

    assert pool.begin_shrink(6) == 6  # blocks 6..11 are high's
    _check_queue(pool)
    assert pool.shrinking_to == 6 and not pool.drained
    assert pool.blocks[12].block_hash is None  # the cached ones past the cut are evicted
    assert "free_blocks" in pool.__dict__  # the drain's wrapper, on this pool only
    assert pool.get_num_free_blocks() == 0  # 1..5 held, 6.. retired or held
    with pytest.raises(ValueError, match="Cannot get 1 free blocks"):
        pool.get_new_blocks(1)
    with pytest.raises(RuntimeError, match="waits for 6 blocks"):
        pool.finish_shrink()
    manager.free(high)  # 4..11 freed: 4, 5 back to the queue, 6..11 retired
    _check_queue(pool)
    assert pool.drained and "free_blocks" not in pool.__dict__
    assert pool.finish_shrink() == 10
    _check_queue(pool)
    assert pool.num_gpu_blocks == 6 and pool.shrinking_to is None
    assert pool.get_num_free_blocks() == 2
    assert manager.get_block_ids(low.request_id)[0] == low_ids  # untouched
    _, ids = _admit(manager, list(range(900, 900 + 2 * BLOCK)))
    assert sorted(ids) == [4, 5]


def test_a_cancelled_shrink_gives_every_retired_block_back(
    vllm_modules: SimpleNamespace,
) -> None:
    manager = _manager(vllm_modules, 10)
    pool = manager.block_pool
    held, _ = _admit(manager, list(range(8 * BLOCK)))  # 1..8
    assert pool.begin_shrink(3) == 6  # 3..8 held, 9 free and retired
    free_before = pool.get_num_free_blocks()
    manager.free(held)
    _check_queue(pool)
    assert pool.get_num_free_blocks() == free_before + 2  # 1, 2 only: 3..8 retired
    with pytest.raises(RuntimeError, match="finish or cancel"):
        pool.grow(20)
    assert pool.cancel_shrink() == 7
    _check_queue(pool)
    assert pool.get_num_free_blocks() == 9 and pool.num_gpu_blocks == 10
    assert "free_blocks" not in pool.__dict__ and pool.shrinking_to is None
    assert pool.cancel_shrink() == 0


@pytest.mark.parametrize("bad", [1, 10, 11, -1])
def test_a_shrink_past_the_bounds_is_refused_and_changes_nothing(
    vllm_modules: SimpleNamespace, bad: int
) -> None:
    pool = _manager(vllm_modules, 10).block_pool
    with pytest.raises(ValueError):
        pool.begin_shrink(bad)
    with pytest.raises(TypeError):
        pool.grow(2.0)
    assert pool.shrinking_to is None and pool.num_gpu_blocks == 10
    _check_queue(pool)


def test_unpinned_blocks_past_the_cut_are_released_to_their_reader_and_retired(
    vllm_modules: SimpleNamespace,
) -> None:
    manager = _manager(vllm_modules, 8)
    pool = manager.block_pool
    blocks = pool.get_new_blocks(6)  # 1..6
    told: list[int] = []
    pool.begin_shrink(4)
    pool.unpin_blocks(blocks[3:], told.append)  # 4, 5, 6: past the cut
    assert sorted(block.block_id for block in told) == [4, 5, 6]
    pool.free_blocks(blocks[:3])
    _check_queue(pool)
    assert pool.drained
    pool.finish_shrink()
    _check_queue(pool)


def test_the_plugin_leaves_vllms_block_pool_when_switched_off(
    vllm_modules: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    from extensible_kv.vllm import plugin
    from vllm.v1.core import block_pool, kv_cache_coordinator

    plugin.unregister()
    original = block_pool.BlockPool
    assert original.__name__ == "BlockPool" and kv_cache_coordinator.BlockPool is original
    monkeypatch.setenv(plugin.RESIZE_ENV_VAR, "0")
    try:
        assert plugin.register()
        assert kv_cache_coordinator.BlockPool is original
    finally:
        plugin.unregister()
        monkeypatch.delenv(plugin.RESIZE_ENV_VAR)
        assert plugin.register()
    assert kv_cache_coordinator.BlockPool.__name__ == "ResizableBlockPool"


# ---- the engine core: pool and workers together ----------------------------------------
@pytest.fixture
def vllm_cases(vllm_plugin: Any) -> Any:
    from support import vllm_cases

    return vllm_cases


def _engine(
    modules: SimpleNamespace, vllm_cases: Any, blocks: int = 8, ranks: int = 2
) -> tuple[Any, Any, Workers]:
    from extensible_kv.vllm.resize import KvResizer

    manager = _manager(modules, blocks)
    scheduler = SimpleNamespace(
        kv_cache_manager=manager,
        scheduler_config=SimpleNamespace(watermark=0.25),
        cache_config=SimpleNamespace(num_gpu_blocks=blocks),
    )
    workers = Workers(vllm_cases, ranks, capacity=64, committed=blocks)
    sleeping = {"now": False}
    resizer = KvResizer(scheduler, workers.rpc, is_sleeping=lambda: sleeping["now"])
    resizer.sleeping = sleeping  # type: ignore[attr-defined]
    return resizer, scheduler, workers


def test_a_grow_commits_every_worker_then_the_pool_and_keeps_the_blocks_below(
    vllm_modules: SimpleNamespace, vllm_cases: Any
) -> None:
    resizer, scheduler, workers = _engine(vllm_modules, vllm_cases)
    workers.stamp(8)
    assert resizer.resize(40) == 40
    assert workers.committed() == [40, 40]
    assert workers.stamped(8)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_gpu_blocks == 40 and pool.get_num_free_blocks() == 39
    assert scheduler.cache_config.num_gpu_blocks == 40
    assert scheduler.kv_cache_manager.kv_cache_config.num_blocks == 40
    assert scheduler.kv_cache_manager.watermark_blocks == 10
    with pytest.raises(ValueError, match="past the workers' reservation of 64 blocks"):
        resizer.resize(65)
    assert workers.committed() == [40, 40]


def test_a_failed_grow_on_one_rank_leaves_every_rank_and_the_pool_as_they_were(
    vllm_modules: SimpleNamespace, vllm_cases: Any
) -> None:
    resizer, scheduler, workers = _engine(vllm_modules, vllm_cases, ranks=3)
    workers.stamp(8)
    workers.fail_rank, workers.fail_at = 2, 30  # ranks 0 and 1 grew before it failed
    with pytest.raises(MemoryError, match="rank 2"):
        resizer.resize(30)
    assert workers.committed() == [8, 8, 8]
    assert workers.stamped(8)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_gpu_blocks == 8 and pool.get_num_free_blocks() == 7
    _check_queue(pool)


def test_a_shrink_waits_for_the_blocks_past_the_cut_then_every_worker_gives_them_back(
    vllm_modules: SimpleNamespace, vllm_cases: Any
) -> None:
    resizer, scheduler, workers = _engine(vllm_modules, vllm_cases, blocks=20)
    manager = scheduler.kv_cache_manager
    low, _ = _admit(manager, list(range(4 * BLOCK)))  # 1..4
    high, _ = _admit(manager, list(range(300, 300 + 10 * BLOCK)))  # 5..14
    workers.stamp(20)
    assert resizer.resize(8) == 20  # begun: 8..14 are high's
    assert resizer.shrinking_to == 8 and resizer.num_blocks == 8
    assert workers.committed() == [20, 20]
    assert resizer.poll() == 20  # not drained yet: nothing changes
    manager.free(high)
    assert resizer.poll() == 8
    assert workers.committed() == [8, 8] and workers.stamped(8)
    assert manager.block_pool.num_gpu_blocks == 8 and resizer.shrinking_to is None
    assert scheduler.cache_config.num_gpu_blocks == 8
    _check_queue(manager.block_pool)
    del low


def test_a_failed_shrink_cancels_it_and_grows_back_the_ranks_that_shrank(
    vllm_modules: SimpleNamespace, vllm_cases: Any
) -> None:
    resizer, scheduler, workers = _engine(vllm_modules, vllm_cases, blocks=20, ranks=2)
    workers.stamp(20)
    workers.fail_rank, workers.fail_at = 1, 6
    with pytest.raises(MemoryError):
        resizer.resize(6)  # drained at once: the workers' commit runs, and fails on rank 1
    assert workers.committed() == [20, 20] and workers.stamped(6)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_gpu_blocks == 20 and pool.shrinking_to is None
    assert pool.get_num_free_blocks() == 19
    _check_queue(pool)


def test_a_grow_replaces_a_shrink_in_progress(
    vllm_modules: SimpleNamespace, vllm_cases: Any
) -> None:
    resizer, scheduler, workers = _engine(vllm_modules, vllm_cases, blocks=20)
    manager = scheduler.kv_cache_manager
    held, _ = _admit(manager, list(range(12 * BLOCK)))
    resizer.resize(6)
    assert resizer.shrinking_to == 6
    assert resizer.resize(30) == 30
    assert resizer.shrinking_to is None and workers.committed() == [30, 30]
    manager.free(held)
    _check_queue(manager.block_pool)
    assert manager.block_pool.get_num_free_blocks() == 29


def test_asleep_or_with_a_connector_a_resize_is_refused(
    vllm_modules: SimpleNamespace, vllm_cases: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from extensible_kv import UnsupportedError
    from extensible_kv.vllm import resize

    resizer, scheduler, workers = _engine(vllm_modules, vllm_cases)
    resizer.sleeping["now"] = True
    with pytest.raises(UnsupportedError, match="asleep"):
        resizer.resize(20)
    resizer.sleeping["now"] = False
    real = resize.describe_worker
    monkeypatch.setattr(
        resize,
        "describe_worker",
        lambda worker: resize.WorkerCache(**{**real(worker).__dict__, "connector": True}),
    )
    with pytest.raises(UnsupportedError, match="KV connector"):
        resizer.resize(20)
    assert workers.committed() == [8, 8]
    assert scheduler.kv_cache_manager.block_pool.num_gpu_blocks == 8


def test_a_pool_that_is_not_ours_is_refused(vllm_modules: SimpleNamespace) -> None:
    from extensible_kv import UnsupportedError
    from extensible_kv.vllm.block_pool import VLLM_BLOCK_POOL as base
    from extensible_kv.vllm.resize import KvResizer
    from vllm.v1.core.block_pool import BlockPool

    scheduler = SimpleNamespace(
        kv_cache_manager=SimpleNamespace(block_pool=base(4, True, BLOCK)),
        scheduler_config=None,
        cache_config=None,
    )
    assert BlockPool is vllm_modules.ResizableBlockPool  # the plugin's, in vLLM's module
    with pytest.raises(UnsupportedError, match="not ResizableBlockPool"):
        KvResizer(scheduler, lambda fn, args=(): [])
