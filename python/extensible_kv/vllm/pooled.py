"""A vLLM engine core in the node pool (`EXTENSIBLE_KV_POOL=name`, design §8b and §11): its KV
cache as a pool member drives it (`EngineCache`, a `PoolCache`), and the membership on the
core's step boundaries (`PooledPolicy`, which `extensible_kv.vllm.engine.StepHook` runs).

**One GPU.** A loan's memory is mapped where the cache lives, and the scheduler's pool must
change with it in the same step: the engine core's worker must run in the core's process,
beside the scheduler (vLLM's `uni` executor, one GPU). An engine of several ranks is refused
with a message (every rank would lend and borrow in step; not built).

**The cache as the pool sees it** (`EngineCache`): the worker's `ExtensibleKVCache` (vLLM's,
on our drop-in), one buffer whose segments all grow by the same block stride, block 0 vLLM's
null block. Every change keeps the scheduler's `ResizableBlockPool` true, as transformers'
pooled cache keeps transformers' pool: blocks leave the pool before their memory is unmapped
(lent, given back, shrunk: all of them must be free, prefix-cached ones evicted; else a
`ValueError` and nothing changes), and join it once mapped (committed, borrowed, reclaimed);
the worker's count and the per-layer views vLLM binds over the committed blocks follow each
change (`Worker.extend_kv_cache`: same addresses, CUDA graphs stay valid).

**Serving** (`PooledPolicy`): before each step the member serves (the heartbeat, a donor's
answers, the borrower's takes), busy while the scheduler has unfinished requests, and asks
the pool for what the waiting requests need (prompt plus `max_tokens` each, in its blocks)
when the scheduler cannot admit them: one ask for the queue, answered while other requests
run. While idle, the hook wakes the core every `IDLE_SERVE_S` to serve. It serves with
batches in flight too (under async scheduling the queue is never empty while busy): a move
that unmaps (a lend, a give-back, a shrink) first takes the blocks out of the scheduler's
pool (all free: no later batch names them) and synchronizes the device (every batch in
flight is launched by then: one GPU, the worker on the core's thread).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from extensible_kv._native import UnsupportedError
from extensible_kv.ipc import Loan
from extensible_kv.pool.store import Pool
from extensible_kv.shape import BufferShape, CacheShape
from extensible_kv.tensor import ExtensibleTensor, borrow_dealt, give_back_dealt
from extensible_kv.vllm.commit import commit_keeping_data
from extensible_kv.vllm.resize import KvResizer, worker_kv_cache

__all__ = [
    "IDLE_SERVE_S",
    "POOL_ENV_VAR",
    "POOL_MAX_ENV_VAR",
    "POOL_MIN_ENV_VAR",
    "EngineCache",
    "PoolSettings",
    "PooledPolicy",
]

POOL_ENV_VAR = "EXTENSIBLE_KV_POOL"
POOL_MIN_ENV_VAR = "EXTENSIBLE_KV_POOL_MIN"
POOL_MAX_ENV_VAR = "EXTENSIBLE_KV_POOL_MAX"
IDLE_SERVE_S = 0.005  # an idle engine serves at least this often
LEAVE_S = 10.0

logger = logging.getLogger("vllm.extensible_kv")


@dataclass(frozen=True)
class PoolSettings:
    """`EXTENSIBLE_KV_POOL=name`, with its limits (`EXTENSIBLE_KV_POOL_MIN`, `_MAX`: the
    engine's blocks, or bytes with a unit: `2GiB`); None where not given."""

    pool: Pool | str  # a pool's name (the environment's), or a `Pool`
    min_blocks: int | None = None
    max_blocks: int | None = None
    min_bytes: int | None = None
    max_bytes: int | None = None

    @classmethod
    def from_environ(cls, environ: Any = None) -> PoolSettings | None:
        """From `environ` (default `os.environ`): None without `EXTENSIBLE_KV_POOL`; a
        `ValueError` naming the variable for a limit it cannot read."""
        from extensible_kv.pool.cli import parse_limit

        environ = os.environ if environ is None else environ
        name = environ.get(POOL_ENV_VAR, "").strip()
        if not name:
            return None
        limits: dict[str, int] = {}
        for var, which in ((POOL_MIN_ENV_VAR, "min"), (POOL_MAX_ENV_VAR, "max")):
            text = environ.get(var, "").strip()
            if not text:
                continue
            try:
                unit, value = parse_limit(text)
            except Exception as error:  # argparse's ArgumentTypeError
                raise ValueError(f"{var}={text!r}: {error}") from None
            limits[f"{which}_{unit}"] = value
        return cls(name, **limits)


class EngineCache:
    """The engine core's KV cache as `PoolMember` drives it (see the module's docstring).
    `worker` is the core's one worker (`model_executor.driver_worker`); `resizer` the core's
    `KvResizer`. Call it only on the core's thread, with no batch in flight."""

    legacy = False

    def __init__(self, worker: Any, resizer: KvResizer) -> None:
        kv = worker_kv_cache(worker)
        strides = set(kv.segment_strides)
        if len(strides) != 1:
            raise UnsupportedError(
                "the KV cache's segments grow by different block strides "
                f"({sorted(strides)} bytes): a pool member's segments must grow alike"
            )
        self._worker = worker
        self._kv = kv
        self._stride: int = int(strides.pop())
        self._tensor: ExtensibleTensor = kv.buffer._open()
        self._resizer = resizer
        # Where each loan this cache borrowed begins, in its blocks: a give-back cuts there.
        self._borrowed_at: dict[tuple[int, int, int], int] = {}

    # ---- what the flow and the member read -----------------------------------------------
    @property
    def buffers(self) -> tuple[ExtensibleTensor, ...]:
        return (self._tensor,)

    @property
    def capacity_blocks(self) -> int:
        return int(self._kv.capacity_blocks)

    @property
    def committed_blocks(self) -> int:
        return int(self._kv.num_committed_blocks)

    @property
    def physical_bytes(self) -> int:
        return int(self._tensor.physical_bytes)

    @property
    def num_handles(self) -> int:
        return int(self._tensor.num_handles)

    def shape(self) -> CacheShape:
        tensor = self._tensor
        return CacheShape(
            tensor.device, tensor.granularity, (BufferShape(tensor.num_segments, self._stride),)
        )

    def free_tail_blocks(self) -> int:
        """The top blocks no request holds (free, or cached for prefix sharing only)."""
        pool = self._resizer.pool
        return max(0, pool.num_gpu_blocks - 1 - pool.highest_block_in_use())

    def on_resize(self, committed_blocks: int) -> None:
        """The scheduler's pool holds every committed block (each change keeps it so)."""
        pool = self._resizer.pool
        if pool.num_gpu_blocks != committed_blocks:
            raise RuntimeError(
                f"the scheduler's pool has {pool.num_gpu_blocks} blocks, the cache "
                f"{committed_blocks}"
            )

    # ---- changes ---------------------------------------------------------------------------
    def commit(self, num_blocks: int) -> None:
        """Grows the cache and the scheduler's pool to `num_blocks` (a no-op below)."""
        if num_blocks > self.committed_blocks:
            self._resizer.resize(num_blocks)

    def shrink_to(self, num_blocks: int, *, exact: bool = False) -> None:
        """Gives the memory past `num_blocks` back to the driver (its blocks all free, else a
        `ValueError` and nothing changes)."""
        if num_blocks >= self.committed_blocks:
            return
        self._take_out(num_blocks, "shrink")
        try:
            _synchronize(self._tensor)
            self._set_worker(num_blocks, commit=True)
        except BaseException:
            self._hand_in(self.committed_blocks)
            raise

    def wait_released(self, timeout: float | None = None) -> bool:
        return bool(self._tensor.wait_released(timeout))

    def lend(self, num_blocks: int, *, stream: int | None = None) -> tuple[Loan, ...]:
        """Keeps `num_blocks` blocks and lends the handles past them (all free: a
        `ValueError` otherwise, nothing lent)."""
        self._check_kept(num_blocks)
        self._take_out(num_blocks, "lend")
        try:
            _synchronize(self._tensor)  # the last steps' kernels may still read them
            loan = self._tensor.lend(num_blocks * self._stride, stream=stream)
        except BaseException:
            self._hand_in(self.committed_blocks)
            raise
        self._set_worker(self._held())
        return (loan,)

    def lend_sizes(self, num_blocks: int) -> list[int]:
        self._check_kept(num_blocks)
        return [granules for _, granules in self._tensor._lend_runs(num_blocks * self._stride)]

    def borrow(self, loans: Sequence[Loan], *, zero: bool = True, stream: int | None = None) -> int:
        """Maps loans of a cache of any model (same device and granularity) past the
        committed blocks, which grow by the blocks that memory holds; the scheduler's pool
        grows with them. Handles it cannot use go back to their lender at once."""
        loans = tuple(loans)
        start = self.committed_blocks
        blocks = borrow_dealt(
            (self._tensor,),
            (self._stride,),
            loans,
            zero=zero,
            stream=stream,
            max_blocks=self.capacity_blocks - start,
        )
        _synchronize(self._tensor)  # zeroed before the model's stream uses it
        for loan in loans:
            self._borrowed_at[loan.key] = start
        self._set_worker(self._held())
        self._hand_in(self.committed_blocks)
        return blocks

    def give_back(self, loans: Sequence[Loan], *, stream: int | None = None) -> None:
        """Returns borrowed loans: the blocks from where the first of them began must be free
        (a `ValueError` otherwise, nothing given back)."""
        loans = tuple(loans)
        starts = [self._borrowed_at.get(loan.key) for loan in loans]
        if not loans or None in starts or len({loan.key for loan in loans}) != len(loans):
            raise ValueError("this cache did not borrow those loans (or lists one twice)")
        start = min(s for s in starts if s is not None)
        self._take_out(start, "give back")
        try:
            _synchronize(self._tensor)
            give_back_dealt((self._tensor,), (self._stride,), loans, stream=stream)
        except BaseException:
            self._hand_in(self.committed_blocks)
            raise
        for loan in loans:
            del self._borrowed_at[loan.key]
        self._set_worker(self._held())
        self._hand_in(self.committed_blocks)

    def reclaim(
        self,
        loans: Sequence[Loan],
        *,
        zero: bool = True,
        timeout: float | None = None,
        stream: int | None = None,
    ) -> None:
        loans = tuple(loans)
        if len(loans) != 1:
            raise ValueError(f"{len(loans)} loans for a cache of one buffer")
        self._tensor.reclaim(loans[0], zero=zero, timeout=timeout, stream=stream)
        _synchronize(self._tensor)
        self._set_worker(self._held())
        self._hand_in(self.committed_blocks)

    # ---- the scheduler's pool and the worker ----------------------------------------------
    def _check_kept(self, num_blocks: int) -> None:
        least = int(self._kv.min_committed_blocks)
        if not least <= num_blocks < self.committed_blocks:
            raise ValueError(
                f"cannot keep {num_blocks} blocks and lend the rest: {self.committed_blocks} "
                f"are committed, and vLLM keeps at least {least}"
            )

    def _take_out(self, num_blocks: int, what: str) -> None:
        """The scheduler's pool ends at `num_blocks` (every block past it free: evicted if
        cached), or a `ValueError` and the pool as it was."""
        pool = self._resizer.pool
        if pool.shrinking_to is not None:
            raise ValueError(f"cannot {what}: a shrink of the scheduler's pool is in progress")
        if num_blocks >= pool.num_gpu_blocks:
            return
        pool.begin_shrink(num_blocks)
        if not pool.drained:
            pool.cancel_shrink()
            raise ValueError(f"cannot {what} past block {num_blocks}: requests hold blocks past it")
        pool.finish_shrink()
        self._resizer.sync_counts()

    def _hand_in(self, num_blocks: int) -> None:
        """The scheduler's pool grows to `num_blocks` (the blocks past it mapped already)."""
        pool = self._resizer.pool
        if num_blocks > pool.num_gpu_blocks:
            pool.grow(num_blocks)
            self._resizer.sync_counts()

    def _held(self) -> int:
        held: int = min(self._tensor.segment_bytes) // self._stride
        return held

    def _set_worker(self, num_blocks: int, *, commit: bool = False) -> None:
        """The worker's count is `num_blocks` (what its tensor maps now, or, with `commit`,
        what it shrinks to, keeping the blocks below) and vLLM rebinds its views."""
        kv = self._kv
        if commit:
            commit_keeping_data(kv, num_blocks, shrink=True)
        kv.num_committed_blocks = num_blocks
        extend = getattr(self._worker, "extend_kv_cache", None)
        if extend is not None:
            extend(num_blocks)


def _synchronize(tensor: ExtensibleTensor) -> None:
    if tensor.device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(torch.device(tensor.device))


class PooledPolicy:
    """The pool membership of one engine core, on its step boundaries (the hook's policy:
    see the module's docstring). Joins as it is made; `leave()` as the core ends."""

    def __init__(
        self, core: Any, resizer: KvResizer, settings: PoolSettings, *, engine: str | None = None
    ) -> None:
        from extensible_kv.pool.member import PoolMember

        executor = core.model_executor
        worker = getattr(executor, "driver_worker", None)
        world = getattr(getattr(core, "vllm_config", None), "parallel_config", None)
        if worker is None or getattr(world, "world_size", 1) != 1:
            raise UnsupportedError(
                "a vLLM engine joins the node pool with one GPU only (the uni executor: its "
                "worker beside the scheduler); this one has several ranks"
            )
        if any(w.connector for w in resizer.workers()):
            raise UnsupportedError(
                "a KV connector registered the worker's KV cache memory at its size: an engine "
                "with one does not join the node pool"
            )
        self.resizer = resizer
        self.scheduler = core.scheduler
        self.cache = EngineCache(worker, resizer)
        name = engine or f"vllm-{os.getpid()}"
        self.member = PoolMember(
            settings.pool,
            name,
            self.cache,  # type: ignore[arg-type]
            min_blocks=settings.min_blocks
            if settings.min_blocks is not None or settings.min_bytes is not None
            else int(self.cache._kv.min_committed_blocks),
            max_blocks=settings.max_blocks,
            min_bytes=settings.min_bytes,
            max_bytes=settings.max_bytes,
        )
        self.member.join()
        self.asked_to = 0
        self.failures = 0
        logger.info(
            "extensible-kv: the KV cache joined pool %s as %s: %d blocks, %d to %d.",
            self.member.pool.name,
            name,
            self.cache.committed_blocks,
            self.member.min_blocks,
            self.member.max_blocks,
        )

    # ---- what the hook asks ----------------------------------------------------------------
    def wants_drain(self) -> bool:
        """A shrink of the resizer's ending (the member's own moves synchronize the device
        instead: see `EngineCache`)."""
        return self.resizer.drained

    def next_idle_call(self) -> float | None:
        return IDLE_SERVE_S

    def before_step(self, *, in_flight: bool) -> None:
        if self.resizer.shrinking_to is not None and not in_flight:
            self.resizer.poll()
        unfinished = getattr(self.scheduler, "has_unfinished_requests", None)
        busy = bool(unfinished() if unfinished else self.scheduler.has_requests())
        # In flight too: every move that unmaps synchronizes the device first (the batches
        # in flight are launched by now: one GPU, the worker on this thread), and the blocks
        # it unmaps are free in the scheduler, so no later batch names them.
        self.member.serve(busy=busy)
        self._ask()

    def idle(self) -> None:
        self.before_step(in_flight=False)

    def leave(self) -> None:
        self.member.leave(timeout_s=LEAVE_S)

    def sleep_refusal(self) -> str | None:
        return (
            f"this engine is in node pool {self.member.pool.name} (EXTENSIBLE_KV_POOL): its "
            "KV memory is lent and borrowed, and does not go to sleep; start it without the "
            "pool to use sleep mode"
        )

    def _ask(self) -> None:
        """Asks the pool for the waiting requests' need when the scheduler cannot admit them
        (once for the queue: a later ask only when it needs more)."""
        need = self.resizer.waiting_need()
        if not need:
            self.asked_to = 0
            return
        free = self.resizer.free_blocks
        if free >= need:
            return
        target = self.cache.committed_blocks + need - free
        if self.member.asking and target <= self.asked_to:
            return
        self.asked_to = target
        self.member.request(target - self.cache.committed_blocks, since=time.monotonic())
