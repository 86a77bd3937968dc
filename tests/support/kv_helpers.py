"""Helpers shared by the layout, Mamba and KV cache tests.

Blocks are only ever touched below the committed count: on the host backend an uncommitted
touch is a SIGSEGV that kills the test process, so a passing write proves the bytes were
committed. Values written are small integers, exact in every dtype used (uint8, bf16, fp32).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from extensible_kv.kv_cache import ExtensibleKVCache

from support.devices import CPU_GRANULARITY


def cache_kwargs(device: str) -> dict[str, Any]:
    """Constructor kwargs: the device, and on cpu a 4 KiB granularity to keep tests small."""
    return {"device": device, "granularity": CPU_GRANULARITY if device == "cpu" else None}


MakeCache = Callable[..., ExtensibleKVCache]


def cache_factory(device: str) -> Iterator[MakeCache]:
    """Body of a `make_cache` fixture: `make_cache(spec, capacity_blocks, **kw)` on `device`;
    every cache is closed at teardown, so no test leaves memory mapped (views a failed test's
    traceback still holds release theirs when they die)."""
    made: list[ExtensibleKVCache] = []

    def make(spec: Any, capacity_blocks: int, **kw: Any) -> ExtensibleKVCache:
        cache = ExtensibleKVCache(spec, capacity_blocks, **{**cache_kwargs(device), **kw})
        made.append(cache)
        return cache

    yield make
    for cache in made:
        try:
            cache.close()
        except BufferError:  # a failed test's traceback holds views; they free the memory
            pass


def pattern(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: Any) -> torch.Tensor:
    """Deterministic non-zero small integers (1..97), different for different seeds."""
    n = 1
    for size in shape:
        n *= size
    values = (torch.arange(n, dtype=torch.int64) * 7 + seed * 13) % 97 + 1
    return values.reshape(shape).to(dtype).to(device)


def blocks(view: torch.Tensor, block_dim: int, first: int, count: int = 1) -> torch.Tensor:
    """Blocks `[first, first + count)` of a view, as a view."""
    return view.narrow(block_dim, first, count)


def byte_sum(t: torch.Tensor) -> int:
    """Sum of the bytes of `t`: compares where bytes went without caring about dtypes."""
    return int(t.contiguous().view(torch.uint8).sum(dtype=torch.int64))


def committed_byte_sum(cache: ExtensibleKVCache) -> int:
    """Sum of every committed byte of every buffer, read through exact-storage views."""
    total = 0
    for buffer in cache.buffers:
        for index in range(buffer.num_segments):
            total += byte_sum(buffer.segment_view(index))
    return total


def layer_views(cache: ExtensibleKVCache) -> list[tuple[str, int, torch.Tensor]]:
    """`(layer, block_dim, view)` for every attention view and every Mamba state view."""
    out = []
    for name, views in cache.views.items():
        for view in views if isinstance(views, list) else [views]:
            out.append((name, cache.block_dims[name], view))
    return out
