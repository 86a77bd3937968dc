"""extensible-kv for transformers' continuous batching (`generate_batch`,
`init_continuous_batching`, `continuous_batching_context_manager`), transformers 5.18 to 5.25.

    import extensible_kv.transformers as ekv_transformers
    ekv_transformers.enable()          # or: with ekv_transformers.enabled(): ...

While enabled, every continuous-batching manager transformers creates gets an extensible KV
cache: transformers' `PagedAttentionCache` (same API, same tensors) placed in one
`ExtensibleTensor` reservation and sized by the flow after the warm-up has captured its CUDA
graphs, from the memory really left (`Extended KV cache to N blocks (X GiB)` on the
`extensible_kv` logger; `last_report()`). A `num_blocks` in the `ContinuousBatchingConfig`
caps it. `suspend(manager)` / `resume(manager)` give the memory back and take it again while
the manager and its graphs live, at the same addresses (RL loops; `release`, the old name of
`suspend`, is deprecated); `resize(manager, num_blocks)` grows or shrinks it while requests
run, and `enable(auto_resize=True)` lets it follow the load (`AutoResize`).
`enable(pool="name", min_blocks=..., max_blocks=...)` (or `min_bytes=`, `max_bytes=`) puts
every manager's cache in a node pool shared with other engines on the device
(`extensible_kv.pool`): it starts at its minimum, asks the pool for what its waiting requests
need and lends its free blocks between its steps, in the pool while its generation loop runs
(`extensible_kv.transformers.pooled`). transformers' code is not changed; `disable()` puts
back every object it replaced. Not supported: tensor parallelism, transformers < 5.18
(per-layer tensors) and versions past the tested range (refused with the range named).

The package's rooms, each one job: `options` (what `enable` takes, and the options in force),
`state` (a cache's extensible side and its sizer), `cache` (the classes bound into
transformers, and the extension after the warm-up), `sectors` (the surgery on transformers'
`CachePool`), `resizing` (a live cache's size changed), `auto` (the automatic policy),
`suspension` (suspend / resume), `sector_cache` and `pooled` (a cache in a node pool), `patch`
(the seam into transformers, and the public functions). The rooms that hold `resize` and
`suspend`'s work are not named after them: `extensible_kv.transformers.resize` and `.suspend`
are the functions.
"""

from extensible_kv.transformers.options import AutoResize, Options
from extensible_kv.transformers.patch import (
    SUPPORTED,
    disable,
    enable,
    enabled,
    is_enabled,
    last_report,
    release,
    resize,
    resume,
    suspend,
)

__all__ = [
    "SUPPORTED",
    "AutoResize",
    "Options",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "last_report",
    "release",
    "resize",
    "resume",
    "suspend",
]
