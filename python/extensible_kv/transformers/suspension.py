"""Suspending a live cache: its memory given back to the driver while the manager, its graphs
and its buffers live, at the same addresses, and taken again by `resume` (RL loops). The
public functions are `extensible_kv.transformers.suspend` / `resume` (`release`, the old name,
warns and suspends).

While suspended, a running loop stays paused: transformers' `manager.pause()`, held by a thread
of ours (`PauseHolder`), so that any thread may end it. That manager's `start` refuses and its
`stop` first ends the pause (`Suspension`: instance attributes of that one manager, gone at
`resume`; transformers' class is never patched for them).
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from extensible_kv import _args, flow
from extensible_kv.transformers import sectors
from extensible_kv.transformers.state import GIB, TRASH_SECTORS, CacheState, logger, state_of

__all__ = ["DROPPED_WHILE_SUSPENDED", "PauseHolder", "Suspension", "resume", "suspend"]


class PauseHolder:
    """transformers' `manager.pause()`, entered and left by a thread of its own.

    transformers counts a pause per thread: only the thread that entered it may leave it, and
    `stop` refuses to run on a thread that holds one. Held by the thread that called `suspend`,
    a pause would outlive that thread when it ends (a worker, an executor): no other thread
    could end it, `stop` would wait forever for the parked loop, and the loop's thread (not a
    daemon) would keep the interpreter from exiting. Held here, any thread ends it (`leave`)."""

    def __init__(self, manager: Any) -> None:
        self._entered = threading.Event()
        self._leave = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._hold, args=(manager,), name="extensible-kv-pause", daemon=True
        )
        self._thread.start()
        try:
            self._entered.wait()
        except BaseException:  # interrupted while the loop finishes its step: no pause kept
            self.leave()
            raise
        if self._error is not None:
            self._thread.join()
            raise self._error

    def _hold(self, manager: Any) -> None:
        try:
            with manager.pause():
                self._entered.set()
                self._leave.wait()
        except BaseException as error:  # handed to the thread that asked for the pause
            self._error = error
        finally:
            self._entered.set()

    def leave(self) -> None:
        """Ends the pause (the loop runs on) and waits until it is left; idempotent."""
        self._leave.set()
        self._thread.join()


# Managers stopped without `keep_for_next_session` while suspended: their cache went with the
# batch processor, so `resume` has nothing to resume (`patch._cache_of` says so).
DROPPED_WHILE_SUSPENDED: weakref.WeakSet[Any] = weakref.WeakSet()


@dataclass
class Suspension:
    """A suspended cache's hold on its manager: the pause (a running loop's), and the manager
    whose `start` and `stop` are guarded (None once its `stop` dropped the cache)."""

    pause: PauseHolder | None
    guarded: Any = None

    def end_pause(self) -> None:
        pause, self.pause = self.pause, None
        if pause is not None:
            pause.leave()

    def guard(self, manager: Any, state: CacheState) -> None:
        """While suspended, `manager.start` refuses (its pool holds no block to serve from) and
        `manager.stop` first ends the pause (transformers' `stop` would wait forever for a
        paused loop)."""
        original_stop = manager.stop

        @functools.wraps(original_stop)
        def stop(*args: Any, **kwargs: Any) -> Any:
            self.end_pause()
            result = original_stop(*args, **kwargs)
            if getattr(getattr(manager.batch_processor, "cache", None), "_ekv", None) is not state:
                self.unguard()
                DROPPED_WHILE_SUSPENDED.add(manager)
                logger.info(
                    "Manager stopped while its KV cache is suspended, without "
                    "keep_for_next_session: the cache went with its batch processor, and the "
                    "next start builds a new one"
                )
            else:
                logger.info(
                    "Manager stopped while its KV cache is suspended: resume(manager) before "
                    "starting it again"
                )
            return result

        @functools.wraps(manager.start)
        def start(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                "this manager's KV cache is suspended (it holds no block to serve from): call "
                "extensible_kv.transformers.resume(manager) before starting it"
            )

        manager.stop, manager.start = stop, start
        self.guarded = manager

    def unguard(self) -> None:
        manager, self.guarded = self.guarded, None
        if manager is not None:
            for name in ("start", "stop"):
                vars(manager).pop(name, None)

    def end(self) -> None:
        """The manager as it was: unguarded, and its loop running on."""
        self.unguard()
        self.end_pause()


def suspend(manager: Any, cache: Any, keep_blocks: int) -> None:
    """See `extensible_kv.transformers.suspend`."""
    state = state_of(cache)
    keep_blocks = _args.size(keep_blocks, "keep_blocks")
    state.sizer.refuse("suspend")
    with state.resizing:  # not while a resize (the policy's, say) runs: read what it left
        if state.final_sectors is None:
            raise RuntimeError(
                "the KV cache is not sized yet: suspend it after the manager's warm-up or start"
            )
        if state.suspended:
            raise RuntimeError("the KV cache is already suspended: call resume(manager) first")
        keep = min(state.sectors(keep_blocks), state.final_sectors)
        suspension = Suspension(_give_back(manager, cache, state, keep))
        suspension.guard(manager, state)
        state.suspension = suspension
    logger.info(
        "Suspended KV cache: %d blocks kept (%.2f GiB)",
        state.blocks(keep),
        state.tensor.physical_bytes / GIB,
    )


def _give_back(manager: Any, cache: Any, state: CacheState, keep: int) -> PauseHolder | None:
    """`suspend`'s work, all or nothing: the loop paused (if it runs), every block freed, the
    memory past the trash and `keep` sectors unmapped; the pause it holds, if any."""
    pause = PauseHolder(manager) if manager.is_running() else None
    try:
        busy = sectors.busy_requests(cache)
        if busy:
            raise RuntimeError(
                f"{len(busy)} requests hold KV blocks ({', '.join(busy[:3])}...): suspend the "
                "cache once they are finished"
            )
        flow.refuse_while_capturing(state.device, "suspend")
        cache.reset()  # every block free, the prefix cache forgotten: the contents are gone
        state.synchronize()
        # Exact, and gone on return (released to the driver for another user): what stays is
        # the granule-rounded footprint of the trash and the kept sectors. The tensor
        # remembers its size for `resume`.
        state.tensor.suspend((TRASH_SECTORS + keep) * state.bytes_per_sector)
        state.committed_sectors = keep
        state.synchronize()
        sectors.hand_to_pool(cache, keep)
    except BaseException:
        if pause is not None:
            pause.leave()
        raise
    return pause


def resume(cache: Any) -> None:
    """See `extensible_kv.transformers.resume`."""
    state = state_of(cache)
    with state.resizing:  # a resume it waited for leaves nothing to resume
        if not state.suspended or state.final_sectors is None:
            raise RuntimeError("the KV cache is not suspended: nothing to resume")
        flow.refuse_while_capturing(state.device, "resume")
        state.tensor.resume()  # all or nothing: on OutOfMemoryError, still suspended
        state.synchronize()  # zeroed before transformers' own stream reads it
        # The size suspended from is the final one; were it less, the commit grows the rest.
        state.committed_sectors = (
            state.tensor.bytes_per_segment // state.bytes_per_sector - TRASH_SECTORS
        )
        state.commit(state.final_sectors)
        sectors.hand_to_pool(cache, state.final_sectors)
        suspension, state.suspension = state.suspension, None
        if suspension is not None:
            suspension.end()
    logger.info(
        "Resumed KV cache at %d blocks (%.2f GiB)",
        state.blocks(state.final_sectors),
        state.tensor.physical_bytes / GIB,
    )
