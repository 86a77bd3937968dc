"""A node-local memory pool for several engines on one device, with no daemon
(docs/design.md §11).

The pool is a ledger in shared memory (`Pool`): one entry per engine (its process, its cache's
shape, limits and holdings), the loans in flight (`PoolLoan`, in a `LoanState`), and the cap
on the bytes the pool may hold on each device. It counts in bytes across engines of different
models (each engine's own blocks beside them), and lends between any engines of one device and
granularity. It
lives under a lock that the kernel drops when its holder dies, is replaced whole on every
change, and is recovered by whoever takes the lock next: a dead engine leaves, its loans return
to their lenders (`extensible_kv.pool.rules`). The policy (`extensible_kv.pool.policy`) is pure
functions of the ledger. An engine takes part through a `PoolMember` over its cache (a
`PoolCache`: an `ExtensibleKVCache`, or transformers' through
`extensible_kv.transformers.enable(pool=...)`): it joins, calls `serve()` between its steps,
and asks for what its waiting requests need with `grow(n)`, `request(n)` or
`request_bytes(n)`, answered from free memory and every donor at once (each ask and its wait
kept in `PoolMember.asks`); memory moves as loans of whole handles (`ExtensibleKVCache.lend` /
`borrow`), or through the driver (`via="driver"`); a member whose cache moves live blocks down
(a `MovingCache`, `move=True`) lends its free blocks wherever they lie.

The ledger lives in a directory of its own in shared memory, this user's alone unless the
pool is given a group (`Pool(name, group=...)`, `$EXTENSIBLE_KV_POOL_GROUP`): another user's
pool, or a path in it that is not what the pool made, is a `PoolPermissionError`
(`extensible_kv.pool.store`).

`python -m extensible_kv pool status|limit|cap|watch|reset` reads and changes it (`share`, the
old name of `cap`, is deprecated; so are `LoanEntry`, now `PoolLoan`, and `Pool.set_share`).
"""

from typing import Any

from extensible_kv.pool.asks import Ask
from extensible_kv.pool.caches import MovingCache, PoolCache
from extensible_kv.pool.ledger import (
    Engine,
    Ledger,
    LedgerCorruptError,
    LedgerVersionError,
    LoanState,
    PoolLoan,
)
from extensible_kv.pool.member import PoolMember
from extensible_kv.pool.policy import Action, Decision
from extensible_kv.pool.store import Pool, PoolLockTimeout, PoolPermissionError

__all__ = [
    "Action",
    "Ask",
    "Decision",
    "Engine",
    "Ledger",
    "LedgerCorruptError",
    "LedgerVersionError",
    "LoanState",
    "MovingCache",
    "Pool",
    "PoolCache",
    "PoolLoan",
    "PoolLockTimeout",
    "PoolMember",
    "PoolPermissionError",
]


def __getattr__(name: str) -> Any:
    from extensible_kv.pool.ledger import deprecated_name

    return deprecated_name(__name__, name)
