"""extensible-kv: reserve a KV cache's address space up front, commit physical memory later.

`ExtensibleTensor` is one reservation of virtual address space, split into segments that grow
in lockstep; physical memory is committed by `resize_per_segment_`, and torch views of it keep
the memory alive. `device="cpu"` uses the host backend (Linux mmap + memfd), `"cuda:N"` the
CUDA driver's virtual memory management. `ExtensibleKVCache` lays a model's KV cache out on
such tensors; `KVCacheFlow` runs the flow: reserve, capture graphs, `extend_to_fit`.
"""

from extensible_kv._native import (
    ClosedError,
    DriverError,
    LoanConflictError,
    LoanTimeoutError,
    OutOfMemoryError,
    PtraceRefusedError,
    UnsupportedError,
    vmm_unavailable_reason,
)
from extensible_kv.distributed import min_over_group
from extensible_kv.flow import ExtendReport, KVCacheFlow
from extensible_kv.ipc import (
    Loan,
    LoanHandle,
    SharedHandle,
    SharedTensor,
    recv_loan,
    recv_shared,
    send_shared,
)
from extensible_kv.kv_cache import (
    AttentionLayerSpec,
    ExtensibleKVCache,
    KVCacheTensorSpec,
    LayerSpec,
    MambaLayerSpec,
    StandardLayerSpec,
)
from extensible_kv.layouts import ATTENTION_BACKEND_PRESETS, STANDARD_LAYOUTS
from extensible_kv.mamba import MambaStateSpec, gated_delta_net_state_spec, mamba2_state_spec
from extensible_kv.shape import BufferShape, CacheShape, Dealing, blocks_from, deal
from extensible_kv.sizing import (
    blocks_within,
    capacity_blocks_for,
    host_free_bytes,
    measure_budget,
)
from extensible_kv.tensor import ExtensibleTensor, HandleSizing

__all__ = [
    "ATTENTION_BACKEND_PRESETS",
    "STANDARD_LAYOUTS",
    "AttentionLayerSpec",
    "BufferShape",
    "CacheShape",
    "ClosedError",
    "Dealing",
    "DriverError",
    "ExtendReport",
    "ExtensibleKVCache",
    "ExtensibleTensor",
    "HandleSizing",
    "KVCacheFlow",
    "KVCacheTensorSpec",
    "LayerSpec",
    "Loan",
    "LoanConflictError",
    "LoanHandle",
    "LoanTimeoutError",
    "MambaLayerSpec",
    "MambaStateSpec",
    "OutOfMemoryError",
    "PtraceRefusedError",
    "SharedHandle",
    "SharedTensor",
    "StandardLayerSpec",
    "UnsupportedError",
    "blocks_from",
    "blocks_within",
    "capacity_blocks_for",
    "deal",
    "gated_delta_net_state_spec",
    "host_free_bytes",
    "mamba2_state_spec",
    "measure_budget",
    "min_over_group",
    "recv_loan",
    "recv_shared",
    "send_shared",
    "vmm_unavailable_reason",
]
__version__ = "0.1.0"
