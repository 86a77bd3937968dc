"""Cases that resize vLLM 0.34.0's scheduler between its steps, run beside vLLM's own v1 core
tests (same process, same helpers: `tests.v1.core.utils`, vLLM's) by
`tests/test_vllm_core_suite.py`, with `ResizableBlockPool` in place. Not collected by our own
test run (the module needs vLLM's test tree on the path).

Each case drives vLLM's real `Scheduler` (schedule, a model runner's output, update) and
resizes its block pool between steps: the block ids the scheduler hands out stay within the
pool, no block is handed out twice, and every request finishes with its tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
from extensible_kv.vllm.block_pool import ResizableBlockPool
from tests.v1.core.utils import create_requests, create_scheduler
from vllm.v1.outputs import ModelRunnerOutput

SAMPLED = 7  # the token every step samples (not EOS: requests run to max_tokens)


def _step(scheduler: Any) -> Any:
    """One engine step with a model that samples `SAMPLED` for every caught-up request;
    checks the step's block tables name live, distinct blocks of the pool."""
    output = scheduler.schedule()
    pool = scheduler.kv_cache_manager.block_pool
    owners: dict[int, str] = {}
    for rid in scheduler.requests:
        for group in scheduler.kv_cache_manager.get_block_ids(rid):
            for block_id in group:
                if block_id == 0:
                    continue  # the null block
                assert block_id < pool.num_gpu_blocks, (rid, block_id, pool.num_gpu_blocks)
                cut = pool.shrinking_to
                if cut is not None and block_id >= cut:
                    # Past a shrink's cut: only blocks held since before it began.
                    assert pool.blocks[block_id].ref_cnt > 0
                shared = pool.blocks[block_id].ref_cnt > 1
                assert shared or owners.setdefault(block_id, rid) == rid, block_id
    return _sample(scheduler, output)


def _sample(scheduler: Any, output: Any) -> Any:
    """The model's part of a step: `SAMPLED` for every scheduled request caught up with its
    tokens (`schedule` counted the step's tokens computed already), then the update."""
    ids = list(output.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        request = scheduler.requests[rid]
        sampled.append([SAMPLED] if request.num_computed_tokens >= request.num_tokens else [])
    runner_output = ModelRunnerOutput(
        req_ids=ids,
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )
    return scheduler.update_from_output(output, runner_output)


def _run(scheduler: Any, requests: list[Any], between: Any, max_steps: int = 400) -> int:
    for request in requests:
        scheduler.add_request(request)
    steps = 0
    while scheduler.requests and steps < max_steps:
        _step(scheduler)
        steps += 1
        between(scheduler, steps)
    assert not scheduler.requests, f"{len(scheduler.requests)} requests left after {steps}"
    return steps


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_scheduler_grown_between_steps_admits_more_at_once(prefix_caching: bool) -> None:
    scheduler = create_scheduler(
        num_blocks=12, enable_prefix_caching=prefix_caching, max_num_seqs=16
    )
    pool = scheduler.kv_cache_manager.block_pool
    assert isinstance(pool, ResizableBlockPool)
    requests = create_requests(num_requests=8, num_tokens=64, max_tokens=8)
    running: list[int] = []

    def between(scheduler: Any, step: int) -> None:
        running.append(len(scheduler.running))
        if step == 2:
            assert pool.grow(60) == 48

    _run(scheduler, requests, between)
    assert max(running[:2]) <= 2  # 12 blocks: 5 a request (64 tokens + 8)
    assert max(running[2:]) == 8  # grown: all of them at once
    assert all(len(r.output_token_ids) == 8 for r in requests)
    assert pool.get_num_free_blocks() == 59


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_shrink_begun_mid_trace_drains_and_finishes_between_steps(
    prefix_caching: bool,
) -> None:
    scheduler = create_scheduler(
        num_blocks=80, enable_prefix_caching=prefix_caching, max_num_seqs=16
    )
    pool = scheduler.kv_cache_manager.block_pool
    requests = create_requests(num_requests=10, num_tokens=96, max_tokens=12)
    done: dict[str, int] = {}

    def between(scheduler: Any, step: int) -> None:
        if step == 3:
            pool.begin_shrink(20)
        if pool.shrinking_to is not None and pool.drained:
            done["finished_at"] = step
            pool.finish_shrink()
            assert pool.num_gpu_blocks == 20

    _run(scheduler, requests, between)
    assert "finished_at" in done and pool.num_gpu_blocks == 20
    assert all(len(r.output_token_ids) == 12 for r in requests)
    assert pool.get_num_free_blocks() == 19
    assert "free_blocks" not in pool.__dict__


def test_a_shrink_cancelled_mid_drain_leaves_the_scheduler_whole() -> None:
    scheduler = create_scheduler(num_blocks=40, enable_prefix_caching=True)
    pool = scheduler.kv_cache_manager.block_pool
    requests = create_requests(num_requests=6, num_tokens=80, max_tokens=10)

    def between(scheduler: Any, step: int) -> None:
        if step == 2:
            pool.begin_shrink(8)
        if step == 4:
            pool.cancel_shrink()

    _run(scheduler, requests, between)
    assert pool.num_gpu_blocks == 40 and pool.get_num_free_blocks() == 39
    assert all(len(r.output_token_ids) == 10 for r in requests)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_the_automatic_policy_grows_for_a_burst_and_shrinks_after_it(prefix_caching: bool) -> None:
    """vLLM's real Scheduler from 8 blocks, with two host workers of vLLM's ExtensibleKVCache
    behind a `collective_rpc`, and the automatic policy before each step
    (`extensible_kv.vllm.engine`): a burst of 8 requests of 64 tokens grows the cache (the
    pool and every worker) until they all run at once, each finishes with its tokens, and
    once idle the cache shrinks to its least, the workers with it."""
    from extensible_kv.vllm.engine import AutoPolicy, AutoSettings
    from extensible_kv.vllm.resize import KvResizer

    from support import vllm_cases
    from support.vllm_workers import Workers

    scheduler = create_scheduler(
        num_blocks=8, enable_prefix_caching=prefix_caching, max_num_seqs=16
    )
    workers = Workers(vllm_cases, 2, capacity=128, committed=8)
    resizer = KvResizer(scheduler, workers.rpc)
    now = [0.0]
    settings = AutoSettings(min_blocks=4, max_blocks=128, idle_s=1.0)
    policy = AutoPolicy(resizer, scheduler, settings, clock=lambda: now[0])
    requests = create_requests(num_requests=8, num_tokens=64, max_tokens=8)
    running: list[int] = []
    sizes: list[int] = []

    def between(scheduler: Any, step: int) -> None:
        running.append(len(scheduler.running))
        now[0] += 0.01
        policy.before_step(in_flight=False)
        sizes.append(resizer.num_blocks)
        assert workers.committed() == [resizer.num_blocks] * 2

    for request in requests:  # the policy sees the burst before the first step
        scheduler.add_request(request)
    policy.before_step(in_flight=False)
    _run(scheduler, [], between)
    assert sizes[0] > 8 and max(running) == 8
    assert all(len(r.output_token_ids) == 8 for r in requests)
    now[0] += 2.0
    policy.idle()
    assert resizer.num_blocks == 4 and workers.committed() == [4, 4]
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 3


def test_a_pooled_engine_keeps_every_slot_through_a_bursty_trace(tmp_path: Any) -> None:
    """The model-free harness (issue 53 item 3), in one process: vLLM's real Scheduler (prefix
    caching on) in the node pool (`extensible_kv.vllm.pooled`) with a host worker of vLLM's
    ExtensibleKVCache, beside an engine of another model (our ExtensibleKVCache, 16 KiB a
    block). In place of the model, every step writes a checksum of (position, token) into
    every slot of every segment its scheduled tokens fill, and checks every slot of the
    context each scheduled request reads. Bursts come to the vLLM engine; between them the
    other engine asks for memory, which the idle vLLM engine lends, and which comes back at
    its next burst. Every request finishes, no slot is ever wrong, and memory moved both
    ways."""
    import torch
    from extensible_kv import AttentionLayerSpec, ExtensibleKVCache, KVCacheTensorSpec
    from extensible_kv.pool import Pool, PoolMember, rules
    from extensible_kv.vllm.pooled import PooledPolicy, PoolSettings
    from extensible_kv.vllm.resize import KvResizer

    from support import vllm_cases
    from support.vllm_workers import Core, Workers

    step_blocks = 256  # a 2 MiB granule of 8 KiB blocks: a handle per commit step
    scheduler = create_scheduler(num_blocks=8, enable_prefix_caching=True, max_num_seqs=32)
    workers = Workers(vllm_cases, 1, capacity=1024, committed=8, export_handle_types=1)
    resizer = KvResizer(scheduler, workers.rpc)
    for size in range(step_blocks, 3 * step_blocks + 1, step_blocks):
        resizer.resize(size)
    kv = workers.kv(0)
    core = Core(
        scheduler=scheduler,
        model_executor=Core(driver_worker=workers.workers[0], collective_rpc=workers.rpc),
    )
    pool = Pool("harness", directory=str(tmp_path))
    policy = PooledPolicy(core, resizer, PoolSettings(pool, min_blocks=8), engine="v")
    policy.member.give_back_idle_s = 0.0
    pool.set_cap("cpu", kv.physical_bytes)  # v holds the whole cap: e must borrow from it
    spec = KVCacheTensorSpec(
        4 * 4096, {"attn": AttentionLayerSpec("FLASH_ATTN", 32, 4, 32, torch.bfloat16)}
    )
    other = ExtensibleKVCache(
        (spec,), 512, "cpu", granularity=2 << 20, export_handle_types="posix_fd"
    )
    e = PoolMember(
        pool, "e", other, max_blocks=512, free_tail_blocks=lambda: other.committed_blocks
    )
    e.join()
    block_size = scheduler.block_size
    per_block = kv.segment_strides[0] // 4  # int32 slots a block, per segment

    def checksum(position: int, token: int) -> int:
        return (position * 1_000_003 + token * 7_919 + 1) & 0x7FFFFFFF

    def slots(request: Any, start: int, end: int) -> tuple[list[int], list[int]]:
        (blocks,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        index = [blocks[p // block_size] * per_block + p % block_size for p in range(start, end)]
        tokens = request.all_token_ids
        return index, [checksum(p, tokens[p]) for p in range(start, end)]

    wrong: list[tuple[str, int]] = []
    checked = [0]

    def model_step() -> None:
        output = scheduler.schedule()
        views = [
            kv.buffer.segment_view(s).view(torch.int32) for s in range(len(kv.segment_strides))
        ]
        ids = list(output.num_scheduled_tokens)
        for rid in ids:
            request = scheduler.requests[rid]
            new = output.num_scheduled_tokens[rid]
            done = request.num_computed_tokens - new  # `schedule` counted this step's already
            read, want = slots(request, 0, done)  # the context this step reads
            for view in views:
                got = view[torch.tensor(read, dtype=torch.long)].tolist() if read else []
                bad = [p for p, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
                wrong.extend((rid, p) for p in bad)
                checked[0] += len(got)
            write, values = slots(request, done, done + new)
            for view in views:
                view[torch.tensor(write, dtype=torch.long)] = torch.tensor(
                    values, dtype=torch.int32
                )
        _sample(scheduler, output)

    requests: list[Any] = []
    lent = borrowed_back = 0
    for burst in range(3):
        # Idle: the other engine asks, v lends its free top blocks.
        assert [d.action for d in e.request(300)] == ["ask"]
        policy.before_step(in_flight=False)
        lent = max(lent, 3 * step_blocks - resizer.num_blocks)
        e.serve()
        # v's burst, past what it kept (46 blocks a request, 552 in all): it asks, recalling
        # its loan, which the idle other engine gives back.
        batch = create_requests(num_requests=12, num_tokens=720 - 16 * burst, max_tokens=16)
        for request in batch:
            scheduler.add_request(request)
        requests.extend(batch)
        for _ in range(600):
            before = resizer.num_blocks
            policy.before_step(in_flight=False)  # serves, asks, takes back
            e.serve()  # gives back what v recalled (e is idle)
            borrowed_back += resizer.num_blocks > before
            if not scheduler.requests:
                break
            model_step()
        assert not scheduler.requests
        assert rules.check(pool.snapshot()) == []
        assert resizer.pool.num_gpu_blocks == kv.num_committed_blocks
    assert wrong == [], wrong[:10]
    assert checked[0] > 36 * 700 * 3  # every decode step re-reads its context, in every segment
    assert all(len(r.output_token_ids) == 16 for r in requests)
    assert lent > 0 and borrowed_back > 0
    assert {d.action for d in e.request(1)} <= {"ask", "wait", "recall", "commit"}
    e.leave(timeout_s=0)  # v need not serve: e holds nothing of v's once it gave back
    policy.leave()
    other.close()
