"""What the run-time resize costs a vLLM 0.34 engine's steps (issue 53): the scheduler's block
pool as vLLM's `BlockPool` against the plugin's `ResizableBlockPool`, and the step hook's
policies, on vLLM's own `KVCacheManager`, in one process (the scheduler's side of a step: no
model, no GPU needed).

    python3 benchmarks/bench_vllm_steps.py --out DIR [--quick] [--reps 7]

**The step** (`run_steps`): a decode trace on one manager (prefix caching on or off, a
KV cache of `--blocks` blocks): `--requests` requests of prompts sharing a prefix are admitted
(`get_computed_blocks`, `allocate_slots` for the prompt), then every step gives each running
request one more token (`allocate_slots`), finishing and freeing (`free`) a request after
`--new-tokens` and admitting the next in its place, for `--steps` steps. Timed with
`time.perf_counter()` around the whole trace; per step in µs.

**Contenders**, alternated within each repetition (so drift hits both alike), medians over
`--reps`: `vllm` (vLLM's `BlockPool`: the plugin unregistered), `ours` (`ResizableBlockPool`:
registered). Reported: per step µs and the ratio ours / vLLM (target ≤ 1.02).

**The hook's per-step cost**: `AutoPolicy.before_step` with nothing to do (the automatic
policy, `EXTENSIBLE_KV_VLLM_AUTO`) and a quiet `PoolMember.serve` of the pool's policy
(`EXTENSIBLE_KV_POOL`, through `PooledPolicy.before_step`), each in µs a call, beside the
step's own time.

**A grow**: `ResizableBlockPool.grow` by `--grow-blocks`, from the call to the new blocks in
the free queue (µs), and `KvResizer.resize` with a host worker of vLLM's `ExtensibleKVCache`
(commit, views, pool: ms).

Markdown on stdout, DIR/bench_vllm_steps.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import log  # noqa: E402
from support import vllm_env  # noqa: E402  (after the path: it lives with the tests)

QUICK = {"reps": 2, "steps": 60, "requests": 16}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_vllm_steps"))
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--requests", type=int, default=64, help="running at once")
    parser.add_argument("--prompt", type=int, default=512, help="tokens a prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=8192)
    parser.add_argument("--grow-blocks", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def run_steps(args: argparse.Namespace, prefix_caching: bool) -> float:
    """The decode trace on a fresh manager (whatever `BlockPool` vLLM's modules bind now):
    µs a step."""
    from support.vllm_workers import kv_manager, vllm_request

    manager = kv_manager(args.blocks)
    manager.enable_caching = prefix_caching
    shared = [7] * (args.prompt // 2)

    def admit(serial: int) -> Any:
        request = vllm_request(shared + [serial % 97 + 1] * (args.prompt - len(shared)))
        computed, num_computed, _ = manager.get_computed_blocks(request)
        need = request.num_tokens - num_computed
        assert manager.allocate_slots(request, need, num_computed, computed) is not None
        request.num_computed_tokens = request.num_tokens
        return request

    serial = 0
    running = []
    for _ in range(args.requests):
        running.append([admit(serial), 0])
        serial += 1
    started = time.perf_counter()
    for _ in range(args.steps):
        for slot in running:
            request, made = slot
            request.append_output_token_ids(5)
            assert manager.allocate_slots(request, 1) is not None
            request.num_computed_tokens += 1
            slot[1] = made + 1
            if slot[1] >= args.new_tokens:
                manager.free(request)
                slot[0], slot[1] = admit(serial), 0
                serial += 1
    took = time.perf_counter() - started
    for request, _ in running:
        manager.free(request)
    return took / args.steps * 1e6


def hook_costs(args: argparse.Namespace) -> dict[str, float]:
    """µs a call: the automatic policy's `before_step` and the pool policy's quiet serve, on
    an engine of one host worker with nothing to do."""
    from extensible_kv.pool import Pool
    from extensible_kv.vllm.engine import AutoPolicy, AutoSettings
    from extensible_kv.vllm.pooled import PooledPolicy, PoolSettings
    from extensible_kv.vllm.resize import KvResizer
    from support import vllm_cases
    from support.vllm_workers import Workers
    from support.vllm_workers import scheduler as make_scheduler

    scheduler = make_scheduler(8)
    workers = Workers(vllm_cases, 1, capacity=512, committed=8, export_handle_types=1)
    resizer = KvResizer(scheduler, workers.rpc)
    resizer.resize(256)
    calls = 2000
    auto = AutoPolicy(resizer, scheduler, AutoSettings(min_blocks=8, idle_s=1e6))
    started = time.perf_counter()
    for _ in range(calls):
        auto.before_step(in_flight=True)
    auto_us = (time.perf_counter() - started) / calls * 1e6
    core = SimpleNamespace(
        scheduler=scheduler,
        model_executor=SimpleNamespace(
            driver_worker=workers.workers[0], collective_rpc=workers.rpc
        ),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(world_size=1)),
    )
    with tempfile.TemporaryDirectory() as directory:
        pool = Pool("bench", directory=directory)
        pooled = PooledPolicy(core, resizer, PoolSettings(pool, min_blocks=8), engine="v")
        pooled.before_step(in_flight=True)
        started = time.perf_counter()
        for _ in range(calls):
            pooled.before_step(in_flight=True)
        pooled_us = (time.perf_counter() - started) / calls * 1e6
        pooled.leave()
    return {"auto_before_step_us": auto_us, "pool_quiet_serve_us": pooled_us}


def grow_costs(args: argparse.Namespace) -> dict[str, float]:
    """A grow: the pool's (call to free queue, µs) and the resizer's with a host worker (ms)."""
    from extensible_kv.vllm.resize import KvResizer
    from support import vllm_cases
    from support.vllm_workers import Workers, kv_manager
    from support.vllm_workers import scheduler as make_scheduler

    manager = kv_manager(args.blocks)
    pool = manager.block_pool
    before = pool.get_num_free_blocks()
    started = time.perf_counter()
    pool.grow(args.blocks + args.grow_blocks)
    pool_us = (time.perf_counter() - started) * 1e6
    assert pool.get_num_free_blocks() == before + args.grow_blocks
    scheduler = make_scheduler(8)
    workers = Workers(vllm_cases, 1, capacity=512, committed=8)
    resizer = KvResizer(scheduler, workers.rpc)
    started = time.perf_counter()
    resizer.resize(512)
    resize_ms = (time.perf_counter() - started) * 1e3
    return {"pool_grow_us": pool_us, "resize_host_worker_ms": resize_ms}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    vllm_env.load()
    from extensible_kv.vllm import plugin
    from extensible_kv.vllm.block_pool import ResizableBlockPool
    from vllm.plugins import load_general_plugins
    from vllm.v1.core import kv_cache_coordinator

    load_general_plugins()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}}
    for prefix_caching in (False, True):
        times: dict[str, list[float]] = {"vllm": [], "ours": []}
        for rep in range(args.reps):
            order = ("vllm", "ours") if rep % 2 == 0 else ("ours", "vllm")
            for name in order:
                if name == "vllm":
                    plugin.unregister()
                    assert kv_cache_coordinator.BlockPool is not ResizableBlockPool
                else:
                    assert plugin.register()
                    assert kv_cache_coordinator.BlockPool is ResizableBlockPool
                times[name].append(run_steps(args, prefix_caching))
        assert plugin.register()
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        key = "prefix caching" if prefix_caching else "no prefix caching"
        results[key] = {
            "step_us": medians,
            "runs_us": times,
            "ratio": medians["ours"] / medians["vllm"],
        }
        log(f"{key}: {medians}")
    results["hook"] = hook_costs(args)
    results["grow"] = grow_costs(args)
    (args.out / "bench_vllm_steps.json").write_text(json.dumps(results, indent=1))
    print("### The scheduler's step on vLLM's BlockPool and on ResizableBlockPool")
    print(
        f"{args.requests} running requests, {args.steps} decode steps, prompts of "
        f"{args.prompt} tokens (half shared), {args.new_tokens} new tokens each, "
        f"{args.blocks} blocks; medians of {args.reps}"
    )
    print("| prefix caching | vLLM's (µs a step) | ours (µs a step) | ours / vLLM's |")
    print("|---|---:|---:|---:|")
    for key in ("no prefix caching", "prefix caching"):
        entry = results[key]
        print(
            f"| {key} | {entry['step_us']['vllm']:.1f} | {entry['step_us']['ours']:.1f} | "
            f"{entry['ratio']:.3f} |"
        )
    hook, grow = results["hook"], results["grow"]
    print(
        f"The hook a step: the automatic policy with nothing to do "
        f"{hook['auto_before_step_us']:.1f} µs, the pool's quiet serve "
        f"{hook['pool_quiet_serve_us']:.1f} µs. A grow by {args.grow_blocks} blocks: the "
        f"pool {grow['pool_grow_us']:.0f} µs to the free queue; with a host worker's commit "
        f"and views {grow['resize_host_worker_ms']:.2f} ms."
    )
    print(f"JSON: {args.out / 'bench_vllm_steps.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
