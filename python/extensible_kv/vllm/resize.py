"""Run-time resize of a live vLLM 0.34 engine core's KV cache (design.md §8b).

The engine core keeps the cache's size in two places: the scheduler's block pool (which
block ids exist and are free) and every worker's `ExtensibleKVCache` (the committed memory,
and the per-layer views vLLM binds over it). `KvResizer` changes both together, between
engine steps, all or nothing:

- **grow**: every worker commits first (through `collective_rpc`, so with TP > 1 every rank
  does); then the new block ids join the scheduler's free queue. A worker that fails leaves
  every rank back at the old count (those that grew shrink again, keeping their blocks) and
  the pool unchanged.
- **shrink**: the pool stops handing out blocks past the cut at once (`begin_shrink`); when
  the requests holding them have finished (`poll`, called at each step boundary), every
  worker gives the memory past the cut back, keeping every block below, and the pool ends at
  the cut. A worker that fails puts the retired blocks back: the pool keeps its size, and
  the ranks that shrank grow again.

A step boundary is where the engine core is between `step()` calls with no batch in flight
(`batch_queue` empty): no block table the workers hold names a block the scheduler does not
know. Refused, with the reason: an engine asleep (its memory is released), a KV connector
on the workers (it registered the memory at its size), a pool that is not ours (the plugin
installs `ResizableBlockPool` where the coordinator builds its pool).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from extensible_kv import _args
from extensible_kv._native import UnsupportedError
from extensible_kv.vllm.block_pool import ResizableBlockPool
from extensible_kv.vllm.commit import commit_keeping_data

__all__ = ["KvResizer", "WorkerCache", "commit_on_worker", "describe_worker", "worker_kv_cache"]

logger = logging.getLogger("vllm.extensible_kv")

CollectiveRpc = Callable[..., list[Any]]


@dataclass(frozen=True)
class WorkerCache:
    """What one worker's cache can do, as `describe_worker` reports it."""

    capacity_blocks: int
    committed_blocks: int
    connector: bool  # a KV connector holds registrations of the memory


def worker_kv_cache(worker: Any) -> Any:
    """A vLLM worker's `ExtensibleKVCache` (its model runner's); `UnsupportedError` without
    one."""
    runner = getattr(worker, "model_runner", worker)
    kv_cache = getattr(runner, "extensible_kv_cache", None)
    if kv_cache is None:
        raise UnsupportedError(
            "this worker's KV cache is not extensible: start vLLM with "
            "--enable-extensible-kv-cache (and the extensible-kv plugin on)"
        )
    return kv_cache


def describe_worker(worker: Any) -> WorkerCache:
    """Run on each worker through `collective_rpc`: its cache's capacity and count."""
    kv_cache = worker_kv_cache(worker)
    connector = False
    try:
        from vllm.distributed.kv_transfer import has_kv_transfer_group

        connector = bool(has_kv_transfer_group())
    except ImportError:  # pragma: no cover - vLLM without the connector registry
        pass
    return WorkerCache(int(kv_cache.capacity_blocks), int(kv_cache.num_committed_blocks), connector)


def commit_on_worker(worker: Any, num_blocks: int) -> int:
    """Run on each worker through `collective_rpc`: commits `num_blocks` keeping every block
    below both counts, then lets vLLM's `extend_kv_cache` rebind the views over the
    committed blocks (same addresses: CUDA graphs stay valid). Returns the committed count."""
    kv_cache = worker_kv_cache(worker)
    commit_keeping_data(kv_cache, num_blocks, shrink=True)
    extend = getattr(worker, "extend_kv_cache", None)
    if extend is not None:  # a real worker: views, runner config, num_gpu_blocks
        extend(int(kv_cache.num_committed_blocks))
    return int(kv_cache.num_committed_blocks)


class KvResizer:
    """Resizes one engine core's KV cache: its scheduler's pool and its workers' caches.

    `scheduler` is vLLM's `Scheduler` (or anything with its `kv_cache_manager`,
    `scheduler_config` and `cache_config`); `collective_rpc(fn, args=...)` runs `fn(worker,
    *args)` on every worker and returns their results (the executor's). `is_sleeping`, when
    given, is asked before every change. Call it from the engine core's thread, between
    steps."""

    def __init__(
        self,
        scheduler: Any,
        collective_rpc: CollectiveRpc,
        *,
        is_sleeping: Callable[[], bool] | None = None,
    ) -> None:
        pool = scheduler.kv_cache_manager.block_pool
        if not isinstance(pool, ResizableBlockPool):
            raise UnsupportedError(
                f"the scheduler's block pool is vLLM's {type(pool).__name__}, not "
                "ResizableBlockPool: the extensible-kv plugin installs it when vLLM builds "
                "the scheduler (is EXTENSIBLE_KV_VLLM_RESIZE off?)"
            )
        self._scheduler = scheduler
        self._pool: ResizableBlockPool = pool
        self._rpc = collective_rpc
        self._is_sleeping = is_sleeping

    # ---- reading --------------------------------------------------------------------
    @property
    def pool(self) -> ResizableBlockPool:
        """The scheduler's block pool."""
        return self._pool

    @property
    def num_blocks(self) -> int:
        """The blocks the scheduler may hand out now (the pool's size, or a shrink's cut)."""
        cut = self._pool.shrinking_to
        return self._pool.num_gpu_blocks if cut is None else cut

    @property
    def shrinking_to(self) -> int | None:
        return self._pool.shrinking_to

    @property
    def asleep(self) -> bool:
        """The engine is asleep (its memory released): nothing is resized until it wakes."""
        return self._is_sleeping is not None and bool(self._is_sleeping())

    @property
    def drained(self) -> bool:
        """A shrink in progress has every block past its cut free (`poll` ends it)."""
        return self._pool.shrinking_to is not None and self._pool.drained

    def waiting_need(self) -> int:
        """The blocks the scheduler's waiting requests need to finish (each one's prompt plus
        its `max_tokens`, in the scheduler's blocks), and at least what the first of them
        needs now; 0 with none waiting. Both policies grow for it (`extensible_kv.vllm.engine`,
        `extensible_kv.vllm.pooled`)."""
        scheduler = self._scheduler
        waiting = list(scheduler.waiting)
        if not waiting:
            return 0
        size = int(getattr(scheduler, "block_size", 0) or scheduler.cache_config.block_size)
        need = sum(-(-(int(r.num_prompt_tokens) + int(r.max_tokens)) // size) for r in waiting)
        return max(need, -(-(int(waiting[0].num_tokens) + 1) // size))

    @property
    def free_blocks(self) -> int:
        """The blocks the scheduler may hand out now (free, below a shrink's cut)."""
        return int(self._pool.get_num_free_blocks())

    def workers(self) -> list[WorkerCache]:
        return list(self._rpc(describe_worker))

    def capacity_blocks(self) -> int:
        """The most blocks every worker's reservation holds."""
        return min(worker.capacity_blocks for worker in self.workers())

    # ---- changing -------------------------------------------------------------------
    def resize(self, num_blocks: int) -> int:
        """Asks for `num_blocks` blocks; returns the pool's size after. A grow (or a grow
        back past a shrink in progress) is done when this returns; a shrink has begun, and
        `poll` completes it once the blocks past the cut are free (at once when they are).

        `ValueError` for a size below 2 or past every worker's reservation; `UnsupportedError`
        asleep or with a KV connector; a worker's error (`MemoryError` subclass when the
        device is out of memory) after every rank is back at its old count."""
        num_blocks = _args.size(num_blocks, "num_blocks", minimum=2)
        self._check_can_change()
        workers = self.workers()
        if any(worker.connector for worker in workers):
            raise UnsupportedError(
                "a KV connector registered the workers' KV cache memory at its size: the "
                "cache is not resized at run time while one is configured"
            )
        capacity = min(worker.capacity_blocks for worker in workers)
        if num_blocks > capacity:
            raise ValueError(
                f"num_blocks {num_blocks} is past the workers' reservation of {capacity} blocks"
            )
        pool = self._pool
        if pool.shrinking_to is not None:
            if num_blocks == pool.shrinking_to:
                return self.poll()
            pool.cancel_shrink()  # a new size replaces the shrink in progress
        if num_blocks > pool.num_gpu_blocks:
            self._commit_all(num_blocks, back_to=pool.num_gpu_blocks)
            pool.grow(num_blocks)
            self.sync_counts()
            logger.info("Extended KV cache to %d blocks (run-time resize).", num_blocks)
        elif num_blocks < pool.num_gpu_blocks:
            pool.begin_shrink(num_blocks)
            self.poll()
        return pool.num_gpu_blocks

    def poll(self) -> int:
        """Completes a shrink whose blocks past the cut are all free; returns the pool's
        size. Call it at each step boundary while `shrinking_to` is set."""
        pool = self._pool
        cut = pool.shrinking_to
        if cut is None or not pool.drained:
            return pool.num_gpu_blocks
        if self._is_sleeping is not None and self._is_sleeping():
            return pool.num_gpu_blocks  # asleep: done at the first boundary after wake-up
        try:
            self._commit_all(cut, back_to=pool.num_gpu_blocks)
        except BaseException:
            pool.cancel_shrink()
            raise
        pool.finish_shrink()
        self.sync_counts()
        logger.info("Shrank KV cache to %d blocks (run-time resize).", cut)
        return cut

    def cancel(self) -> None:
        """Ends a shrink in progress, the pool keeping its size."""
        self._pool.cancel_shrink()

    # ---- helpers --------------------------------------------------------------------
    def _check_can_change(self) -> None:
        if self._is_sleeping is not None and self._is_sleeping():
            raise UnsupportedError("the engine is asleep: wake it up before a resize")

    def _commit_all(self, num_blocks: int, *, back_to: int) -> None:
        """Every worker at `num_blocks`, or every worker back at `back_to` and the error."""
        try:
            counts = self._rpc(commit_on_worker, args=(num_blocks,))
        except BaseException:
            # Some ranks may have changed: all back (a shrink keeps their blocks, a grow
            # back zeroes only blocks the scheduler does not hand out yet).
            self._rpc(commit_on_worker, args=(back_to,))
            raise
        if any(count != num_blocks for count in counts):
            self._rpc(commit_on_worker, args=(back_to,))
            raise RuntimeError(f"workers committed {counts} blocks for {num_blocks}")

    def sync_counts(self) -> None:
        """The scheduler's own records of the size, which vLLM reads in a few places, from the
        pool's (after any change of its size)."""
        scheduler = self._scheduler
        num_blocks = self._pool.num_gpu_blocks
        manager = scheduler.kv_cache_manager
        manager.kv_cache_config.num_blocks = num_blocks
        scheduler.cache_config.num_gpu_blocks = num_blocks
        watermark = float(getattr(scheduler.scheduler_config, "watermark", 0.0) or 0.0)
        manager.watermark_blocks = int(watermark * num_blocks)
