"""The seam into transformers' continuous batching, and the public functions.

`enable` binds, after checking the version:

- `ExtensiblePagedAttentionCache` where transformers' modules bound `PagedAttentionCache` by
  name (`continuous_api`, whose `ContinuousBatchingManager._create_batch_processor` builds the
  cache, and the other modules of `continuous_batching` that imported it);
- a `PagedAttentionMemoryHandler` subclass in `continuous_batching.cache`, which behaves as
  transformers' own except while our cache is built (see `cache`);
- `ContinuousBatchingManager.warmup` and `._create_batch_processor` wrappers: the cache is
  extended right after the manager's warm-up (graphs captured), or right after the batch
  processor is built when no warm-up runs (the generation loop builds it itself); a cache in
  a node pool joins it there, as the loop starts on its own thread;
- a `ContinuousBatchingManager._run_generation_loop` wrapper: a cache in a node pool leaves
  it when the loop ends (on the loop's thread, after its last step). While it is in the pool,
  the serving hooks are that one manager's instance attributes (`pooled`), gone when it
  leaves;
- nothing for `start` and `stop`: while a cache is suspended, `suspend` guards that one
  manager's `start` and `stop` (instance attributes, gone at `resume`) rather than
  transformers' class.

`disable` puts every original object back where it was; nothing of transformers' code changes.
"""

from __future__ import annotations

import contextvars
import functools
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from extensible_kv import _args, _torch
from extensible_kv._native import UnsupportedError
from extensible_kv._plugins import Patches, Provides, Recognised, Stack
from extensible_kv.flow import ExtendReport
from extensible_kv.pool.store import Pool
from extensible_kv.transformers import cache as _cache
from extensible_kv.transformers import options as _options
from extensible_kv.transformers import pooled as _pooled
from extensible_kv.transformers import resizing as _resizing
from extensible_kv.transformers import suspension as _suspension
from extensible_kv.transformers.options import AutoResize, Options
from extensible_kv.transformers.state import is_extensible

# Its public names are the package's (`extensible_kv.transformers.__all__`), listed there once.

# The flat cache tensor with its trash sectors first arrived in 5.18; 5.25 is the newest release
# whose continuous batching the seam was read against. CI tests both ends (scripts/test); the
# range's text is made from these two, so that no message can name another.
MIN_VERSION = (5, 18)
MAX_VERSION = (5, 25)
SUPPORTED = f">={MIN_VERSION[0]}.{MIN_VERSION[1]},<{MAX_VERSION[0]}.{MAX_VERSION[1] + 1}"
_RANGE = f"{MIN_VERSION[0]}.{MIN_VERSION[1]}.0 to {MAX_VERSION[0]}.{MAX_VERSION[1]}.x"
_PACKAGE = "transformers.generation.continuous_batching"
_CACHE_MODULE = f"{_PACKAGE}.cache"
_API_MODULE = f"{_PACKAGE}.continuous_api"
_POOL_MODULE = f"{_PACKAGE}.cache_allocators.cache_pool"
_CACHE = f"{_CACHE_MODULE}.PagedAttentionCache"
_HANDLER = f"{_CACHE_MODULE}.PagedAttentionMemoryHandler"
_MANAGER = f"{_API_MODULE}.ContinuousBatchingManager"
_POOL = f"{_POOL_MODULE}.CachePool"
# The classes the seam subclasses or wraps, with the methods it calls or wraps: checked before
# anything is patched.
TRANSFORMERS = Stack(
    "transformers",
    "transformers",
    provides=(
        Provides(_CACHE, methods=("reset", "free_all_requests")),
        Provides(
            _HANDLER,
            methods=(
                "infer_max_batch_tokens_and_num_sectors",
                "_check_footprint",
                "num_sectors_from_config",
                "bytes_per_batch_token",
                "bytes_per_cache_token",
            ),
        ),
        Provides(
            _MANAGER,
            methods=(
                "warmup",
                "_create_batch_processor",
                "_run_generation_loop",
                "_generation_loop_body",
                "pause",
                "is_running",
                "stop",
            ),
        ),
        Provides(_POOL, methods=("reset", "allocate_sector")),
    ),
    min_version=MIN_VERSION,
    max_version=MAX_VERSION,
    tested="5.25",
)

_state: dict[str, Any] = {"report": None}
# What `enable` replaced, with transformers' objects, for `disable`.
_patches = Patches()
# Set while the manager's own warm-up runs: the batch processor it builds is extended after.
_IN_WARMUP: contextvars.ContextVar[bool] = contextvars.ContextVar("ekv_in_warmup", default=False)


def current_options() -> Options | None:
    """The options in force (`enable`'s), or None while disabled."""
    return _options.current()


def is_enabled() -> bool:
    return bool(_patches)


def last_report() -> ExtendReport | None:
    """The last extension's `ExtendReport` (blocks in transformers' whole-model blocks), or None."""
    report: ExtendReport | None = _state["report"]
    return report


def _supports(version: str) -> bool:
    """Whether transformers `version` is in the range the seam supports (`SUPPORTED`)."""
    return TRANSFORMERS.supports(version)


def _check_version() -> Recognised:
    """transformers' classes the seam touches, or `UnsupportedError` naming the range."""
    try:
        import transformers
    except ModuleNotFoundError as error:
        if error.name != "transformers":
            raise
        raise ModuleNotFoundError(
            f"extensible_kv.transformers needs transformers {SUPPORTED}, which is not installed: "
            f"pip install 'transformers{SUPPORTED}'",
            name="transformers",
        ) from None
    version = str(getattr(transformers, "__version__", "unknown"))
    found = TRANSFORMERS.recognise(version)
    if not found.supported:
        raise UnsupportedError(
            f"extensible_kv.transformers supports transformers {SUPPORTED} ({_RANGE}); "
            f"found {version}: install a supported version, or leave the extensible cache off"
        )
    problems = list(found.problems)
    bound = getattr(sys.modules.get(_API_MODULE), "PagedAttentionCache", None)
    if bound is not found.found.get(_CACHE) and bound not in _patches.replacements():
        problems.append("continuous_api has no PagedAttentionCache (the name the manager builds)")
    if problems:
        raise UnsupportedError(
            f"transformers {version} lacks what extensible_kv.transformers relies on "
            f"({'; '.join(problems)}); supported: {SUPPORTED}"
        )
    return found


def enable(
    *,
    budget_bytes: int | None = None,
    host_free: bool = False,
    margin_bytes: int | None = None,
    granularity: int | None = None,
    auto_resize: AutoResize | bool | None = None,
    pool: Pool | str | None = None,
    min_blocks: int | None = None,
    max_blocks: int | None = None,
    min_bytes: int | None = None,
    max_bytes: int | None = None,
    engine: str | None = None,
    pool_via: str = "loan",
    pool_step_blocks: int | None = None,
    pool_move: bool = False,
    driver_rate: int | None = None,
) -> None:
    """Every continuous-batching manager transformers creates from now on gets an extensible
    KV cache, sized after its warm-up (see `extensible_kv.transformers`). Calling it again
    replaces the options. The options are `Options`' (each described there once), checked
    before anything changes; `UnsupportedError` (nothing patched) on an unsupported
    transformers.

    `enable(pool="name", min_blocks=..., max_blocks=...)` puts every manager's cache in that
    node pool while its generation loop runs: it starts at `min_blocks`, grows on demand
    through the pool (the device's free memory first, then the pool's idle engines' free
    blocks) by what its requests need, up to `max_blocks`, and lends its own free top blocks
    between its steps. `min_bytes=` / `max_bytes=` give those limits in bytes instead (a
    block's bytes differ from model to model)."""
    _torch.require("extensible_kv.transformers")
    options = Options(
        budget_bytes=budget_bytes,
        host_free=host_free,
        margin_bytes=margin_bytes,
        granularity=granularity,
        auto_resize=auto_resize,  # type: ignore[arg-type]  # True: Options' to turn into defaults
        pool=pool,
        min_blocks=min_blocks,
        max_blocks=max_blocks,
        min_bytes=min_bytes,
        max_bytes=max_bytes,
        engine=engine,
        pool_via=pool_via,
        pool_step_blocks=pool_step_blocks,
        pool_move=pool_move,
        driver_rate=driver_rate,
    )
    _apply(options)


def _apply(options: Options) -> None:
    found = _check_version()
    if options.auto_resize is not None or options.pool is not None:
        cache_class = found[_CACHE]
        if not hasattr(cache_class, "can_store_request_tokens"):
            what = "auto_resize" if options.pool is None else "pool"
            raise UnsupportedError(
                f"{what} needs PagedAttentionCache.can_store_request_tokens, which this "
                "transformers lacks (the scheduler's check the cache grows at)"
            )
    if not _patches:
        _install(found)
    _options.put(options)


def _install(found: Recognised) -> None:
    classes = _cache.build_classes(found[_CACHE], found[_HANDLER], found[_POOL])
    manager = found[_MANAGER]
    cache_module = sys.modules[_CACHE_MODULE]
    _patches.set(cache_module, "PagedAttentionMemoryHandler", classes.handler)
    # The class's own module keeps it (our subclass's base; later imports bind the original,
    # and only `continuous_api` builds caches).
    _patches.set_bindings(
        found[_CACHE],
        classes.cache,
        packages=(_PACKAGE,),
        name="PagedAttentionCache",
        skip=(cache_module,),
    )
    _patches.set(manager, "warmup", _wrap_warmup(vars(manager)["warmup"]))
    create = vars(manager)["_create_batch_processor"]
    _patches.set(manager, "_create_batch_processor", _wrap_create(create))
    run = vars(manager)["_run_generation_loop"]
    _patches.set(manager, "_run_generation_loop", _wrap_run(run))


def disable() -> None:
    """Puts back every object `enable` replaced (each the very object it was, where ours is still
    in place); managers created meanwhile keep their extensible caches until they are destroyed."""
    _patches.restore()
    _options.clear()


@contextmanager
def enabled(**options: Any) -> Iterator[None]:
    """`enable(**options)` for the block, then the state before it, whatever the block did
    (`disable()` or `enable` inside it included): disabled, or enabled with the options it
    had."""
    previous = current_options() if is_enabled() else None
    enable(**options)
    try:
        yield
    finally:
        if previous is None:
            disable()
        else:
            _apply(previous)


# ---------------------------------------------------------------------------------------------
# the hooks


def _wrap_warmup(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def warmup(self: Any, *args: Any, **kwargs: Any) -> Any:
        device = getattr(self.model, "device", None)
        if getattr(device, "type", None) == "cuda":
            import torch

            # The margin's transient peak is what the warm-up allocates beyond what it keeps.
            torch.cuda.reset_peak_memory_stats(device)
        token = _IN_WARMUP.set(True)
        try:
            result = original(self, *args, **kwargs)
        finally:
            _IN_WARMUP.reset(token)
        _extend(self, self.batch_processor, after_warmup=True)
        return result

    return warmup


def _wrap_create(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_batch_processor(self: Any, *args: Any, **kwargs: Any) -> Any:
        batch_processor = original(self, *args, **kwargs)
        if not _IN_WARMUP.get():
            # Outside the warm-up, the generation loop builds it as it starts, on its thread.
            _extend(self, batch_processor, after_warmup=False)
            _pooled.join(self, batch_processor)
        return batch_processor

    return create_batch_processor


def _wrap_run(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def run_generation_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            _pooled.leave(self)

    return run_generation_loop


def _extend(manager: Any, batch_processor: Any, *, after_warmup: bool) -> None:
    cache: Any = getattr(batch_processor, "cache", None)
    if not is_extensible(cache):
        return  # built before enable(): transformers' own cache
    ran_forward = after_warmup and bool(getattr(batch_processor.model_runner, "pad_inputs", True))
    peak = None if ran_forward else _cache.modelled_transient_peak_bytes(cache)
    report = _cache.extend(cache, transient_peak_bytes=peak)
    sizer = cache._ekv.sizer
    sizer.watch(manager, cache)
    if report is not None:
        _state["report"] = report
        # transformers memoizes the block count for the next cache it builds (after a stop):
        # the final size, which then caps that cache and sizes its buffers. A pool's cache
        # starts at its least and grows: its capacity stays the one it was built with.
        if sizer.kind != "pool":
            manager.continuous_batching_config.num_blocks = cache.num_blocks


# ---------------------------------------------------------------------------------------------
# suspend / resume, resize


def _cache_of(manager: Any, what: str) -> Any:
    """The cache of `manager`, or the error that names which mistake this is."""
    api = sys.modules.get(_API_MODULE)
    manager_class = getattr(api, "ContinuousBatchingManager", None)
    if manager_class is None or not isinstance(manager, manager_class):
        raise TypeError(
            f"{what} takes a transformers ContinuousBatchingManager (from "
            "model.init_continuous_batching() or continuous_batching_context_manager()), not "
            f"{type(manager).__name__}"
        )
    batch_processor = manager.batch_processor
    if batch_processor is not None:
        return batch_processor.cache
    if manager in _suspension.DROPPED_WHILE_SUSPENDED:
        raise RuntimeError(
            "this manager was stopped while its KV cache was suspended, without "
            "keep_for_next_session: the cache went with its batch processor, so there is "
            "nothing to resume, and its next start builds a new cache (stop("
            "keep_for_next_session=True) or persistent_manager=True keep a suspended cache)"
        )
    if manager.is_running():
        raise RuntimeError(
            "this manager's generation loop has not built its KV cache yet: transformers builds "
            f"it on the loop's own thread after start(); warm the manager up before start() "
            f"(manager.warmup(), as continuous_batching_context_manager does) or call {what} "
            "once a request has run"
        )
    raise RuntimeError(
        "this manager has no KV cache yet: warm it up (manager.warmup()) or start it first"
    )


def suspend(manager: Any, keep_blocks: int = 0) -> None:
    """Gives the KV cache's memory back to the driver while `manager`, its graphs and its
    buffers live, keeping its addresses: every block is freed and the prefix cache cleared (the
    contents are gone, as after a weight update), and the memory past the trash sectors and
    the first `keep_blocks` blocks is unmapped. Call it when no request is in flight
    (`RuntimeError` otherwise), from any thread.

    While suspended:
    - a running loop stays paused (transformers' `manager.pause()`, held by a thread of
      extensible-kv's own, so the thread that suspended may end);
    - `resume(manager)`, from any thread, recommits the memory and ends the pause;
    - `manager.start()` refuses (`RuntimeError`): resume first;
    - `manager.stop()` (leaving `continuous_batching_context_manager` too) ends the pause and
      stops the loop. With `keep_for_next_session=True` (`persistent_manager=True`) the cache
      stays suspended for a later `resume`; with transformers' default the cache goes with the
      batch processor, and the next start builds a new one."""
    _suspension.suspend(manager, _cache_of(manager, "suspend(manager)"), keep_blocks)


def release(manager: Any, keep_blocks: int = 0) -> None:
    """Deprecated: `suspend(manager, keep_blocks)`, the same call under its old name ("release"
    is the driver's word: memory given back for good). Warns (`DeprecationWarning`), then
    suspends."""
    warnings.warn(
        "extensible_kv.transformers.release(manager) is deprecated: call "
        "extensible_kv.transformers.suspend(manager), which does the same",
        DeprecationWarning,
        stacklevel=2,
    )
    suspend(manager, keep_blocks)


def resume(manager: Any) -> None:
    """Recommits the suspended memory at the same addresses (zeroed; the graphs stay valid),
    gives every block back to the pool and ends the pause, from any thread. On
    `OutOfMemoryError` the cache stays suspended and the loop paused: free memory and call it
    again."""
    _suspension.resume(_cache_of(manager, "resume(manager)"))


def resize(
    manager: Any, num_blocks: int, *, timeout: float | None = None, move: bool = False
) -> ExtendReport:
    """Resizes a live manager's KV cache to `num_blocks` blocks (rounded up to whole sectors),
    while requests run, and returns the report (`last_report()` returns it too).

    A grow commits the new memory (zeroed) and hands it to transformers' pool at once. A
    shrink takes the sectors past the new size out of the pool as they become free, blocks
    cached only for prefix sharing included, so no request is given them meanwhile, then
    unmaps them; blocks requests hold are waited for, up to `timeout` seconds (None: until
    they finish), after which `TimeoutError` names those requests and nothing has changed.
    With `move=True` they are not waited for: the loop paused, every sector past the new size
    that requests hold is copied into a free sector below it and the block tables (and the
    prefix cache's hashes) are renamed to the copy, so tokens are unchanged; `RuntimeError`
    if too few sectors below are free (nothing has changed then). The pool hands out its
    lowest free sector first, so live blocks gather at the bottom and the top is usually free.

    `TypeError` for a non-int `num_blocks`, `ValueError` below 1 or above the reservation's
    capacity; `RuntimeError` while suspended or before the first extension."""
    cache = _cache_of(manager, "resize(manager, num_blocks)")
    report = _resizing.resize(manager, cache, num_blocks, timeout, _args.flag(move, "move"))
    _state["report"] = report
    manager.continuous_batching_config.num_blocks = cache.num_blocks
    return report
