"""vLLM 0.34's `ExtensibleKVCache.commit`, keeping the live blocks (`commit_keeping_data`): the
plugin puts it in place with `EXTENSIBLE_KV_VLLM_KEEP_DATA=1`, and the run-time resize
(`extensible_kv.vllm.resize`) commits every worker through it."""

from __future__ import annotations

import logging
from typing import Any

from extensible_kv import _args

__all__ = ["commit_keeping_data"]

logger = logging.getLogger("vllm.extensible_kv")


def commit_keeping_data(
    self: Any, num_blocks: int, defragment: bool = False, shrink: bool = False
) -> None:
    """vLLM 0.34's `ExtensibleKVCache.commit`, keeping the live blocks: a shrink gives back
    the memory past the count in place, and a defragment consolidates (one allocation per
    segment, contents and addresses kept), where vLLM's releases everything and re-grows
    zeroed. New blocks are zeroed, as in vLLM.

    It ends at the count vLLM's would, for every `defragment` and `shrink`: vLLM's remaps
    (release, then grow from 0) when `shrink` and the count is below the committed one, or
    when `defragment` and its own test says the count's bytes are not one chunk per segment
    (asked before anything changes, as vLLM does); a remap ends at the count, anything else
    never goes below the committed count. Blocks below both counts keep their contents.

    A negative `num_blocks` is a ValueError (vLLM's would release everything on a shrink), a
    non-integer a TypeError, before anything changes."""
    num_blocks = min(_args.size(num_blocks, "num_blocks"), self.capacity_blocks)
    defragment = _args.flag(defragment, "defragment")
    shrink = _args.flag(shrink, "shrink")
    sizes = [num_blocks * stride for stride in self.segment_strides]
    remap = (defragment and not all(self.buffer.segments_backed_by_one_chunk(sizes))) or (
        shrink and num_blocks < self.num_committed_blocks
    )
    target = num_blocks if remap else max(num_blocks, self.num_committed_blocks)
    sizes = [target * stride for stride in self.segment_strides]
    if target < self.num_committed_blocks:
        # Released (asleep), a segment holds less than the count says: nothing to give back.
        held = self.buffer.segment_bytes
        self.buffer.shrink_segments_([min(h, s) for h, s in zip(held, sizes, strict=True)])
    if remap or target > self.num_committed_blocks:
        # A no-op where every segment holds its size already; else new blocks, zeroed (all
        # of them when asleep, as vLLM's remap).
        self.buffer.resize_segments_(sizes, zero_new=True)
    self.num_committed_blocks = target
    if defragment and not all(self.buffer.segments_backed_by_one_chunk(sizes)):
        self.buffer.consolidate()
    logger.debug(
        "Committed %d of %d KV cache blocks (%.2f GiB physical, contents kept).",
        self.num_committed_blocks,
        self.capacity_blocks,
        self.physical_bytes / (1 << 30),
    )
