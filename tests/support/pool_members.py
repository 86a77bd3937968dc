"""Pool members in one process for the pool's tests (`tests/test_pool_*.py`): a small host
cache (one granule a block per segment, K and V), members over caches with their used blocks
(`member`, `members_of`, `lender_and_borrower`), a cache that moves its live blocks down
(`Moving`), and the check that a member's entry in the ledger says what its cache holds."""

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


def members_of(
    pool: Pool, caches: dict[str, ExtensibleKVCache], used: dict[str, int], **kw: Any
) -> dict[str, PoolMember]:
    """A member over each cache, named as in `caches`, minimum 4 blocks, committing 4 at a
    time, its top blocks past `used[name]` free."""
    return {
        name: PoolMember(
            pool,
            name,
            c,
            **{"min_blocks": 4, "commit_step_blocks": 4, **kw},
            free_tail_blocks=lambda name=name, c=c: c.committed_blocks - used[name],
        )
        for name, c in caches.items()
    }


def lender_and_borrower(
    pool: Pool, ca: ExtensibleKVCache, cb: ExtensibleKVCache, used: dict[str, int]
) -> tuple[PoolMember, PoolMember]:
    """Members a and b joined (up to 64 blocks each), a at 32 blocks of which its first 10
    are live and hold 3s."""
    a, b = members_of(pool, {"a": ca, "b": cb}, used, max_blocks=64).values()
    a.join()
    b.join()
    assert a.grow(32) == 32
    used["a"] = 10
    ca.views["attn"][:, :10].fill_(3)  # type: ignore[call-overload]
    return a, b


class Moving:
    """An `ExtensibleKVCache` with the engine's part of a `MovingCache`: the blocks in `live`
    are the ones requests hold; `move_below` copies each at or past the cut into the lowest
    free block below it, as transformers' pooled cache does, and renames it in `live`."""

    def __init__(self, inner: ExtensibleKVCache) -> None:
        self.inner = inner
        self.live: set[int] = set()
        self.moves: list[tuple[int, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def member(self, pool: Pool, name: str, **kw: Any) -> PoolMember:
        """A member over it, as `members_of`'s (minimum 4 blocks, committing 4 at a time),
        its free top what `live` leaves."""
        return PoolMember(
            pool,
            name,
            self,  # type: ignore[arg-type]
            min_blocks=4,
            max_blocks=64,
            commit_step_blocks=4,
            free_tail_blocks=self.free_tail,
            **kw,
        )

    def hold(self, live: set[int]) -> None:
        """Requests hold blocks `live` now, each block marked with its number plus one."""
        self.live = set(live)
        for block in live:
            self.inner.views["attn"][:, block].fill_(block + 1)  # type: ignore[call-overload]

    def free_tail(self) -> int:
        return self.inner.committed_blocks - (max(self.live, default=-1) + 1)

    def free_blocks(self) -> int:
        return self.inner.committed_blocks - len(self.live)

    def move_below(self, num_blocks: int) -> None:
        above = sorted(b for b in self.live if b >= num_blocks)
        free = [b for b in range(num_blocks) if b not in self.live]
        if len(free) < len(above):
            raise RuntimeError(f"only {len(free)} free blocks below {num_blocks}")
        view = self.inner.views["attn"]
        for old, new in zip(above, free, strict=False):
            view[:, new] = view[:, old]
            self.live = (self.live - {old}) | {new}
            self.moves.append((old, new))
