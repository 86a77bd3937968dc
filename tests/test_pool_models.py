"""Engines of different models in one pool (issue 52).

- `test_the_pool_cap_counts_the_granules_a_commit_maps` (xfail, a library bug): a commit of
  free memory within the pool's cap is counted in blocks, but a block that ends inside a
  granule maps the whole granule, in every segment: the pool then holds more than its cap.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from extensible_kv import AttentionLayerSpec, ExtensibleKVCache, KVCacheTensorSpec
from extensible_kv.pool import Pool, PoolMember, rules

GRANULE = 4096


@pytest.mark.xfail(
    strict=True,
    reason="pool bug: policy._free_blocks and rules.commit_ahead count a commit within the cap "
    "as blocks x block bytes, while the cache maps whole granules in each segment",
)
def test_the_pool_cap_counts_the_granules_a_commit_maps(tmp_path: Path) -> None:
    """A flat cache of 6,144-byte blocks (a granule and a half) with 5 blocks of room under the
    cap: the pool commits 5 blocks, which map 8 granules (32,768 bytes), 2,048 over the cap of
    30,720. The pool should commit only what maps within the cap (4 blocks: 6 granules)."""
    pool = Pool("t", directory=tmp_path)
    cap = 5 * 6144
    pool.set_cap("cpu", cap)
    layer = AttentionLayerSpec("FLASHINFER", 16, 3, 32, torch.bfloat16)  # 6,144 B a block
    cache = ExtensibleKVCache(
        (KVCacheTensorSpec(6144, {"attn": layer}),),
        64,
        "cpu",
        granularity=GRANULE,
        export_handle_types="posix_fd",
    )
    member = PoolMember(
        pool,
        "a",
        cache,
        min_blocks=0,
        max_blocks=64,
        free_tail_blocks=lambda: cache.committed_blocks,
    )
    member.join()
    try:
        member.request(5)
        ledger = pool.snapshot()
        assert ledger.engines["a"].physical_bytes == cache.physical_bytes
        assert rules.used_bytes(ledger, "cpu") <= cap, (
            f"{cache.committed_blocks} blocks map {cache.physical_bytes} B, cap {cap} B"
        )
    finally:
        member.leave(5.0)
        cache.close()
