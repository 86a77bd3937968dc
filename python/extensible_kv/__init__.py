"""extensible-kv: reserve a KV cache's address space up front, commit physical memory later.

`ExtensibleTensor` is one reservation of virtual address space, split into segments that grow
in lockstep; physical memory is committed by `resize_per_segment_`, and torch views of it keep
the memory alive. `device="cpu"` uses the host backend (Linux mmap + memfd), `"cuda:N"` the
CUDA driver's virtual memory management.
"""

from extensible_kv._native import (
    ClosedError,
    DriverError,
    OutOfMemoryError,
    UnsupportedError,
    vmm_unavailable_reason,
)
from extensible_kv.kv_cache import (
    AttentionLayerSpec,
    ExtensibleKVCache,
    KVCacheTensorSpec,
    LayerSpec,
    MambaLayerSpec,
    StandardLayerSpec,
)
from extensible_kv.layouts import BACKEND_PRESETS, STANDARD_LAYOUTS
from extensible_kv.mamba import MambaStateSpec, gated_delta_net_state_spec, mamba2_state_spec
from extensible_kv.tensor import ExtensibleTensor

__all__ = [
    "BACKEND_PRESETS",
    "STANDARD_LAYOUTS",
    "AttentionLayerSpec",
    "ClosedError",
    "DriverError",
    "ExtensibleKVCache",
    "ExtensibleTensor",
    "KVCacheTensorSpec",
    "LayerSpec",
    "MambaLayerSpec",
    "MambaStateSpec",
    "OutOfMemoryError",
    "StandardLayerSpec",
    "UnsupportedError",
    "gated_delta_net_state_spec",
    "mamba2_state_spec",
    "vmm_unavailable_reason",
]
__version__ = "0.1.0"
