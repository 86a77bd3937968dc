"""SGLang's automatic resize policy (`EXTENSIBLE_KV_SGLANG_AUTO`, design §8b), with SGLang's code
unchanged: the plugin wraps the scheduler's `get_next_batch_to_run` (called once per loop turn,
before the next batch is planned) and `on_idle` (the loop's housekeeping while no batch runs),
and each scheduler gets an `AutoPolicy` at its first turn. Everything runs on the scheduler's
own thread, between its steps, through `extensible_kv.sglang.resize`.

- **Grow** before a batch is planned, when the waiting requests do not fit what the allocator
  has free (with what the radix cache could evict): by their need (each one's input plus its
  `max_new_tokens`), at least `step_tokens` and at least doubling, up to `max_tokens`. A grow
  appends page ids to the allocator's free list and commits memory past every slot a batch
  in flight uses, so it needs no quiet GPU.
- **Shrink** to `min_tokens` once the scheduler has been fully idle for `idle_s`: the radix
  cache is evicted first; pages still held (a request SGLang keeps) leave the size as it is.
  The resize's own wait (`finalize_backing`) makes the memory the driver's before it returns.

Defaults: `max_tokens` the size at start (what post-capture sizing measured), `min_tokens` a
sixteenth of it, `step_tokens` an eighth of the most, `idle_s` 10; sizes in whole pages. Only
the allocators `resize` handles (token, paged) over our arena: any other is refused at the
first turn with a warning, and the scheduler runs unchanged.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from extensible_kv import _args
from extensible_kv._native import UnsupportedError
from extensible_kv.sglang.owner import KvVmmBufferOwner
from extensible_kv.sglang.resize import resize

__all__ = ["AUTO_ENV_VAR", "AutoPolicy", "AutoSettings", "Hooks"]

AUTO_ENV_VAR = "EXTENSIBLE_KV_SGLANG_AUTO"

logger = logging.getLogger("sglang.extensible_kv")


@dataclass(frozen=True)
class AutoSettings:
    """The policy's bounds, in tokens (see the module's docstring); None: its default."""

    min_tokens: int | None = None
    max_tokens: int | None = None
    step_tokens: int | None = None
    idle_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("min_tokens", "max_tokens", "step_tokens"):
            value = _args.optional_size(getattr(self, name), name, minimum=1)
            object.__setattr__(self, name, value)
        low, high = self.min_tokens, self.max_tokens
        if low is not None and high is not None and high < low:
            raise ValueError(f"max_tokens {high} is below min_tokens {low}")
        object.__setattr__(self, "idle_s", _args.seconds(self.idle_s, "idle_s", optional=False))

    @classmethod
    def parse(cls, text: str) -> AutoSettings | None:
        """`EXTENSIBLE_KV_SGLANG_AUTO`'s value: empty, `0`, `false`, `off` or `no`: None (off);
        `1`, `true`, `on` or `yes`: the defaults; else `key=value` pairs of min_tokens,
        max_tokens, step_tokens, idle_s separated by commas. A `ValueError` naming the
        variable otherwise."""
        return _args.env_settings(cls, text, AUTO_ENV_VAR)


class AutoPolicy:
    """The automatic policy of one SGLang scheduler (see the module's docstring): `scheduler`
    is SGLang's `Scheduler` (its allocator, waiting queue, radix cache); `clock` is
    `time.monotonic` (a test's stand-in). An `UnsupportedError` for an allocator or pool
    `resize` does not handle."""

    def __init__(
        self,
        scheduler: Any,
        settings: AutoSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        allocator = scheduler.token_to_kv_pool_allocator
        kind = type(allocator).__name__
        if kind not in ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator"):
            raise UnsupportedError(f"SGLang's {kind} is not resized at run time (design §8b)")
        owner = getattr(allocator.get_kvcache(), "_post_capture_owner", None)
        if not isinstance(owner, KvVmmBufferOwner):
            raise UnsupportedError(
                "the KV pool is not backed by extensible-kv's arena (is the plugin on, and "
                "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1?)"
            )
        self.scheduler = scheduler
        self.allocator = allocator
        self.clock = clock
        page = self.page = int(allocator.page_size)
        start = int(allocator.size)
        most = settings.max_tokens if settings.max_tokens is not None else start
        self.max_tokens = max(page, min(most, int(owner.reserved_num_tokens)) // page * page)
        least = settings.min_tokens if settings.min_tokens is not None else start // 16
        self.min_tokens = min(self.max_tokens, max(page, -(-least // page) * page))
        step = settings.step_tokens or self.max_tokens // 8
        self.step_tokens = max(page, -(-step // page) * page)
        self.idle_s = settings.idle_s
        self.last_active = clock()
        self.out_of_memory_logged = False
        logger.info(
            "extensible-kv: the KV pool resizes itself between %d and %d tokens (%d now; idle "
            "after %.1f s).",
            self.min_tokens,
            self.max_tokens,
            start,
            self.idle_s,
        )

    @property
    def size(self) -> int:
        return int(self.allocator.size)

    def before_batch(self) -> None:
        """Before the scheduler plans its next batch: grows for its waiting requests."""
        scheduler = self.scheduler
        waiting = list(getattr(scheduler, "waiting_queue", ()))
        running = getattr(scheduler, "running_batch", None)
        if waiting or (running is not None and not running.is_empty()):
            self.last_active = self.clock()
        if not waiting or self.size >= self.max_tokens:
            return
        need = sum(len(r.origin_input_ids) + int(r.sampling_params.max_new_tokens) for r in waiting)
        head = len(waiting[0].origin_input_ids) + 1
        cache = getattr(scheduler, "tree_cache", None)
        evictable = int(cache.evictable_size()) if cache is not None else 0
        free = int(self.allocator.available_size()) + evictable
        if free >= max(head, need):
            return
        grow_by = max(max(head, need) - free, self.step_tokens, self.size)
        target = min(self.max_tokens, -(-(self.size + grow_by) // self.page) * self.page)
        try:
            resize(self.allocator, target, scheduler=scheduler)
        except MemoryError as error:  # `OutOfMemoryError` is one: the size is as it was
            if not self.out_of_memory_logged:
                self.out_of_memory_logged = True
                logger.warning(
                    "extensible-kv: the KV pool could not grow to %d tokens (%s); it stays at "
                    "%d and grows when memory is free again.",
                    target,
                    error,
                    self.size,
                )
            return
        self.out_of_memory_logged = False

    def idle(self) -> None:
        """The loop's idle housekeeping: shrinks once fully idle for `idle_s`."""
        scheduler = self.scheduler
        fully_idle = getattr(scheduler, "is_fully_idle", None)
        if callable(fully_idle) and not fully_idle():
            self.last_active = self.clock()
            return
        if self.clock() - self.last_active < self.idle_s or self.size <= self.min_tokens:
            return
        cache = getattr(scheduler, "tree_cache", None)
        if cache is not None and int(cache.evictable_size()) > 0:
            _evict_all(cache)
        try:
            resize(self.allocator, self.min_tokens, scheduler=scheduler)
        except RuntimeError as error:  # pages still held: the size stays
            logger.debug("extensible-kv: the idle KV pool keeps its size: %s", error)
            self.last_active = self.clock()  # tried again after another idle time


def _evict_all(cache: Any) -> None:
    """Evicts everything the radix cache holds that no request uses (SGLang 0.5.23's
    `evict(EvictParams)`; older ones took a token count)."""
    num_tokens = int(cache.evictable_size())
    try:
        from sglang.srt.mem_cache.base_prefix_cache import (  # type: ignore[import-untyped]
            EvictParams,
        )
    except ImportError:  # pragma: no cover - an SGLang before EvictParams
        cache.evict(num_tokens)
        return
    cache.evict(EvictParams(num_tokens=num_tokens))


class Hooks:
    """The plugin's AROUND hooks on SGLang's `Scheduler` (`get_next_batch_to_run`, `on_idle`),
    with one `AutoPolicy` per scheduler made at its first turn (None, once warned, where the
    pool cannot be resized). A policy's error is logged, the first few times, and the
    scheduler serves on."""

    def __init__(self, settings: AutoSettings) -> None:
        self.settings = settings
        self._policies: weakref.WeakKeyDictionary[Any, AutoPolicy | None] = (
            weakref.WeakKeyDictionary()
        )
        self.failures = 0

    def policy_of(self, scheduler: Any) -> AutoPolicy | None:
        if scheduler in self._policies:
            return self._policies[scheduler]
        policy: AutoPolicy | None = None
        try:
            policy = AutoPolicy(scheduler, self.settings)
        except UnsupportedError as error:
            logger.warning("extensible-kv: %s is set, but %s", AUTO_ENV_VAR, error)
        self._policies[scheduler] = policy
        return policy

    def get_next_batch_to_run(self, original: Any, scheduler: Any, *args: Any, **kw: Any) -> Any:
        policy = self.policy_of(scheduler)
        if policy is not None:
            self._safely(policy.before_batch)
        return original(scheduler, *args, **kw)

    def on_idle(self, original: Any, scheduler: Any, *args: Any, **kw: Any) -> Any:
        result = original(scheduler, *args, **kw)
        policy = self.policy_of(scheduler)
        if policy is not None:
            self._safely(policy.idle)
        return result

    def _safely(self, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception:
            self.failures += 1
            if self.failures <= 3:
                logger.exception("extensible-kv: the KV pool's resize policy failed (serving on)")
