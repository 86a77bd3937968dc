"""transformers' pooled cache (`SectorCache`) lends to and borrows from caches of other models
(issue 52): a Llama-like and a sliding-window Qwen2-like engine, whose sectors differ in
bytes, each borrow the other's memory in their own sectors; a flat sector cache and an
`ExtensibleKVCache` K/V split (2 segments) borrow from each other both ways. transformers'
pool follows every change (its free sectors, its size), and the lender gets its memory back
exactly. Host backend, in one process (the processes and the pool: test_pool_transformers.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from extensible_kv import AttentionLayerSpec, ExtensibleKVCache, KVCacheTensorSpec, blocks_from
from support import transformers_fixtures

G = 4096

# The fixtures every transformers test module shares (`support.transformers_fixtures`).
disabled_after = transformers_fixtures.disabled_after
tf = transformers_fixtures.tf


def sector_caches(tf: Any, tmp_path: Path, *kinds: str) -> list[Any]:
    """A warmed-up pooled manager's `SectorCache` per model kind, 2 sectors committed."""
    import test_transformers as tt
    from extensible_kv import transformers as ekt
    from extensible_kv.pool import Pool
    from extensible_kv.transformers.pooled import SectorCache

    options = {"min_blocks": 2, "max_blocks": 40, "pool_step_blocks": 4, "budget_bytes": 1 << 20}

    def model(kind: str) -> Any:
        if kind != "llama3":
            return tt.build_model(tf, kind, "sdpa", "cpu")
        # 3 layers: a sector of 12,288 bytes, 3 granules (the 2-layer ones take 8,192).
        torch.manual_seed(0)
        config = tf.LlamaConfig(num_hidden_layers=3, **tt.COMMON)
        built = tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        return built.to(dtype=torch.float32).eval()

    with ekt.enabled(pool=Pool("sb", directory=tmp_path), granularity=G, **options):
        managers = [tt.warmed_up(tf, model(kind)) for kind in kinds]
    return [SectorCache(m.batch_processor.cache) for m in managers]


def pool_of(cache: Any) -> Any:
    return cache._cache.pool


def check_pool(cache: Any) -> None:
    """transformers' pool holds exactly the committed sectors, all free here."""
    from extensible_kv.transformers.cache import TRASH_SECTORS

    pool, n = pool_of(cache), cache.committed_blocks
    assert pool.num_sectors == n
    assert sorted(pool.free_sectors) == list(range(TRASH_SECTORS, TRASH_SECTORS + n))


def test_engines_of_two_models_borrow_each_others_memory_in_their_own_sectors(
    tf: Any, tmp_path: Path
) -> None:
    llama, qwen = sector_caches(tf, tmp_path, "llama3", "qwen2")
    sectors = (llama.segment_block_bytes[0], qwen.segment_block_bytes[0])
    assert sectors[0] != sectors[1], sectors
    for lender, borrower in ((qwen, llama), (llama, qwen)):
        size = lender.segment_block_bytes[0]
        # Two commits, each its own handles: a lend past the first lends the second's.
        per_granule = max(1, G // size)
        lender.commit(2 + 4 * per_granule)
        keep = 2
        while keep < lender.committed_blocks and keep not in _points(lender):
            keep += 1
        before = (lender.committed_blocks, lender.physical_bytes, lender.buffers[0].handle_runs())
        sizes = lender.lend_sizes(keep)
        expected = blocks_from(borrower.shape(), sizes)
        assert borrower.shape().leading_blocks == 2
        (loan,) = lender.lend(keep)
        check_pool(lender)
        start = borrower.committed_blocks
        gained = borrower.borrow([loan], zero=True)
        assert gained == expected > 0
        assert borrower.committed_blocks == start + gained
        check_pool(borrower)
        borrower.give_back([loan])
        assert borrower.committed_blocks == start
        check_pool(borrower)
        lender.reclaim([loan], timeout=0)
        assert (
            lender.committed_blocks,
            lender.physical_bytes,
            lender.buffers[0].handle_runs(),
        ) == before
        check_pool(lender)
        lender.shrink_to(2)
        assert lender.wait_released(5)


def _points(cache: Any) -> set[int]:
    """The sector counts a lend may keep: a handle of the flat tensor starts right there."""
    from extensible_kv.transformers.cache import TRASH_SECTORS

    (tensor,), size = cache.buffers, cache.segment_block_bytes[0]
    starts = {first * tensor.granularity for first, _ in tensor.handle_runs()}
    return {
        start // size - TRASH_SECTORS
        for start in starts
        if start % size == 0 and TRASH_SECTORS * size <= start < tensor.segment_bytes[0]
    }


def test_a_flat_sector_cache_and_a_kv_split_borrow_from_each_other(tf: Any, tmp_path: Path) -> None:
    (flat,) = sector_caches(tf, tmp_path, "llama")
    layer = AttentionLayerSpec("FLASH_ATTN", 16, 2, 32, torch.bfloat16)
    split = ExtensibleKVCache(
        [KVCacheTensorSpec(4096, {"attn": layer})],
        256,
        "cpu",
        granularity=G,
        export_handle_types="posix_fd",
    )
    with split:
        assert split.shape().buffers[0].num_segments == 2
        # The K/V split lends: 2 segments' handles into the flat cache's one.
        split.commit(8)
        split.commit(40)
        loans = split.lend(8)
        expected = blocks_from(
            flat.shape(), [h.num_granules for loan in loans for h in loan.handles]
        )
        start = flat.committed_blocks
        assert flat.borrow(loans) == expected > 0
        check_pool(flat)
        flat.give_back(loans)
        assert flat.committed_blocks == start
        check_pool(flat)
        split.reclaim(loans, timeout=0)
        assert split.committed_blocks == 40
        # The flat cache lends: its handles dealt over the split's 2 segments.
        size = flat.segment_block_bytes[0]
        flat.commit(2 + 2 * max(1, G // size))
        flat.commit(2 + 10 * max(1, G // size))
        keep = min(k for k in _points(flat) if k >= 2)
        sizes = flat.lend_sizes(keep)
        (loan,) = flat.lend(keep)
        check_pool(flat)
        gained = split.borrow([loan])
        assert gained == blocks_from(split.shape(), sizes) > 0
        assert split.committed_blocks == 40 + gained
        split.give_back([loan])
        assert split.committed_blocks == 40
        flat.reclaim([loan], timeout=0)
        check_pool(flat)
