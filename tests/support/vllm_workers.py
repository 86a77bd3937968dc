"""An engine core's pieces for the run-time resize's tests (`tests/test_vllm_resize.py`,
`tests/test_vllm_engine.py`): its workers (`Workers`: vLLM's own `ExtensibleKVCache` on our
drop-in, host backend, one per rank, behind a `collective_rpc` of the executor's shape), the
scheduler's `KVCacheManager` (`kv_manager`) and requests (`vllm_request`). Needs vLLM with
the plugin registered (its pool then is `ResizableBlockPool`)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["BLOCK", "Core", "Scheduler", "Workers", "kv_manager", "scheduler", "vllm_request"]

BLOCK = 16  # tokens a block


def kv_manager(num_blocks: int, groups: str = "full") -> Any:
    """vLLM's `KVCacheManager` of `num_blocks` blocks, prefix caching on: one full-attention
    group, or (`hybrid`) with a sliding-window one beside it."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    specs = [KVCacheGroupSpec(["full"], full)]
    if groups == "hybrid":
        window = SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=32
        )
        specs.append(KVCacheGroupSpec(["window"], window))
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs)
    return KVCacheManager(
        config,
        max_model_len=4096,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=True,
    )


class Scheduler(SimpleNamespace):
    """The parts of vLLM's `Scheduler` that `KvResizer` and the policies read."""

    def has_requests(self) -> bool:
        return bool(self.waiting or self.running)


def scheduler(num_blocks: int) -> Scheduler:
    """A `Scheduler` stand-in over `kv_manager(num_blocks)`, nothing waiting or running."""
    return Scheduler(
        kv_cache_manager=kv_manager(num_blocks),
        scheduler_config=SimpleNamespace(watermark=0.0),
        cache_config=SimpleNamespace(num_gpu_blocks=num_blocks, block_size=BLOCK),
        block_size=BLOCK,
        waiting=[],
        running=[],
    )


class Core:
    """The engine core's attributes the hook and the policies use (vLLM's needs a model to
    build; weakly referenced, as vLLM's core is)."""

    def __init__(self, **attributes: Any) -> None:
        vars(self).update(attributes)


_ids = iter(range(1 << 30))


def vllm_request(tokens: list[int], max_tokens: int = 4) -> Any:
    """vLLM's `Request` of prompt `tokens`, `max_tokens` greedy tokens, block hashes of
    `BLOCK` tokens."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, eos_token_id=100)
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=tokens,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


class Workers:
    """Workers of one engine, each with vLLM's `ExtensibleKVCache` on our drop-in, and the
    executor's `collective_rpc` over them; `fail_rank`/`fail_at` make one rank's commit fail."""

    def __init__(
        self,
        vllm_cases: Any,
        count: int,
        capacity: int,
        committed: int,
        *,
        export_handle_types: int = 0,
    ) -> None:
        from vllm.utils import extensible_tensor
        from vllm.v1.worker import extensible_kv_cache
        from vllm.v1.worker.utils import allocate_kv_cache

        case = vllm_cases.CASES[0]
        device = torch.device("cpu")
        granule = extensible_tensor.granule_size("cpu")
        self.workers = []
        for _ in range(count):
            config = vllm_cases.kv_cache_config(case, capacity, granule)
            kv = extensible_kv_cache.ExtensibleKVCache(
                config, device, vllm_cases.layout(case), export_handle_types
            )
            allocate_kv_cache(config, device, vllm_cases.layout(case), allocate=kv.allocate)
            kv.commit(committed)
            runner = SimpleNamespace(extensible_kv_cache=kv)
            self.workers.append(SimpleNamespace(model_runner=runner))
        self.fail_rank: int | None = None
        self.fail_at: int | None = None
        self.calls = 0

    def kv(self, rank: int) -> Any:
        return self.workers[rank].model_runner.extensible_kv_cache

    def rpc(self, fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> list[Any]:
        self.calls += 1
        results = []
        for rank, worker in enumerate(self.workers):
            if rank == self.fail_rank and args and args[0] == self.fail_at:
                raise MemoryError(f"rank {rank}: out of memory")  # after the ranks before
            results.append(fn(worker, *args))
        return results

    def stamp(self, num_blocks: int) -> None:
        for rank in range(len(self.workers)):
            buffer = self.kv(rank).buffer
            for segment, size in enumerate(buffer.segment_bytes):
                view = buffer.segment_view(segment)[: min(size, num_blocks * 64)]
                view.copy_(torch.arange(view.numel(), dtype=torch.int32).to(torch.uint8) ^ rank)

    def stamped(self, num_blocks: int) -> bool:
        for rank in range(len(self.workers)):
            buffer = self.kv(rank).buffer
            for segment, size in enumerate(buffer.segment_bytes):
                view = buffer.segment_view(segment)[: min(size, num_blocks * 64)]
                want = torch.arange(view.numel(), dtype=torch.int32).to(torch.uint8) ^ rank
                if not torch.equal(view, want):
                    return False
        return True

    def committed(self) -> list[int]:
        return [self.kv(rank).num_committed_blocks for rank in range(len(self.workers))]
