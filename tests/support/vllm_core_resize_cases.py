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
    ids = list(output.num_scheduled_tokens)
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
