"""extensible-kv for transformers' continuous batching (`generate_batch`,
`init_continuous_batching`, `continuous_batching_context_manager`), transformers 5.18 to 5.25.

    import extensible_kv.transformers as ekv_transformers
    ekv_transformers.enable()          # or: with ekv_transformers.enabled(): ...

While enabled, every continuous-batching manager transformers creates gets an extensible KV
cache: transformers' `PagedAttentionCache` (same API, same tensors) placed in one
`ExtensibleTensor` reservation and sized by the flow after the warm-up has captured its CUDA
graphs, from the memory really left (`Extended KV cache to N blocks (X GiB)` on the
`extensible_kv` logger; `last_report()`). A `num_blocks` in the `ContinuousBatchingConfig`
caps it. `release(manager)` / `resume(manager)` give the memory back and take it again while
the manager and its graphs live (RL loops); `resize(manager, num_blocks)` grows or shrinks it
while requests run, and `enable(auto_resize=True)` lets it follow the load (`AutoResize`).
`enable(pool="name", min_blocks=..., max_blocks=...)` puts every manager's cache in a node
pool shared with other engines on the device (`extensible_kv.pool`): it starts at
`min_blocks`, grows through the pool on demand and lends its free blocks between its steps,
in the pool while its generation loop runs (`extensible_kv.transformers.pooled`).
transformers' code is not changed; `disable()`
puts back every object it replaced. Not supported: tensor parallelism, transformers < 5.18
(per-layer tensors) and versions past the tested range (refused with the range named).
"""

from extensible_kv.transformers.cache import AutoResize, Options
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
]
