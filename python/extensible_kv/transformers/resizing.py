"""A live cache's size changed while requests run (docs/design.md §8b): `grow_live` commits and
hands the new sectors to transformers' pool; `shrink_live` unmaps the sectors past a cut once
they are all free at the same time (or, with `move`, once the live ones are copied below it);
`resize` is `extensible_kv.transformers.resize`'s work, under the cache's resize lock.

The automatic policy (`auto`) and the pool's cache (`sector_cache`) change the size through
the same two steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from extensible_kv import _args, flow
from extensible_kv.flow import ExtendReport
from extensible_kv.transformers import sectors
from extensible_kv.transformers.state import GIB, TRASH_SECTORS, CacheState, logger, state_of

__all__ = ["grow_live", "paused", "resize", "shrink_live"]


@contextlib.contextmanager
def paused(manager: Any) -> Iterator[None]:
    """transformers' pause of a running loop, on this thread (entered and left here); nothing
    when no loop runs."""
    if manager.is_running():
        with manager.pause():
            yield
    else:
        yield


def grow_live(cache: Any, state: CacheState, target: int) -> None:
    """Commits up to `target` data sectors (zeroed) and gives the new ones to the pool, with
    requests in flight (the loop paused, or on its own thread between steps)."""
    flow.refuse_while_capturing(state.device, "resize")
    state.commit(target)
    sectors.set_pool_size(cache, state, target)


def shrink_live(
    manager: Any, cache: Any, state: CacheState, target: int, timeout: float | None, move: bool
) -> None:
    """Unmaps the sectors at and past `target` once they are all free at the same time (blocks
    cached only for prefix sharing are evicted first); until then the pool keeps them, so the
    requests in flight may still grow into them while the loop runs between the tries. Past
    `timeout`, `TimeoutError` names the requests that hold them, and nothing has changed."""
    cut = TRASH_SECTORS + target
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with paused(manager):
            busy = sectors.requests_holding(cache, cut)
            if busy and move:
                sectors.move_below(cache, state, cut)
                busy = sectors.requests_holding(cache, cut)
            if not busy and sectors.take_out_of_pool(cache, state, target):
                try:
                    sectors.unmap_past(cache, state, target)
                except BaseException:
                    sectors.put_back_in_pool(cache, state, target)
                    raise
                return
        waiting = manager.is_running() and (deadline is None or time.monotonic() < deadline)
        if not waiting:
            raise TimeoutError(_still_held(state, target, busy, timeout))
        time.sleep(0.005)


def _still_held(state: CacheState, target: int, busy: list[str], timeout: float | None) -> str:
    held_by = (
        f"{len(busy)} requests hold blocks past block {state.blocks(target)} "
        f"({', '.join(busy[:5])}{'...' if len(busy) > 5 else ''})"
        if busy
        else "blocks past it are not free yet"
    )
    waited = "the manager is not running" if timeout is None else f"waited {timeout} s"
    return (
        f"cannot shrink the KV cache to {state.blocks(target)} blocks: {held_by}, and {waited}; "
        "nothing changed: retry once they finish, or with a longer timeout"
    )


def resize(
    manager: Any, cache: Any, num_blocks: int, timeout: float | None, move: bool = False
) -> ExtendReport:
    """See `extensible_kv.transformers.resize`."""
    state = state_of(cache)
    num_blocks = _args.size(num_blocks, "num_blocks", minimum=1)
    state.sizer.refuse("resize")
    timeout = _args.seconds(timeout)
    capacity = state.blocks(state.capacity_sectors)
    if num_blocks > capacity:
        raise ValueError(
            f"num_blocks {num_blocks} is more than the reservation holds ({capacity} blocks, "
            "fixed when the cache was built: a num_blocks in the ContinuousBatchingConfig caps it)"
        )
    target = min(state.sectors(num_blocks), state.capacity_sectors)
    start = time.perf_counter()
    tensor = state.tensor
    with state.resizing:
        # Read under the lock: a resize, suspension or resume it waited for changes them.
        final = state.final_sectors
        if final is None:
            raise RuntimeError(
                "the KV cache is not sized yet: resize it after the warm-up or start"
            )
        if state.suspended:
            raise RuntimeError("the KV cache is suspended: resume(manager) before resizing it")
        before = (state.blocks(final), tensor.physical_bytes, tensor.num_handles)
        if target > final:
            with paused(manager):
                grow_live(cache, state, target)
        elif target < final:
            shrink_live(manager, cache, state, target, timeout, move)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    state.report = ExtendReport(
        blocks_before=before[0],
        blocks_after=state.blocks(target),
        capacity_blocks=capacity,
        fit_blocks=state.blocks(target),
        bytes_before=before[1],
        bytes_after=tensor.physical_bytes,
        handles_before=before[2],
        handles_after=tensor.num_handles,
        commit_ms=elapsed_ms,
        total_ms=elapsed_ms,
        budget_bytes=0,
        margin_bytes=0,
        free_bytes=None,
        non_kv_used_bytes=None,
        budget_source="resize",
        legacy=False,
    )
    logger.info(
        "Resized KV cache from %d to %d blocks (%.2f GiB) in %.1f ms",
        before[0],
        state.blocks(target),
        tensor.physical_bytes / GIB,
        elapsed_ms,
    )
    return state.report
