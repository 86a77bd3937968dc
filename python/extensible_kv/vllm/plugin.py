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
`EXTENSIBLE_KV_VLLM_RESIZE=0` leaves vLLM's `BlockPool` in place. With
`EXTENSIBLE_KV_VLLM_AUTO` set (`1`, or `min_blocks=...,idle_s=...`), the engine core's steps
go through `extensible_kv.vllm.engine`: the cache grows when the scheduler cannot admit its
waiting requests and shrinks after idle.

It stays out of the way: `EXTENSIBLE_KV_VLLM=0` switches it off; it imports no vLLM module
unless vLLM is loaded (vLLM is the caller); and on ROCm, or on a vLLM whose `ExtensibleTensor`
it does not recognise (constructor signature, or public attributes the drop-in lacks), it
changes nothing and logs a warning naming the version.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
from typing import Any

from extensible_kv._plugins import Integration, Patches, Provides, Stack, env_flag
from extensible_kv.vllm.commit import commit_keeping_data
from extensible_kv.vllm.tensor import ExtensibleTensor, granule_size

__all__ = [
    "AUTO_ENV_VAR",
    "ENV_VAR",
    "KEEP_DATA_ENV_VAR",
    "RESIZE_ENV_VAR",
    "register",
    "unregister",
]

ENV_VAR = "EXTENSIBLE_KV_VLLM"
KEEP_DATA_ENV_VAR = "EXTENSIBLE_KV_VLLM_KEEP_DATA"
RESIZE_ENV_VAR = "EXTENSIBLE_KV_VLLM_RESIZE"
_BLOCK_POOL_MODULE = "vllm.v1.core.block_pool"
_ENGINE_CORE_MODULE = "vllm.v1.engine.core"
AUTO_ENV_VAR = "EXTENSIBLE_KV_VLLM_AUTO"  # extensible_kv.vllm.engine's, read here
POOL_ENV_VAR = "EXTENSIBLE_KV_POOL"  # extensible_kv.vllm.pooled's
_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
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
    if os.environ.get(AUTO_ENV_VAR, "").strip() or os.environ.get(POOL_ENV_VAR, "").strip():
        _install_policy()
    return True


def _install_policy() -> None:
    """The engine core's steps through `extensible_kv.vllm.engine`, with the pool membership
    (`EXTENSIBLE_KV_POOL`) or the automatic policy (`EXTENSIBLE_KV_VLLM_AUTO`); a setting it
    cannot read is a `ValueError` naming it. Imported only now: the policies' modules import
    vLLM's scheduler pieces."""
    from extensible_kv.vllm.engine import AutoSettings, policy_maker
    from extensible_kv.vllm.pooled import PoolSettings

    auto = AutoSettings.parse(os.environ.get(AUTO_ENV_VAR, ""))
    pool = PoolSettings.from_environ()
    if not env_flag(RESIZE_ENV_VAR, True):
        logger.warning(
            "extensible-kv: %s is set but %s=0 keeps vLLM's block pool: the KV cache does not "
            "resize at run time.",
            POOL_ENV_VAR if pool is not None else AUTO_ENV_VAR,
            RESIZE_ENV_VAR,
        )
        return
    if pool is not None and auto is not None:
        logger.warning(
            "extensible-kv: %s and %s are both set: the pool sizes the KV cache.",
            POOL_ENV_VAR,
            AUTO_ENV_VAR,
        )
    if pool is not None:
        _install_export_fds()
    _install_step_hook(policy_maker(auto, pool))


def _install_export_fds() -> None:
    """vLLM's `kv_cache_export_handle_types` with POSIX fds added (a pool member lends its
    handles as fds), wherever vLLM's modules bind it (its own module's first, so that the
    model runner, imported later, binds ours)."""
    module = importlib.import_module(_KV_CACHE_MODULE)
    original = module.kv_cache_export_handle_types
    if getattr(original, "__wrapped__", None) is not None:
        return

    def kv_cache_export_handle_types(vllm_config: Any) -> int:
        return int(original(vllm_config)) | _POSIX_FD

    kv_cache_export_handle_types.__wrapped__ = original  # type: ignore[attr-defined]
    kv_cache_export_handle_types.__doc__ = original.__doc__
    _patches.set(module, "kv_cache_export_handle_types", kv_cache_export_handle_types)
    _patches.set_bindings(
        original,
        kv_cache_export_handle_types,
        packages=("vllm",),
        name="kv_cache_export_handle_types",
        skip=(module,),
    )


def _install_step_hook(make_policy: Any) -> None:
    """`EngineCore.step` and `step_with_batch_queue` through the hook (`step_fn` binds one
    of them as a core is built: this runs from `load_general_plugins`, before that in the
    core's `__init__`), `EngineCore.shutdown` after its policy leaves, and `EngineCore.sleep`
    refused where the policy cannot let the memory go (the pool)."""
    try:
        core_module = importlib.import_module(_ENGINE_CORE_MODULE)
    except ImportError as error:  # pragma: no cover - a vLLM without v1's engine core
        logger.warning("extensible-kv: the KV cache cannot resize itself: %s", error)
        return
    from extensible_kv.vllm.engine import wrap_shutdown, wrap_sleep, wrap_step

    cls = core_module.EngineCore
    wraps = {
        "step": lambda f: wrap_step(f, make_policy),
        "step_with_batch_queue": lambda f: wrap_step(f, make_policy),
        "shutdown": wrap_shutdown,
        "sleep": wrap_sleep,
    }
    for name, wrap in wraps.items():
        current = vars(cls)[name]
        while getattr(current, "__wrapped__", None) is not None:
            current = current.__wrapped__  # ours already: wrap vLLM's again, with these settings
        _patches.set(cls, name, wrap(current))


def _install_resizable_pool() -> None:
    """`ResizableBlockPool` wherever vLLM's modules bind `BlockPool` (its own module's first,
    so that modules imported later bind ours too)."""
    try:
        from extensible_kv.vllm.block_pool import VLLM_BLOCK_POOL, ResizableBlockPool
    except ImportError:  # a vLLM without v1's block pool (vLLM's check names the version)
        return
    module = sys.modules[_BLOCK_POOL_MODULE]
    original = module.BlockPool
    if original is ResizableBlockPool:
        return
    if VLLM_BLOCK_POOL is not original:
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
        from extensible_kv.vllm.block_pool import VLLM_BLOCK_POOL, ResizableBlockPool

        if pool_module.BlockPool is ResizableBlockPool:
            # Modules imported after the pool was put in place bound ours themselves.
            _patches.adopt_bindings(
                VLLM_BLOCK_POOL,
                ResizableBlockPool,
                packages=("vllm",),
                name="BlockPool",
                skip=(pool_module,),
            )
    _patches.restore()
