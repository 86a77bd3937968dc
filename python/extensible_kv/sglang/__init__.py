"""extensible-kv for SGLang (0.5.16+, tested at 0.5.23): SGLang's post-capture KV arena on the core.

`KvVmmBufferOwner` has the API of `sglang.srt.mem_cache.kv_vmm_backing.KvVmmBufferOwner`;
`owner`'s docstring says what it adds (shrink, release/resume) and what holds without zeroing.
`plugin.register` is the `sglang.srt.plugins` entry point; `resize` resizes a live pool through
SGLang's allocator, between scheduler steps. Nothing here imports SGLang or torch.
"""

from extensible_kv.sglang.owner import (
    ZERO_ENV_VAR,
    KvReleasedError,
    KvVmmBufferOwner,
    release_all,
    resume_all,
)
from extensible_kv.sglang.plugin import ENV_VAR, MEMORY_SAVER_ENV_VAR, register, unregister
from extensible_kv.sglang.resize import resize

__all__ = [
    "ENV_VAR",
    "MEMORY_SAVER_ENV_VAR",
    "ZERO_ENV_VAR",
    "KvReleasedError",
    "KvVmmBufferOwner",
    "register",
    "release_all",
    "resize",
    "resume_all",
    "unregister",
]
