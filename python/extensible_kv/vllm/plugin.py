"""The vLLM plugin: vLLM's extensible KV cache on extensible-kv, with vLLM's code unchanged.

Declared in `pyproject.toml` as the entry point `extensible_kv` of the group
`vllm.general_plugins`, which vLLM loads once in every process it starts (engine core, each
worker before the worker module is imported). `register()` replaces
`vllm.utils.extensible_tensor.ExtensibleTensor` and `granule_size` by
`extensible_kv.vllm.ExtensibleTensor` and `granule_size`, and the names already bound to them
in vLLM's other loaded modules, such as `vllm.v1.worker.extensible_kv_cache` and
`vllm.v1.worker.gpu_worker` (`ExtensibleKVCache.__init__` reads its module global at call
time). It logs one INFO line.

With `EXTENSIBLE_KV_VLLM_KEEP_DATA=1` it also replaces `ExtensibleKVCache.commit`, so that a
shrinking or defragmenting commit keeps the blocks below the count (vLLM's releases everything
and re-grows zeroed): it shrinks in place and consolidates instead, ending at the count
vLLM's would.

It also puts `extensible_kv.vllm.block_pool.ResizableBlockPool` where vLLM's modules bind
`BlockPool` (the engine core's scheduler builds its pool from it), so that
`extensible_kv.vllm.resize.KvResizer` can resize a live engine's KV cache between steps.
`ResizableBlockPool` adds methods only, and leaves every path a step takes vLLM's own;
`EXTENSIBLE_KV_VLLM_RESIZE=0` leaves vLLM's `BlockPool` in place.

It stays out of the way: `EXTENSIBLE_KV_VLLM=0` switches it off; it imports no vLLM module
unless vLLM is loaded (vLLM is the caller); and on ROCm, or on a vLLM whose `ExtensibleTensor`
it does not recognise (constructor signature, or public attributes the drop-in lacks), it
changes nothing and logs a warning naming the version.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from typing import Any

from extensible_kv import _args
from extensible_kv._plugins import Integration, Patches, Provides, Stack, env_flag
from extensible_kv.vllm.tensor import ExtensibleTensor, granule_size

__all__ = ["ENV_VAR", "KEEP_DATA_ENV_VAR", "RESIZE_ENV_VAR", "register", "unregister"]

ENV_VAR = "EXTENSIBLE_KV_VLLM"
KEEP_DATA_ENV_VAR = "EXTENSIBLE_KV_VLLM_KEEP_DATA"
RESIZE_ENV_VAR = "EXTENSIBLE_KV_VLLM_RESIZE"
_BLOCK_POOL_MODULE = "vllm.v1.core.block_pool"
_KV_CACHE_MODULE = "vllm.v1.worker.extensible_kv_cache"
_TARGET = "vllm.utils.extensible_tensor"
# vLLM 0.34.0's constructor: (name, default) after `self`.
_SIGNATURE = (
    ("max_num_bytes", inspect.Parameter.empty),
    ("device", None),
    ("num_segments", 1),
    ("segment_capacities", None),
    ("export_handle_types", 0),
)
# What the drop-in needs of vLLM (any version whose objects match: vLLM names no range).
VLLM = Stack(
    "vLLM",
    "vllm",
    provides=(
        Provides(
            f"{_TARGET}.ExtensibleTensor",
            params=_SIGNATURE,
            replaced_by="extensible_kv.vllm.tensor:ExtensibleTensor",
        ),
        Provides(f"{_TARGET}.granule_size", "function", params=("device_index",)),
    ),
    tested="0.34",
)
_REPLACEMENTS: dict[str, Any] = {
    "ExtensibleTensor": ExtensibleTensor,
    "granule_size": granule_size,
}
# What `register` replaced, with vLLM's objects, for `unregister`.
_patches = Patches()

# A child of vLLM's "vllm" logger, whose handler vLLM configures: the line shows in its log.
logger = logging.getLogger("vllm.extensible_kv")
_VLLM = Integration("vLLM", "ExtensibleTensor", ENV_VAR, logger)


def commit_keeping_data(
    self: Any, num_blocks: int, defragment: bool = False, shrink: bool = False
) -> None:
    """vLLM 0.34's `ExtensibleKVCache.commit`, keeping the live blocks: a shrink gives back
    the memory past the count in place, and a defragment consolidates (one allocation per
    segment, contents and addresses kept), where vLLM's releases everything and re-grows
    zeroed. New blocks are zeroed, as in vLLM.

    It ends at the count vLLM's would, for every `defragment` and `shrink`: vLLM's remaps
    (release, then grow from 0) when `shrink` and the count is below the committed one, or
    when `defragment` and its own test says the count's bytes are not one chunk per segment
    (asked before anything changes, as vLLM does); a remap ends at the count, anything else
    never goes below the committed count. Blocks below both counts keep their contents.

    A negative `num_blocks` is a ValueError (vLLM's would release everything on a shrink), a
    non-integer a TypeError, before anything changes."""
    num_blocks = min(_args.size(num_blocks, "num_blocks"), self.capacity_blocks)
    defragment = _args.flag(defragment, "defragment")
    shrink = _args.flag(shrink, "shrink")
    sizes = [num_blocks * stride for stride in self.segment_strides]
    remap = (defragment and not all(self.buffer.segments_backed_by_one_chunk(sizes))) or (
        shrink and num_blocks < self.num_committed_blocks
    )
    target = num_blocks if remap else max(num_blocks, self.num_committed_blocks)
    sizes = [target * stride for stride in self.segment_strides]
    if target < self.num_committed_blocks:
        # Released (asleep), a segment holds less than the count says: nothing to give back.
        held = self.buffer.segment_bytes
        self.buffer.shrink_segments_([min(h, s) for h, s in zip(held, sizes, strict=True)])
    if remap or target > self.num_committed_blocks:
        # A no-op where every segment holds its size already; else new blocks, zeroed (all
        # of them when asleep, as vLLM's remap).
        self.buffer.resize_segments_(sizes, zero_new=True)
    self.num_committed_blocks = target
    if defragment and not all(self.buffer.segments_backed_by_one_chunk(sizes)):
        self.buffer.consolidate()
    logger.debug(
        "Committed %d of %d KV cache blocks (%.2f GiB physical, contents kept).",
        self.num_committed_blocks,
        self.capacity_blocks,
        self.physical_bytes / (1 << 30),
    )


def _install_keep_data() -> None:
    cls = importlib.import_module(_KV_CACHE_MODULE).ExtensibleKVCache
    if cls.commit is commit_keeping_data:
        return
    _patches.set(cls, "commit", commit_keeping_data)
    logger.info(
        "extensible-kv: %s=1: shrinking and defragmenting KV cache commits keep the blocks "
        "below the count.",
        KEEP_DATA_ENV_VAR,
    )


def register() -> bool:
    """Install the drop-in into vLLM; True when it is installed (now or before)."""
    if not VLLM.loaded():
        return False  # not called by vLLM: import nothing
    if _VLLM.switched_off():
        return False
    version = VLLM.version()
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch.version, "hip", None):
        _VLLM.warn_not_replacing(version, "ROCm is not supported (extensible-kv drives CUDA)")
        return False
    module = importlib.import_module(_TARGET)
    if module.ExtensibleTensor is not ExtensibleTensor and not _install_dropin(version):
        return False
    if env_flag(KEEP_DATA_ENV_VAR, False):
        _install_keep_data()
    if env_flag(RESIZE_ENV_VAR, True):
        _install_resizable_pool()
    return True


def _install_resizable_pool() -> None:
    """`ResizableBlockPool` wherever vLLM's modules bind `BlockPool` (its own module's first,
    so that modules imported later bind ours too)."""
    try:
        from extensible_kv.vllm.block_pool import ResizableBlockPool
    except ImportError:  # a vLLM without v1's block pool (vLLM's check names the version)
        return
    module = sys.modules[_BLOCK_POOL_MODULE]
    original = module.BlockPool
    if original is ResizableBlockPool:
        return
    if ResizableBlockPool.__mro__[1] is not original:
        logger.warning(
            "extensible-kv: vLLM's BlockPool is not the class ResizableBlockPool extends "
            "(another plugin replaced it?): the KV cache cannot be resized at run time."
        )
        return
    _patches.set(module, "BlockPool", ResizableBlockPool)
    _patches.set_bindings(
        original, ResizableBlockPool, packages=("vllm",), name="BlockPool", skip=(module,)
    )


def _install_dropin(version: str) -> bool:
    """Puts the drop-in wherever vLLM's modules bind the names of vLLM 0.34's
    `extensible_tensor` (its own module's first); False (with a warning) when they are not
    0.34's."""
    found = VLLM.recognise(version)
    if not found.ok:
        _VLLM.warn_not_replacing(version, "; ".join(found.problems), "vLLM 0.34")
        return False
    module = sys.modules[_TARGET]
    for name, ours in _REPLACEMENTS.items():
        original = found[f"{_TARGET}.{name}"]
        _patches.set(module, name, ours)
        _patches.set_bindings(original, ours, packages=("vllm",), name=name, skip=(module,))
    _VLLM.log_enabled(version, "extensible KV cache", "ExtensibleTensor, granule_size replaced")
    return True


def unregister() -> None:
    """Put vLLM's own objects back where `register` replaced them (where ours are still in
    place)."""
    pool_module = sys.modules.get(_BLOCK_POOL_MODULE)
    if pool_module is not None and "extensible_kv.vllm.block_pool" in sys.modules:
        from extensible_kv.vllm.block_pool import ResizableBlockPool

        if pool_module.BlockPool is ResizableBlockPool:
            # Modules imported after the pool was put in place bound ours themselves.
            _patches.adopt_bindings(
                ResizableBlockPool.__mro__[1],
                ResizableBlockPool,
                packages=("vllm",),
                name="BlockPool",
                skip=(pool_module,),
            )
    _patches.restore()
