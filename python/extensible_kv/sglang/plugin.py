"""The SGLang plugin: SGLang's post-capture KV arena on extensible-kv, with SGLang's code unchanged.

Declared in `pyproject.toml` as the entry point `extensible_kv` of the group
`sglang.srt.plugins`, which `sglang.srt.plugins.load_plugins()` runs early in every SGLang
process and follows with `HookRegistry.apply_hooks()`. `register()` asks SGLang's
`HookRegistry` to REPLACE `sglang.srt.mem_cache.kv_vmm_backing.KvVmmBufferOwner` with
`extensible_kv.sglang.KvVmmBufferOwner`; the registry then rebinds every module's
`from ... import KvVmmBufferOwner` copy (`memory_pool`, `unified_memory_pool`). It logs one INFO
line. Post-capture sizing itself stays SGLang's opt-in (`SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1`).

With `--enable-memory-saver` (RL sleep/wake), SGLang turns post-capture sizing off, because
its arena is not under torch_memory_saver's `kv_cache` tag. Where SGLang has the seams (0.5.23:
the gate `arg_groups.overrides.post_capture_kv_sizing_planned` and the adapter
`utils.torch_memory_saver_adapter._TorchMemorySaverAdapterReal`), the plugin also:
- wraps the gate so that the memory saver alone no longer turns post-capture sizing off (every
  other reason still does);
- wraps the adapter's `pause`/`resume` so that the `kv_cache` tag also suspends every owner's
  memory (addresses kept: captured graphs stay valid) and recommits it, in process, without
  LD_PRELOAD. torch_memory_saver still handles the tag's other allocations and the `weights`
  and `cuda_graph` tags. `EXTENSIBLE_KV_SGLANG_MEMORY_SAVER=0` leaves both seams alone.

With `EXTENSIBLE_KV_SGLANG_AUTO` set (`1`, or `min_tokens=...,idle_s=...`) it also asks the
registry for AROUND hooks on the scheduler's `get_next_batch_to_run` and `on_idle`: the KV pool
grows for waiting requests and shrinks after idle (`extensible_kv.sglang.auto`).

It stays out of the way: `EXTENSIBLE_KV_SGLANG=0` switches it off; it imports nothing unless
SGLang is loaded (SGLang is the caller); and on an SGLang older than 0.5.16, or whose owner API
it does not recognise (constructor, methods), it changes nothing and logs a warning naming the
version.
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import sys
import types
from dataclasses import dataclass, field
from typing import Any

from extensible_kv._plugins import ABSENT, Integration, Patches, Provides, Stack, bindings, env_flag

__all__ = ["AUTO_ENV_VAR", "ENV_VAR", "MEMORY_SAVER_ENV_VAR", "register", "unregister"]

ENV_VAR = "EXTENSIBLE_KV_SGLANG"
MEMORY_SAVER_ENV_VAR = "EXTENSIBLE_KV_SGLANG_MEMORY_SAVER"
AUTO_ENV_VAR = "EXTENSIBLE_KV_SGLANG_AUTO"  # extensible_kv.sglang.auto's, read here
MIN_VERSION = (0, 5, 16)
TESTED_VERSION = "0.5.23"
KV_CACHE_TAG = "kv_cache"  # sglang.srt.constants.GPU_MEMORY_TYPE_KV_CACHE

_REGISTRY_MODULE = "sglang.srt.plugins.hook_registry"
_OWNER_MODULE = "sglang.srt.mem_cache.kv_vmm_backing"
_OWNER_TARGET = f"{_OWNER_MODULE}.KvVmmBufferOwner"
_GATE_MODULE = "sglang.srt.arg_groups.overrides"
_GATE_TARGET = f"{_GATE_MODULE}.post_capture_kv_sizing_planned"
_ADAPTER_MODULE = "sglang.srt.utils.torch_memory_saver_adapter"
_ADAPTER_CLASS = f"{_ADAPTER_MODULE}._TorchMemorySaverAdapterReal"
_SCHEDULER_CLASS = "sglang.srt.managers.scheduler.Scheduler"
# SGLang 0.5.16-0.5.23's constructor, keyword-only after `self`.
_OWNER_PARAMS = (
    "device",
    "device_id",
    "store_dtype",
    "page_size",
    "reserved_num_tokens",
    "buffer_descs",
)
_OWNER_METHODS = ("ensure_prefix", "finalize", "close", "backed_bytes")
# What the plugin needs of SGLang, and what its memory saver hooks wrap (optional: without
# them, the memory saver keeps turning post-capture sizing off).
SGLANG = Stack(
    "SGLang",
    "sglang",
    provides=(
        Provides(
            _OWNER_TARGET,
            params=_OWNER_PARAMS,
            keyword_only=True,
            methods=_OWNER_METHODS,
            replaced_by="extensible_kv.sglang.owner:KvVmmBufferOwner",
        ),
    ),
    min_version=MIN_VERSION,
    tested=TESTED_VERSION,
)
MEMORY_SAVER_SEAMS = Stack(
    "SGLang",
    "sglang",
    provides=(
        Provides(_GATE_TARGET, "function"),
        Provides(f"{_GATE_MODULE}.resolving_view", "function"),
        Provides(_ADAPTER_CLASS, methods=("pause", "resume")),
    ),
    min_version=MIN_VERSION,
    tested=TESTED_VERSION,
)

# A child of SGLang's "sglang" logger, whose handlers SGLang configures.
logger = logging.getLogger("sglang.extensible_kv")
_SGLANG = Integration("SGLang", "KvVmmBufferOwner", ENV_VAR, logger)

# target -> hook, for what `register` asked the registry to do (`unregister` undoes it).
_registered: dict[str, Any] = {}
# target -> SGLang's object, for a class REPLACE (the registry keeps no trace of it).
_originals: dict[str, Any] = {}
_gate_lifted_logged = False


@dataclass
class _Applied:
    """What SGLang's registry did to one of our targets when it applied it (`apply_hooks`)."""

    hooks: list[Any]  # the registry's entries for the target then: (type, hook, source)
    original: Any  # the object it wrapped or replaced (SGLang's)
    top: Any  # what it put at the target (its chain of every hook there)
    patches: Patches = field(default_factory=Patches)  # the target and each copy it rebound


# target -> what the registry did there, for `unregister`, which undoes exactly that.
_applied: dict[str, _Applied] = {}
# Our watch on `HookRegistry.apply_hooks`, which records `_applied`.
_registry_patches = Patches()


def register() -> bool:
    """Ask SGLang's HookRegistry to put extensible-kv's owner (and, with the memory saver seams,
    the `kv_cache` tag hooks) in place; True when registered (now or before). SGLang applies the
    hooks (`HookRegistry.apply_hooks()`, which `load_plugins` calls)."""
    if not SGLANG.loaded():
        return False  # not called by SGLang: import nothing
    if _SGLANG.switched_off():
        return False
    if _registered:
        return True
    found = SGLANG.recognise()
    if not found.ok:
        reason = "; ".join(found.problems)
        if not found.supported:
            reason = "the plugin needs SGLang 0.5.16 or later (post-capture KV sizing)"
        supported = f"SGLang >= 0.5.16 (tested at {TESTED_VERSION})"
        _SGLANG.warn_not_replacing(found.version, reason, supported)
        return False
    version = found.version
    registry = importlib.import_module(_REGISTRY_MODULE)
    HookRegistry, HookType = registry.HookRegistry, registry.HookType
    _watch_apply(HookRegistry)

    from extensible_kv.sglang.owner import KvVmmBufferOwner

    _originals[_OWNER_TARGET] = found[_OWNER_TARGET]
    HookRegistry.register(_OWNER_TARGET, KvVmmBufferOwner, HookType.REPLACE)
    _registered[_OWNER_TARGET] = KvVmmBufferOwner
    saver = "off"
    if not env_flag(MEMORY_SAVER_ENV_VAR, True):
        saver = f"off ({MEMORY_SAVER_ENV_VAR}=0)"
    elif MEMORY_SAVER_SEAMS.recognise(version).ok:
        hooks = {
            _GATE_TARGET: _planned_with_memory_saver,
            f"{_ADAPTER_CLASS}.pause": _pause,
            f"{_ADAPTER_CLASS}.resume": _resume,
        }
        for target, hook in hooks.items():
            HookRegistry.register(target, hook, HookType.AROUND)
            _registered[target] = hook
        saver = "on"
    else:
        saver = "off (this SGLang lacks the seams)"
    _SGLANG.log_enabled(
        version,
        "post-capture KV arena",
        f"KvVmmBufferOwner replaced; with --enable-memory-saver: {saver}",
    )
    if os.environ.get(AUTO_ENV_VAR, "").strip():
        _register_auto(HookRegistry, HookType)
    return True


def _register_auto(HookRegistry: Any, HookType: Any) -> None:
    """`EXTENSIBLE_KV_SGLANG_AUTO`: the automatic policy's hooks around the scheduler's
    `get_next_batch_to_run` and `on_idle` (`extensible_kv.sglang.auto`); a value it cannot
    read is a `ValueError` naming it. Imported only now: the policy reads SGLang's pools."""
    from extensible_kv.sglang.auto import AutoSettings, Hooks

    settings = AutoSettings.parse(os.environ[AUTO_ENV_VAR])
    if settings is None:
        return
    hooks = Hooks(settings)
    for name in ("get_next_batch_to_run", "on_idle"):
        target = f"{_SCHEDULER_CLASS}.{name}"
        hook = getattr(hooks, name)
        HookRegistry.register(target, hook, HookType.AROUND)
        _registered[target] = hook


def _planned_with_memory_saver(original: Any, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's gate, except that `enable_memory_saver` alone no longer says no: the gate is asked
    again with a last declaration `enable_memory_saver=False` on the record, for this call only."""
    planned = original(server_args, *args, **kwargs)
    gate = sys.modules[_GATE_MODULE]
    if _GATE_TARGET not in _registered:
        return planned  # withdrawn, but left in a chain someone else wrapped (`unregister`)
    if planned or not getattr(gate.resolving_view(server_args), "enable_memory_saver", False):
        return planned
    stash = getattr(server_args, "_resolved_overrides", None)
    try:
        server_args._resolved_overrides = [
            *(stash or ()),
            ("extensible_kv", {"enable_memory_saver": False}),
        ]
    except (AttributeError, TypeError):
        return planned  # not a record we can declare on (a read-only view): SGLang's answer
    try:
        planned = original(server_args, *args, **kwargs)
    finally:
        server_args._resolved_overrides = stash
    global _gate_lifted_logged
    if planned and not _gate_lifted_logged:
        _gate_lifted_logged = True
        logger.info(
            "extensible-kv: post-capture KV sizing stays on with --enable-memory-saver: the "
            "kv_cache tag suspends and resumes extensible-kv's KV memory at the same addresses."
        )
    return planned


def _tag_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kwargs["tag"] if "tag" in kwargs else (args[0] if args else None)


def _pause(original: Any, adapter: Any, *args: Any, **kwargs: Any) -> Any:
    """The adapter's `pause`; for the `kv_cache` tag, every owner's memory goes back too."""
    result = original(adapter, *args, **kwargs)
    if _tag_of(args, kwargs) == KV_CACHE_TAG and f"{_ADAPTER_CLASS}.pause" in _registered:
        from extensible_kv.sglang.owner import suspend_all

        suspend_all()
    return result


def _resume(original: Any, adapter: Any, *args: Any, **kwargs: Any) -> Any:
    """The adapter's `resume`; for the `kv_cache` tag, every owner's memory is recommitted."""
    result = original(adapter, *args, **kwargs)
    if _tag_of(args, kwargs) == KV_CACHE_TAG and f"{_ADAPTER_CLASS}.resume" in _registered:
        from extensible_kv.sglang.owner import resume_all

        resume_all()
    return result


def _watch_apply(registry: Any) -> None:
    """Wrap `HookRegistry.apply_hooks` so that, when it applies one of our targets, what it
    replaced is recorded (`_applied`): the target itself, and exactly the modules' copies its
    `_propagate_patch` rebound, those that held SGLang's object just before and hold the
    registry's chain just after. `unregister` undoes that and nothing else."""
    if _registry_patches:
        return
    apply_hooks = vars(registry)["apply_hooks"]

    def watched(cls: Any, *args: Any, **kwargs: Any) -> Any:
        before = {t: _holders(t) for t in _registered if t not in cls._patched}
        result = apply_hooks.__get__(None, cls)(*args, **kwargs)
        for target, holders in before.items():
            if holders is None:
                continue
            parent, name, raw, original, copies = holders
            top = vars(parent).get(name, ABSENT)
            if target not in cls._patched or top is raw:
                continue
            applied = _Applied(list(cls._hooks.get(target, ())), original, top)
            applied.patches.adopt(parent, name, raw, top)
            for module, attr in copies:
                if vars(module).get(attr, ABSENT) is top:
                    applied.patches.adopt(module, attr, original, top)
            _applied[target] = applied
        return result

    _registry_patches.set(registry, "apply_hooks", classmethod(watched))


_Holders = tuple[Any, str, Any, Any, list[tuple[types.ModuleType, str]]]


def _holders(target: str) -> _Holders | None:
    """`(parent, name, raw, original, copies)`: the object that holds `target`, what its own
    `name` holds (a classmethod as such; `ABSENT` when inherited), the object the registry
    wraps (a classmethod's function), and the `(module, attr)` pairs that hold that object, as
    the registry's `_propagate_patch` finds them; None where `target` does not resolve. Reads,
    changes nothing."""
    path, name = target.rsplit(".", 1)
    try:
        parent = pkgutil.resolve_name(path)
    except (ImportError, AttributeError, ValueError):
        return None  # the registry fails on it too, and logs that
    raw: Any = vars(parent).get(name, ABSENT)
    original: Any = getattr(parent, name, ABSENT)
    if isinstance(raw, classmethod | staticmethod):
        original = raw.__func__
    return parent, name, raw, original, bindings(original, skip=(parent,))


def unregister() -> None:
    """Withdraw what `register` asked for: drop its hooks from SGLang's HookRegistry and, where
    the registry applied them, remove exactly our layer from each target's chain. Another
    plugin's hooks on the same target stay applied (the registry's chain is rebuilt without
    ours, over SGLang's object). Only two kinds of binding are put back: those the registry
    rebound when it applied the hooks, and SGLang's own modules' copies of the target's name
    (`from ... import` after the apply). Any other name for our objects stays ours: a user's
    `from extensible_kv.sglang import KvVmmBufferOwner`, `__main__`'s."""
    if not _registered:
        return
    HookRegistry = importlib.import_module(_REGISTRY_MODULE).HookRegistry
    for target, hook in list(_registered.items()):
        entries = HookRegistry._hooks.get(target, [])
        entries[:] = [entry for entry in entries if entry[1] is not hook]
        if not entries:
            HookRegistry._hooks.pop(target, None)
        applied = _applied.pop(target, None)
        del _registered[target]
        if applied is not None:
            _withdraw(HookRegistry, target, hook, applied)
    _registry_patches.restore()


def _withdraw(registry: Any, target: str, hook: Any, applied: _Applied) -> None:
    """Undo what the registry did to `target` (`applied`), then let it apply the hooks other
    plugins have there again, over SGLang's object: their chain without our layer."""
    path, name = target.rsplit(".", 1)
    parent = pkgutil.resolve_name(path)
    if vars(parent).get(name, ABSENT) is not applied.top:
        # Replaced since, outside the registry: whoever did holds our layer, which must stay
        # (the AROUND hooks pass through once unregistered).
        logger.warning(
            "extensible-kv: %s was replaced after SGLang applied its hooks; extensible-kv's "
            "layer stays under that replacement.",
            target,
        )
        applied.patches.forget()
        return
    # SGLang's modules imported after the apply copied the chain with their own
    # `from ... import`: theirs to put back too. Modules outside SGLang are left alone.
    applied.patches.adopt_bindings(
        applied.original, applied.top, packages=("sglang",), name=name, skip=(parent,)
    )
    put_back = applied.patches.restore()
    remaining = [entry for entry in applied.hooks if entry[1] is not hook]
    if not remaining:
        registry._patched.discard(target)
        return
    if (parent, name) not in put_back:
        return
    try:
        # Their chain over SGLang's object, rebinding, as at the first apply, every copy that
        # holds SGLang's object: those `restore` just put back.
        registry._apply_target(target, remaining)
    except Exception:  # as `apply_hooks` does: SGLang's object stays, the failure is logged
        logger.exception("extensible-kv: re-applying the other hooks on %s failed", target)
        registry._patched.discard(target)
