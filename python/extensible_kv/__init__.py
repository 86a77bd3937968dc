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
from extensible_kv.tensor import ExtensibleTensor

__all__ = [
    "ClosedError",
    "DriverError",
    "ExtensibleTensor",
    "OutOfMemoryError",
    "UnsupportedError",
    "vmm_unavailable_reason",
]
__version__ = "0.1.0"
