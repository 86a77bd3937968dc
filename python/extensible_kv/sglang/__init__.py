"""extensible-kv for SGLang (0.5.16+, tested at 0.5.23): SGLang's post-capture KV arena on the core.

`KvVmmBufferOwner` has the API of `sglang.srt.mem_cache.kv_vmm_backing.KvVmmBufferOwner`;
`owner`'s docstring says what it adds (shrink, suspend/resume) and what holds without zeroing.
`plugin.register` is the `sglang.srt.plugins` entry point; `resize` resizes a live pool through
SGLang's allocator, between scheduler steps. Nothing here imports SGLang or torch.
"""

from typing import Any

from extensible_kv.sglang import owner as _owner
from extensible_kv.sglang.owner import (
    ZERO_ENV_VAR,
    KvSuspendedError,
    KvVmmBufferOwner,
    resume_all,
    suspend_all,
)
from extensible_kv.sglang.plugin import ENV_VAR, MEMORY_SAVER_ENV_VAR, register, unregister
from extensible_kv.sglang.resize import resize

__all__ = [
    "ENV_VAR",
    "MEMORY_SAVER_ENV_VAR",
    "ZERO_ENV_VAR",
    "KvSuspendedError",
    "KvVmmBufferOwner",
    "register",
    "resize",
    "resume_all",
    "suspend_all",
    "unregister",
]


def __getattr__(name: str) -> Any:
    """The deprecated names (`owner.DEPRECATED`: `release_all`, `KvReleasedError`), with a
    `DeprecationWarning`."""
    if name in _owner.DEPRECATED:
        return getattr(_owner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
