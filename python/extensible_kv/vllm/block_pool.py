"""vLLM's scheduler-side block pool, resizable between engine steps.

vLLM 0.34's `BlockPool` builds its `blocks` and its free queue once, for `num_gpu_blocks`: the
one part of the engine core's KV cache that cannot grow. `ResizableBlockPool` is that class
with three more state transitions and nothing changed on the paths a step takes (allocate,
free, touch, cache): vLLM's own tests pass on it as on `BlockPool`, and a step costs what it
did.

- `grow(n)`: blocks `num_gpu_blocks .. n-1` join the pool, free, at the front of the free
  queue (handed out before any prefix-cached block is evicted). `blocks` is extended in
  place: vLLM's hash map holds that very list.
- `begin_shrink(n)`: blocks `n..` leave the free queue now (their prefix-cache entries are
  evicted, unpinned readers told, as a reuse would) and are *retired*; blocks `n..` still
  referenced keep working and are retired as their last reference is freed. So from this
  call on, every block handed out is below `n`: live blocks gather low, and the shrink
  completes once the requests holding the tail finish. While draining, `free_blocks` and
  `unpin_blocks` are per-instance wrappers that retire what they free past the cut; they
  are removed when the drain ends (no cost outside a shrink).
- `finish_shrink()`: once every block `n..` is retired (`drained`), the pool is `n` blocks.
  `cancel_shrink()` puts the retired blocks back in the free queue and ends the drain.

What it costs prefix caching: the cached blocks past the cut are evicted at `begin_shrink`
(and the hashes of referenced ones, so no new request shares them and prolongs the drain).

The engine-level resize (workers' memory and this pool together, all or nothing) is
`extensible_kv.vllm.resize`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from extensible_kv import _args

try:  # vLLM is the caller; importing this module without it is a clear error
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
except ImportError as error:  # pragma: no cover - only without vLLM
    raise ImportError(
        "extensible_kv.vllm.block_pool needs vLLM 0.34 (pip install vllm==0.34.0)"
    ) from error

__all__ = ["VLLM_BLOCK_POOL", "ResizableBlockPool", "ShrinkInProgressError"]

# vLLM's class, as this module found it: what `ResizableBlockPool` extends, and what the plugin
# puts back (another plugin may have replaced `BlockPool` in vLLM's module since).
VLLM_BLOCK_POOL: type = BlockPool


class ShrinkInProgressError(RuntimeError):
    """A resize was asked of a pool whose shrink has not finished or been cancelled."""


class ResizableBlockPool(BlockPool):
    """vLLM's `BlockPool`, resizable between steps (see the module's docstring).

    Invariants, between calls: `len(blocks) == num_gpu_blocks`; block `i` has id `i`; the
    free queue holds exactly the unreferenced blocks that are neither the null block nor
    retired; while draining to `n`, the retired blocks are unreferenced, have no hash, and
    all have ids `>= n`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cut: int | None = None  # the size a shrink drains to
        self._retired: dict[int, KVCacheBlock] = {}

    # ---- state ----------------------------------------------------------------------
    @property
    def shrinking_to(self) -> int | None:
        """The size a shrink in progress drains to; None when none is."""
        return self._cut

    @property
    def drained(self) -> bool:
        """Whether every block past the shrink's cut is retired (False with no shrink)."""
        return self._cut is not None and len(self._retired) == self.num_gpu_blocks - self._cut

    def blocks_past_cut_in_use(self) -> int:
        """Blocks past the shrink's cut still referenced (0 with no shrink)."""
        if self._cut is None:
            return 0
        return self.num_gpu_blocks - self._cut - len(self._retired)

    def highest_block_in_use(self) -> int:
        """The highest id of a referenced block (the null block, 0, when none is): the
        smallest pool a shrink could end at right now is one more."""
        for block in reversed(self.blocks):
            if block.ref_cnt > 0 and block.block_id not in self._retired:
                return block.block_id
        return 0

    # ---- transitions ----------------------------------------------------------------
    def grow(self, num_blocks: int) -> int:
        """Grows the pool to `num_blocks` (no-op when it holds that many); returns the number
        of blocks added. Refused while a shrink is in progress (cancel it first)."""
        num_blocks = _args.size(num_blocks, "num_blocks")
        self._no_shrink("grow")
        added = num_blocks - self.num_gpu_blocks
        if added <= 0:
            return 0
        new = [
            KVCacheBlock(block_id, pool=self._weak_self)
            for block_id in range(self.num_gpu_blocks, num_blocks)
        ]
        self.blocks.extend(new)
        self.num_gpu_blocks = num_blocks
        self.free_block_queue.prepend_n(new)
        return added

    def begin_shrink(self, num_blocks: int) -> int:
        """Starts draining the pool to `num_blocks` (>= 2: the null block and one more);
        returns the number of blocks past the cut still referenced (0: `finish_shrink` may
        follow at once). A ValueError when `num_blocks` is not below the pool's size."""
        num_blocks = _args.size(num_blocks, "num_blocks")
        self._no_shrink("shrink")
        if not 2 <= num_blocks < self.num_gpu_blocks:
            raise ValueError(
                f"a shrink to {num_blocks} blocks: the pool holds {self.num_gpu_blocks}, and "
                "keeps at least 2 (the null block and one more)"
            )
        self._cut = num_blocks
        for block in self.blocks[num_blocks:]:
            self._evict(block)
            if block.ref_cnt == 0:
                self._retire(block)
        if not self.drained:
            # Per instance, for the drain only: the class's paths stay vLLM's own.
            self.free_blocks = self._free_blocks_draining  # type: ignore[method-assign]
            self.unpin_blocks = self._unpin_blocks_draining  # type: ignore[method-assign]
        return self.blocks_past_cut_in_use()

    def finish_shrink(self) -> int:
        """Ends a drained shrink: the pool is the cut's size; returns the blocks removed."""
        if self._cut is None:
            raise ShrinkInProgressError("no shrink is in progress")
        if not self.drained:
            raise ShrinkInProgressError(
                f"a shrink to {self._cut} blocks waits for {self.blocks_past_cut_in_use()} "
                "blocks past the cut still in use"
            )
        removed = self.num_gpu_blocks - self._cut
        del self.blocks[self._cut :]
        self.num_gpu_blocks = self._cut
        self._end_drain()
        return removed

    def cancel_shrink(self) -> int:
        """Ends a shrink keeping the pool's size: its retired blocks go back to the free
        queue (at its front, empty); returns how many. No-op with no shrink."""
        if self._cut is None:
            return 0
        back = sorted(self._retired.values(), key=lambda block: block.block_id)
        self.free_block_queue.prepend_n(back)
        self._end_drain()
        return len(back)

    # ---- the drain's wrappers -------------------------------------------------------
    def _free_blocks_draining(
        self, ordered_blocks: Iterable[KVCacheBlock], evict_first: bool = False
    ) -> None:
        blocks = list(ordered_blocks)
        BlockPool.free_blocks(self, blocks, evict_first=evict_first)
        self._retire_freed(blocks)

    def _unpin_blocks_draining(self, blocks: Iterable[KVCacheBlock], on_reuse: Any) -> None:
        blocks = list(blocks)
        BlockPool.unpin_blocks(self, blocks, on_reuse)
        self._retire_freed(blocks)

    def _retire_freed(self, blocks: list[KVCacheBlock]) -> None:
        assert self._cut is not None
        for block in blocks:
            if (
                block.block_id >= self._cut
                and block.ref_cnt == 0
                and not block.is_null
                and block.pool is self._weak_self
                and block.block_id not in self._retired
            ):
                self.free_block_queue.remove(block)
                self._evict(block)
                self._retire(block)
        if self.drained:
            self._drop_wrappers()

    # ---- helpers --------------------------------------------------------------------
    def _retire(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None:  # in the free queue
            self.free_block_queue.remove(block)
        self._retired[block.block_id] = block

    def _evict(self, block: KVCacheBlock) -> None:
        """Drops `block`'s prefix-cache entries and tells an unpinned reader, as a reuse
        would."""
        if self._reuse_watchers and block.ref_cnt == 0:
            self._notify_reuse([block])
        if block.block_hash is not None:
            self._maybe_evict_cached_block(block)

    def _no_shrink(self, what: str) -> None:
        if self._cut is not None:
            raise ShrinkInProgressError(
                f"a {what} while a shrink to {self._cut} blocks is in progress: finish or "
                "cancel it first"
            )

    def _drop_wrappers(self) -> None:
        for name in ("free_blocks", "unpin_blocks"):
            self.__dict__.pop(name, None)

    def _end_drain(self) -> None:
        self._drop_wrappers()
        self._cut = None
        self._retired = {}
