"""Pool members in one process for the pool's tests (`tests/test_pool_*.py`): a small host
cache (one granule a block), members over caches with their used blocks, and the check that a
member's entry in the ledger says what its cache holds."""

from __future__ import annotations

from typing import Any

import torch
from extensible_kv import AttentionLayerSpec, ExtensibleKVCache, KVCacheTensorSpec
from extensible_kv.pool import Ledger, Pool, PoolMember, rules

GRANULE = 4096
BLOCK_BYTES = 2 * GRANULE  # K and V, a granule each
SPEC = (
    KVCacheTensorSpec(
        2 * GRANULE, {"attn": AttentionLayerSpec("FLASH_ATTN", 32, 2, 32, torch.bfloat16)}
    ),
)


def cache(capacity: int = 64, **kw: Any) -> ExtensibleKVCache:
    kw = {"export_handle_types": "posix_fd", **kw}
    return ExtensibleKVCache(SPEC, capacity, "cpu", granularity=GRANULE, **kw)


def member(
    pool: Pool, name: str, c: ExtensibleKVCache, used: dict[str, int], **kw: Any
) -> PoolMember:
    """A member over `c`, 4 to 64 blocks, committing 4 at a time, its blocks past
    `used[name]` free."""
    kw = {"min_blocks": 4, "max_blocks": 64, "commit_step_blocks": 4, **kw}
    return PoolMember(pool, name, c, free_tail_blocks=lambda: c.committed_blocks - used[name], **kw)


def holdings(c: ExtensibleKVCache) -> dict[str, int]:
    """What cache `c` holds, as a member posts it."""
    return {
        "committed_blocks": c.committed_blocks,
        "physical_bytes": c.physical_bytes,
        "lent_bytes": sum(t.lent_bytes for t in c.buffers),
        "borrowed_bytes": sum(t.borrowed_bytes for t in c.buffers),
    }


def check_holdings(ledger: Ledger, members: dict[str, PoolMember]) -> None:
    """The ledger is consistent and each member's entry says what its cache holds."""
    assert rules.check(ledger) == [], (rules.check(ledger), ledger.loans)
    for name, m in members.items():
        entry = ledger.engines[name]
        said = {key: getattr(entry, key) for key in holdings(m.cache)}  # type: ignore[arg-type]
        assert said == holdings(m.cache), (name, said, holdings(m.cache))  # type: ignore[arg-type]
