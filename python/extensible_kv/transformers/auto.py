"""The automatic resize policy (`enable(auto_resize=AutoResize(...))`): `AutoSizer`, a cache's
sizer under it.

It grows on the generation loop's own thread, inside transformers' scheduler: where a request
finds too few free sectors (`grow_on_demand`) or the margin check finds under
`GROW_BELOW_FREE` of the cache free (`grow_to_margin`), by what is missing, at least a step
and at least doubling, up to its most; a commit the device refuses leaves the size as it is.
A daemon thread of its own (`watch`) shrinks the cache back to its least once no request has
held a block for the idle time. Every change takes the cache's resize lock, without waiting
for it: a resize, suspension or resume in flight wins, and the policy tries again later.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

from extensible_kv._native import OutOfMemoryError
from extensible_kv.transformers import sectors
from extensible_kv.transformers.options import AutoResize
from extensible_kv.transformers.resizing import grow_live, shrink_live
from extensible_kv.transformers.state import GIB, TRASH_SECTORS, CacheState, logger

__all__ = ["AutoSizer"]


@dataclass
class AutoSizer:
    """`AutoResize` in sectors, with what the policy observes."""

    kind: ClassVar[str] = "auto"

    min_sectors: int
    max_sectors: int
    step_sectors: int
    idle_s: float
    last_active: float = field(default_factory=time.monotonic)
    watching: bool = False
    out_of_memory_logged: bool = False

    @classmethod
    def within(cls, state: CacheState, policy: AutoResize, fit_sectors: int) -> AutoSizer:
        """The policy's bounds, in sectors: the most is what the extension measured as fitting
        (`fit_sectors`) unless `max_blocks` says otherwise, within the reservation."""
        to_sectors = state.sectors
        most = fit_sectors if policy.max_blocks is None else to_sectors(policy.max_blocks)
        most = min(most, state.capacity_sectors)
        least = min(to_sectors(policy.min_blocks), most)
        step = to_sectors(policy.step_blocks) if policy.step_blocks else max(1, most // 8)
        logger.info(
            "KV cache resizes itself between %d and %d blocks (idle after %.1f s)",
            state.blocks(least),
            state.blocks(most),
            policy.idle_s,
        )
        return cls(least, most, step, float(policy.idle_s))

    # -- the sizer's hooks --------------------------------------------------------------------

    def grow_on_demand(self, cache: Any, request: Any, request_len: int) -> bool:
        """Grows by what `request` lacks (at least a step, at least doubling)."""
        return self.grow(cache, sectors.missing_sectors(cache, request, request_len))

    def grow_to_margin(self, cache: Any) -> bool:
        """Grows so that at least `GROW_BELOW_FREE` of the cache is free."""
        missing = sectors.margin_sectors(cache)
        return missing > 0 and self.grow(cache, missing)

    def refuse(self, what: str) -> None:
        return None  # `resize` and `suspend` take the resize lock: the policy waits its turn

    # -- growing and shrinking ----------------------------------------------------------------

    def grow(self, cache: Any, missing: int) -> bool:
        """The policy's grow by `missing` sectors (at least a step, at least doubling, up to
        the most). True when it grew."""
        state: CacheState = cache._ekv
        if not state.resizing.acquire(blocking=False):
            return False
        try:
            # Under the lock: a suspension or resize that held it changed them.
            final = state.final_sectors
            if state.suspended or final is None:
                return False
            self.last_active = time.monotonic()
            target = min(self.max_sectors, final + max(missing, self.step_sectors, final))
            if missing <= 0 or target <= final or state.capturing():
                return False
            try:
                grow_live(cache, state, target)
            except OutOfMemoryError as error:
                if not self.out_of_memory_logged:
                    self.out_of_memory_logged = True
                    logger.warning(
                        "KV cache could not grow on demand (it stays as it is): %s", error
                    )
                return False
            logger.info(
                "Grew KV cache on demand from %d to %d blocks (%.2f GiB)",
                state.blocks(final),
                state.blocks(target),
                state.tensor.physical_bytes / GIB,
            )
            return True
        finally:
            state.resizing.release()

    def watch(self, manager: Any, cache: Any) -> None:
        """A daemon thread that shrinks the cache back to its least once no request has held a
        block for the idle time; it ends with the manager or the cache (or its sizer)."""
        if self.watching:
            return
        self.watching = True
        manager_ref, cache_ref = weakref.ref(manager), weakref.ref(cache)

        def watch() -> None:
            while True:
                time.sleep(min(max(self.idle_s / 4, 0.01), 1.0))
                manager, cache = manager_ref(), cache_ref()
                if manager is None or cache is None or cache._ekv.sizer is not self:
                    return
                self._shrink_if_idle(manager, cache)
                del manager, cache

        threading.Thread(target=watch, name="extensible-kv-auto-resize", daemon=True).start()

    def _shrink_if_idle(self, manager: Any, cache: Any) -> None:
        state: CacheState = cache._ekv
        idle = time.monotonic() - self.last_active >= self.idle_s
        if not idle or not manager.is_running() or sectors.requests_holding(cache, TRASH_SECTORS):
            return
        if not state.resizing.acquire(blocking=False):
            return
        try:
            # Under the lock: a suspension or resize that held it changed them.
            final = state.final_sectors
            if state.suspended or final is None or final <= self.min_sectors:
                return
            shrink_live(manager, cache, state, self.min_sectors, timeout=0, move=False)
        except TimeoutError:
            return  # a request arrived meanwhile: the next idle period
        except Exception as error:  # the policy's thread must not die of one failure
            logger.warning("KV cache could not shrink when idle: %s", error)
            return
        finally:
            state.resizing.release()
        logger.info(
            "Shrank idle KV cache from %d to %d blocks (%.2f GiB)",
            state.blocks(final),
            state.blocks(self.min_sectors),
            state.tensor.physical_bytes / GIB,
        )
