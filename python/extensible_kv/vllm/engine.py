"""The engine core's step boundaries, and the automatic resize policy on them (design §8b), with
vLLM's code unchanged.

With `EXTENSIBLE_KV_VLLM_AUTO` set, the plugin wraps vLLM 0.34's `EngineCore.step` and
`EngineCore.step_with_batch_queue` (the methods `step_fn` binds as the core is built), and
each engine core gets a `StepHook` at its first step:

- **Before each step** the policy runs on the core's thread (`AutoPolicy.before_step`): it
  grows the cache when the scheduler cannot admit its waiting requests, and completes a
  shrink whose blocks are all free. A grow is safe with a batch in flight (the workers map
  memory past every block a batch uses; with one GPU the worker runs on this thread, and
  with several the commit queues behind the batch on each worker). A shrink's end is not:
  a batch scheduled before a request finished may still write that request's blocks. So
  under async scheduling (the batch queue), when a drained shrink waits for its end, the
  hook drains the queue first: that call skips scheduling (`scheduler.has_requests` says
  False for it) and finishes the oldest batch in flight; a pipeline bubble only then.
- **While idle** the core waits on its input queue, and no step runs. A daemon thread of the
  hook wakes it when the policy wants a call (its idle shrink is due): it appends a
  callback to vLLM's idle-state callbacks, which the loop runs while it has no work, and
  puts vLLM's `WAKEUP` sentinel on the input queue. An engine driven in-process (no busy
  loop, no input queue) runs the policy before its steps only.

The policy (`AutoSettings`, from the environment variable): the cache may range from
`min_blocks` (default: a sixteenth of the size at start, at least 2) to `max_blocks`
(default: the size at start, what the flow measured as fitting); it grows by what the
waiting requests need (prompt plus `max_tokens` each, in the scheduler's blocks), at least
`step_blocks` (default: an eighth of the most) and at least doubling, when the scheduler
cannot admit the first of them or running requests have fewer free blocks than they are
(each may need one at its next step); it shrinks to its least once no request has been
in the scheduler for `idle_s` seconds (default 10). A commit the device refuses (out of
memory: another process took it) leaves the size, logged once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from extensible_kv import _args
from extensible_kv._native import UnsupportedError
from extensible_kv.vllm.resize import KvResizer

__all__ = [
    "AUTO_ENV_VAR",
    "AutoPolicy",
    "AutoSettings",
    "Policy",
    "StepHook",
    "hook_of",
    "policy_maker",
    "wrap_shutdown",
    "wrap_sleep",
    "wrap_step",
]

AUTO_ENV_VAR = "EXTENSIBLE_KV_VLLM_AUTO"  # the plugin reads it (plugin.AUTO_ENV_VAR)

logger = logging.getLogger("vllm.extensible_kv")

# The most a wake-up for an idle call is late; and the pacer's longest sleep (it looks again).
IDLE_CALL_S = 0.005
PACER_SLEEP_S = 1.0


@dataclass(frozen=True)
class AutoSettings:
    """The automatic policy's bounds (see the module's docstring); None: its default."""

    min_blocks: int | None = None
    max_blocks: int | None = None
    step_blocks: int | None = None
    idle_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("min_blocks", "max_blocks", "step_blocks"):
            value = _args.optional_size(getattr(self, name), name, minimum=1)
            object.__setattr__(self, name, value)
        if self.min_blocks is not None and self.min_blocks < 2:
            raise ValueError(
                f"min_blocks must be at least 2 (vLLM's null block), not {self.min_blocks}"
            )
        if (
            self.max_blocks is not None
            and self.min_blocks is not None
            and self.max_blocks < self.min_blocks
        ):
            raise ValueError(f"max_blocks {self.max_blocks} is below min_blocks {self.min_blocks}")
        object.__setattr__(self, "idle_s", _args.seconds(self.idle_s, "idle_s", optional=False))

    @classmethod
    def parse(cls, text: str) -> AutoSettings | None:
        """`EXTENSIBLE_KV_VLLM_AUTO`'s value: empty, `0`, `false`, `off` or `no`: None (off);
        `1`, `true`, `on` or `yes`: the defaults; else `key=value` pairs separated by commas
        (`min_blocks=64,idle_s=30`). A `ValueError` naming the variable otherwise."""
        return _args.env_settings(cls, text, AUTO_ENV_VAR)


class AutoPolicy:
    """The automatic policy over one engine core's `KvResizer` (see the module's docstring).
    `scheduler` is the core's; `clock` is `time.monotonic` (a test's stand-in)."""

    def __init__(
        self,
        resizer: KvResizer,
        scheduler: Any,
        settings: AutoSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.resizer = resizer
        self.scheduler = scheduler
        self.clock = clock
        start = resizer.num_blocks
        most = settings.max_blocks if settings.max_blocks is not None else start
        self.max_blocks = min(most, resizer.capacity_blocks())
        least = settings.min_blocks if settings.min_blocks is not None else max(2, start // 16)
        self.min_blocks = min(least, self.max_blocks)
        self.step_blocks = settings.step_blocks or max(1, self.max_blocks // 8)
        self.idle_s = settings.idle_s
        self.last_active = clock()
        self.out_of_memory_logged = False
        logger.info(
            "extensible-kv: the KV cache resizes itself between %d and %d blocks (%d now; "
            "idle after %.1f s).",
            self.min_blocks,
            self.max_blocks,
            start,
            self.idle_s,
        )

    # ---- what the hook asks ------------------------------------------------------------
    def wants_drain(self) -> bool:
        """A shrink whose blocks are all free waits for its end, which needs no batch in
        flight."""
        pool = self.resizer
        return pool.shrinking_to is not None and pool.drained

    def next_idle_call(self) -> float | None:
        """Seconds until an idle engine's policy has something to do (its shrink); None:
        nothing while idle."""
        if self.resizer.num_blocks <= self.min_blocks and self.resizer.shrinking_to is None:
            return None
        if self.resizer.shrinking_to is not None:
            return 0.0
        return max(0.0, self.last_active + self.idle_s - self.clock())

    # ---- at a boundary -----------------------------------------------------------------
    def before_step(self, *, in_flight: bool) -> None:
        """Runs before a step (`in_flight`: batches are in flight, so a shrink cannot end)."""
        if self.resizer.asleep:
            return  # its memory is released: resized again once it wakes
        scheduler = self.scheduler
        now = self.clock()
        # Unfinished ones: finished requests the next step reports keep `has_requests` true.
        unfinished = getattr(scheduler, "has_unfinished_requests", scheduler.has_requests)
        busy = bool(unfinished())
        if busy:
            self.last_active = now
        resizer = self.resizer
        if not in_flight and resizer.shrinking_to is not None:
            resizer.poll()
        target = self._grow_target()
        if target is not None:
            self._resize(target)
        elif not busy and not in_flight and now - self.last_active >= self.idle_s:
            if resizer.num_blocks > self.min_blocks:
                self._resize(self.min_blocks)

    def idle(self) -> None:
        """An idle call: the engine has no request and no batch in flight."""
        self.before_step(in_flight=False)

    def leave(self) -> None:
        return None  # nothing to settle: the size stays as it is

    def sleep_refusal(self) -> str | None:
        return None  # asleep, it resizes nothing (`before_step`)

    def _grow_target(self) -> int | None:
        """The size to grow to, or None: the waiting requests fit, and every running one has
        a free block for its next token."""
        scheduler = self.scheduler
        resizer = self.resizer
        size = resizer.num_blocks
        if size >= self.max_blocks:
            return None
        free = resizer.free_blocks
        need = resizer.waiting_need() or len(scheduler.running)
        if free >= need:
            return None
        grow_by = max(need - free, self.step_blocks, size)
        return min(self.max_blocks, size + grow_by)

    def _resize(self, num_blocks: int) -> None:
        try:
            self.resizer.resize(num_blocks)
        except MemoryError as error:  # `OutOfMemoryError` is one; the ranks are back as they were
            if not self.out_of_memory_logged:
                self.out_of_memory_logged = True
                logger.warning(
                    "extensible-kv: the KV cache could not grow to %d blocks (%s); it stays "
                    "at %d and grows when memory is free again.",
                    num_blocks,
                    error,
                    self.resizer.num_blocks,
                )
            return
        self.out_of_memory_logged = False


class StepHook:
    """One engine core's boundaries: its steps go through `step`, and a pacer thread makes the
    policy's idle calls (see the module's docstring)."""

    def __init__(self, core: Any, policy: Policy) -> None:
        self.policy = policy
        self._core = weakref.ref(core)
        self._lock = threading.Lock()
        # The pacer looks again now (else within `PACER_SLEEP_S`, or when a call is due).
        self._wanted = threading.Event()
        self._idle_call_queued = False
        self._pacer: threading.Thread | None = None
        self.failures = 0
        if hasattr(core, "input_queue") and hasattr(core, "_idle_state_callbacks"):
            self._pacer = threading.Thread(
                target=self._pace, name="extensible-kv-pacer", daemon=True
            )
            self._pacer.start()

    # ---- steps -------------------------------------------------------------------------
    def step(self, original: Callable[[Any], Any], core: Any) -> Any:
        """`original(core)` (vLLM's step or step_with_batch_queue), with the policy before
        it; under async scheduling, a drain step instead when the policy waits for one."""
        queue = getattr(core, "batch_queue", None)
        if queue and self._safely(self.policy.wants_drain):
            with _no_new_batch(core.scheduler):
                return original(core)
        self._safely(lambda: self.policy.before_step(in_flight=bool(queue)))
        return original(core)

    # ---- idle calls --------------------------------------------------------------------
    def _pace(self) -> None:
        while True:
            core = self._core()
            if core is None or not _running(core):
                return
            due = self._safely(self.policy.next_idle_call)
            del core
            if due is None:
                self._wanted.wait(PACER_SLEEP_S)
                self._wanted.clear()
                continue
            if due > 0:
                self._wanted.wait(min(due, PACER_SLEEP_S))
                self._wanted.clear()
                continue
            self._queue_idle_call()
            time.sleep(IDLE_CALL_S)

    def _queue_idle_call(self) -> None:
        core = self._core()
        if core is None:
            return
        with self._lock:
            if self._idle_call_queued:
                return
            self._idle_call_queued = True
        core._idle_state_callbacks.append(self._idle_call)
        with contextlib.suppress(Exception):  # the queue is gone: the core is ending
            from vllm.v1.engine import EngineCoreRequestType

            core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    def _idle_call(self, core: Any) -> None:
        with self._lock:
            self._idle_call_queued = False
        if not core.batch_queue and not core.scheduler.has_requests():
            self._safely(self.policy.idle)

    def _safely(self, call: Callable[[], Any]) -> Any:
        """The policy must not stop the engine: an error is logged (the first few times)."""
        try:
            return call()
        except Exception:
            self.failures += 1
            if self.failures <= 3:
                logger.exception("extensible-kv: the KV cache's resize policy failed (serving on)")
            return None


def _running(core: Any) -> bool:
    is_running = getattr(core, "is_running", None)
    return bool(is_running()) if callable(is_running) else True


@contextlib.contextmanager
def _no_new_batch(scheduler: Any) -> Iterator[None]:
    """For one `step_with_batch_queue`: it schedules nothing and finishes the oldest batch in
    flight (an instance attribute over the class's method, removed after)."""
    scheduler.has_requests = lambda: False
    try:
        yield
    finally:
        del scheduler.has_requests


class Policy(Protocol):
    """What a `StepHook` runs: the automatic policy (`AutoPolicy`) or the pool membership
    (`extensible_kv.vllm.pooled.PooledPolicy`)."""

    def wants_drain(self) -> bool: ...
    def next_idle_call(self) -> float | None: ...
    def before_step(self, *, in_flight: bool) -> None: ...
    def idle(self) -> None: ...
    def leave(self) -> None: ...
    def sleep_refusal(self) -> str | None: ...


MakePolicy = Callable[[Any, KvResizer], Policy]

# The hooks of the engine cores of this process (a core is built once, in its own process).
_HOOKS: weakref.WeakKeyDictionary[Any, StepHook | None] = weakref.WeakKeyDictionary()


def hook_of(core: Any, make_policy: MakePolicy) -> StepHook | None:
    """`core`'s hook, made at its first step: None (once warned) where the cache cannot be
    resized (a block pool not ours, a worker cache that is not extensible, several ranks in
    a pool)."""
    if core in _HOOKS:
        return _HOOKS[core]
    hook: StepHook | None = None
    try:
        sleeping = getattr(core, "is_sleeping", None)
        resizer = KvResizer(
            core.scheduler,
            core.model_executor.collective_rpc,
            is_sleeping=sleeping if callable(sleeping) else None,
        )
        hook = StepHook(core, make_policy(core, resizer))
    except UnsupportedError as error:
        logger.warning("extensible-kv: the KV cache cannot resize itself: %s", error)
    _HOOKS[core] = hook
    return hook


def policy_maker(auto: AutoSettings | None, pool: Any = None) -> MakePolicy:
    """What makes each core's policy: the pool membership where `pool` (a
    `extensible_kv.vllm.pooled.PoolSettings`) is given, else the automatic policy."""

    def make(core: Any, resizer: KvResizer) -> Policy:
        if pool is not None:
            from extensible_kv.vllm.pooled import PooledPolicy

            return PooledPolicy(core, resizer, pool)
        return AutoPolicy(resizer, core.scheduler, auto or AutoSettings())

    return make


def wrap_step(original: Callable[[Any], Any], make_policy: MakePolicy) -> Callable[[Any], Any]:
    """vLLM's `EngineCore.step` (or `step_with_batch_queue`) through the core's hook."""

    def step(self: Any) -> Any:
        hook = hook_of(self, make_policy)
        if hook is None:
            return original(self)
        return hook.step(original, self)

    return _like(step, original)


def wrap_shutdown(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """vLLM's `EngineCore.shutdown`, after the core's policy leaves (its pool: loans given
    back and taken back, on the core's thread)."""

    def shutdown(self: Any) -> Any:
        hook = _HOOKS.get(self)
        if hook is not None:
            hook._safely(hook.policy.leave)
        return original(self)

    return _like(shutdown, original)


def wrap_sleep(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's `EngineCore.sleep`, refused (an `UnsupportedError` the client gets) where the
    core's policy cannot let its memory go (an engine in the node pool: its loans and the
    ledger's count would outlive the memory)."""

    def sleep(self: Any, *args: Any, **kwargs: Any) -> Any:
        hook = _HOOKS.get(self)
        why = hook.policy.sleep_refusal() if hook is not None else None
        if why is not None:
            raise UnsupportedError(why)
        return original(self, *args, **kwargs)

    return _like(sleep, original)


def _like(wrapper: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__name__ = original.__name__
    wrapper.__qualname__ = original.__qualname__
    wrapper.__doc__ = original.__doc__
    return wrapper
