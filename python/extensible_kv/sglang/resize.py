"""Run-time resize of a live SGLang KV pool, through SGLang's own objects (design.md §8b).

SGLang keeps the pool's size in three places: the KV pool (`size`, and the post-capture
arena our owner backs), its token allocator (`size`, `num_pages` for a paged one, and the
free page ids `alloc` slices and `free` concatenates), and the scheduler's
`max_total_num_tokens`. `resize` changes all three together, between scheduler steps, on the
scheduler's thread (an allocator is not thread-safe: call it from where the scheduler runs,
e.g. an idle-loop hook). It needs no change to SGLang's code, but it reads the allocator's
free lists, which differ per allocator class: the token allocator (page size 1) and the
paged one are handled; the sliding-window, hybrid and unified allocators are refused.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from extensible_kv import _args
from extensible_kv._native import UnsupportedError
from extensible_kv.sglang.owner import KvVmmBufferOwner

__all__ = ["resize"]

logger = logging.getLogger("sglang.extensible_kv")

_HANDLED = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")


def resize(allocator: Any, num_tokens: int, *, scheduler: Any = None) -> int:
    """Resizes the KV pool behind SGLang's `allocator` to `num_tokens` slots; returns the
    physical bytes backing it after.

    A grow backs the new slots (our owner commits them; the addresses never move, so CUDA
    graphs captured before stay valid) and appends their page ids to the allocator's free
    list. A shrink needs every page past the new size free (freed by their requests, and
    evicted from the radix cache): those page ids leave the free list, then the memory past
    them goes back, keeping every token below. Otherwise `RuntimeError` says how many pages
    are held, and nothing has changed. `scheduler`, when given, gets the new
    `max_total_num_tokens`.

    `TypeError` for a non-int, `ValueError` for a size that is not a whole number of pages,
    below one page, or past the reservation; `UnsupportedError` for an allocator or pool
    this does not handle (only pools whose arena is ours)."""
    num_tokens = _args.size(num_tokens, "num_tokens")
    kind = type(allocator).__name__
    if kind not in _HANDLED:
        raise UnsupportedError(
            f"resize handles SGLang's {' and '.join(_HANDLED)}, not {kind}: its free lists "
            "are kept differently (design.md §8b)"
        )
    pool = allocator.get_kvcache()
    owner = getattr(pool, "_post_capture_owner", None)
    if not isinstance(owner, KvVmmBufferOwner):
        raise UnsupportedError(
            f"the pool {type(pool).__name__} is not backed by extensible-kv's arena (is the "
            "plugin on, and the pool built with SGLang's post-capture sizing?)"
        )
    page = int(allocator.page_size)
    if num_tokens % page or num_tokens < page or num_tokens > owner.reserved_num_tokens:
        raise ValueError(
            f"num_tokens {num_tokens} must be a multiple of the page size {page}, from {page} "
            f"to the {owner.reserved_num_tokens} tokens reserved"
        )
    if allocator.free_group is not None:
        raise RuntimeError("cannot resize inside a free group: call between scheduler steps")
    import torch

    old_pages, new_pages = int(allocator.size) // page, num_tokens // page
    allocator.merge_and_sort_free()  # every free page id in free_pages, sorted
    free = allocator.free_pages
    if new_pages > old_pages:
        pool.finalize_backing(SimpleNamespace(max_total_num_tokens=num_tokens))
        new_ids = torch.arange(old_pages + 1, new_pages + 1, dtype=free.dtype, device=free.device)
        allocator.free_pages = torch.cat((free, new_ids))
    elif new_pages < old_pages:
        past = free > new_pages
        held = (old_pages - new_pages) - int(past.sum())
        if held:
            raise RuntimeError(
                f"cannot shrink the KV pool to {num_tokens} tokens: {held} of the pages past "
                "it are held (by requests or the radix cache); free them and retry. Nothing "
                "changed"
            )
        pool.finalize_backing(SimpleNamespace(max_total_num_tokens=num_tokens))  # waits for it
        allocator.free_pages = free[~past]
    allocator.size = num_tokens
    if hasattr(allocator, "num_pages"):
        allocator.num_pages = new_pages
    if scheduler is not None:
        scheduler.max_total_num_tokens = num_tokens
    logger.info(
        "Resized SGLang KV pool from %d to %d tokens (%.3f GiB backed)",
        old_pages * page,
        num_tokens,
        owner.backed_bytes / (1 << 30),
    )
    return int(owner.backed_bytes)
