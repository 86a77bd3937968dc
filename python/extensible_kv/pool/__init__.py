"""A node-local memory pool for several engines on one device, with no daemon
(docs/design.md §11).

The pool is a ledger in shared memory (`Pool`): one entry per engine (its process, device,
limits and holdings), the loans in flight, and the share of each device the pool may use. It
lives under a lock that the kernel drops when its holder dies, is replaced whole on every
change, and is recovered by whoever takes the lock next: a dead engine leaves, its loans return
to their lenders (`extensible_kv.pool.rules`). The policy (`extensible_kv.pool.policy`) is pure
functions of the ledger. An engine takes part through a `PoolMember` over its cache (a
`PoolCache`: an `ExtensibleKVCache`, or transformers' through
`extensible_kv.transformers.enable(pool=...)`): it joins, calls `serve()` between its steps,
and asks with `grow(n)` or `request(n)`; memory moves as loans of whole blocks
(`ExtensibleKVCache.lend` / `borrow`), or through the driver (`via="driver"`); a member whose
cache moves live blocks down (a `MovingCache`, `move=True`) lends its free blocks wherever
they lie.

The ledger lives in a directory of its own in shared memory, this user's alone unless the
pool is given a group (`Pool(name, group=...)`, `$EXTENSIBLE_KV_POOL_GROUP`): another user's
pool, or a path in it that is not what the pool made, is a `PoolPermissionError`
(`extensible_kv.pool.store`).

`python -m extensible_kv pool status|limit|share|watch|reset` reads and changes it.
"""

from extensible_kv.pool.ledger import Engine, Ledger, LedgerCorruptError, LoanEntry
from extensible_kv.pool.member import MovingCache, PoolCache, PoolMember
from extensible_kv.pool.policy import Decision
from extensible_kv.pool.store import Pool, PoolLockTimeout, PoolPermissionError

__all__ = [
    "Decision",
    "Engine",
    "Ledger",
    "LedgerCorruptError",
    "LoanEntry",
    "MovingCache",
    "Pool",
    "PoolCache",
    "PoolLockTimeout",
    "PoolMember",
    "PoolPermissionError",
]
