"""The surgery on transformers' `CachePool` and its allocators' books, and what they say.

transformers keeps a sector's state in several places: the pool's `free_sectors`, its size
(`num_sectors`, with the cache's `num_sectors` and `num_blocks`), each allocator's
`block_table` (request id -> block ids, a block being `sector * blocks_per_sector + j`), the
prefix cache's `BlockLedger` (reference counts, hashes, cached blocks) and the pool's free
blocks per allocator (`_free_blocks[index].trees`, by sector). Every change of the cache's size
keeps all of them true through the functions here, and only here:

- a grow commits sectors, then `set_pool_size` appends them to the free list;
- a shrink, a lend or a give-back first takes the sectors past the cut out of the pool
  (`take_out_of_pool`: only if every one is free at once, prefix-cache-only blocks evicted
  first), then unmaps them (`unmap_past`), or puts them back if that failed
  (`put_back_in_pool`);
- `move_below` copies live sectors under a cut and renames their blocks in every book.

The readers: `requests_holding` (requests with a block past a cut), `busy_requests`,
`missing_sectors` (what one request lacks, transformers' own count), `margin_sectors` (what
brings the free share up to `GROW_BELOW_FREE`) and `queue_need` (what the scheduler's
requests need to finish, with when the first waiting one arrived).

All of them run on the generation loop's thread between steps, or with the loop paused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from extensible_kv import flow
from extensible_kv.transformers.state import GROW_BELOW_FREE, TRASH_SECTORS, CacheState, logger

__all__ = [
    "QueueNeed",
    "busy_requests",
    "evict_cached_blocks",
    "hand_to_pool",
    "margin_sectors",
    "missing_sectors",
    "move_below",
    "put_back_in_pool",
    "queue_need",
    "rename_sector",
    "requests_holding",
    "sector_owners",
    "set_num_sectors",
    "set_pool_size",
    "take_out_of_pool",
    "unmap_past",
]


# ---------------------------------------------------------------------------------------------
# the pool's size and free list


def set_num_sectors(cache: Any, sectors: int) -> None:
    """The pool's and the cache's sector counts (the scheduler's free-capacity ratio, `reset`),
    and `num_blocks` in transformers' unit."""
    state: CacheState = cache._ekv
    cache.num_sectors = cache.pool.num_sectors = sectors
    cache.num_blocks = state.blocks(sectors)


def hand_to_pool(cache: Any, sectors: int) -> None:
    """The pool holds `sectors` data sectors, all free. Only called with no request holding
    blocks (after warm-up's reset, or a suspension's)."""
    set_num_sectors(cache, sectors)
    cache.pool.reset()


def set_pool_size(cache: Any, state: CacheState, sectors: int) -> None:
    """transformers' pool holds `sectors` data sectors, all committed: the ones past its
    size before join its free list; fewer, and the ones past `sectors` must have left it
    already (`take_out_of_pool`)."""
    final = state.final_sectors
    assert final is not None
    if sectors > final:
        cache.pool.free_sectors[:0] = range(TRASH_SECTORS + final, TRASH_SECTORS + sectors)
    state.final_sectors = sectors
    set_num_sectors(cache, sectors)


def take_out_of_pool(cache: Any, state: CacheState, target: int) -> bool:
    """Takes the data sectors at and past `target` out of transformers' pool if they are all
    free now (blocks cached only for prefix sharing are evicted first; a sector a request
    holds is never taken): whether it did. Nothing changes when it did not, but evictions."""
    pool, cut = cache.pool, TRASH_SECTORS + target
    final = state.final_sectors
    assert final is not None
    if requests_holding(cache, cut):
        return False
    evict_cached_blocks(cache, cut)
    pool.try_to_free_sectors()
    if sum(sector >= cut for sector in pool.free_sectors) != final - target:
        return False
    pool.free_sectors[:] = [sector for sector in pool.free_sectors if sector < cut]
    return True


def put_back_in_pool(cache: Any, state: CacheState, target: int) -> None:
    """Undoes `take_out_of_pool(cache, state, target)` when what followed it failed."""
    final = state.final_sectors
    assert final is not None
    cache.pool.free_sectors.extend(range(TRASH_SECTORS + target, TRASH_SECTORS + final))


def unmap_past(cache: Any, state: CacheState, target: int) -> None:
    """Unmaps the data sectors at and past `target`, which the pool no longer holds."""
    flow.refuse_while_capturing(state.device, "resize")
    state.synchronize()  # the last steps' kernels may still read them
    state.tensor.shrink_((TRASH_SECTORS + target) * state.bytes_per_sector, exact=True)
    state.committed_sectors = target
    set_pool_size(cache, state, target)


# ---------------------------------------------------------------------------------------------
# moving live sectors down


def sector_owners(cache: Any, cut: int) -> dict[int, Any]:
    """The sectors at or past `cut` that an allocator holds (a block of them is in a request's
    block table, the prefix cache's ledger, or free in that allocator's own pool), by owner."""
    owners: dict[int, Any] = {}
    for allocator in cache.cache_allocators.values():
        per_sector = allocator.blocks_per_sector
        ledger: Any = getattr(allocator, "ledger", None)
        held = [b for blocks in allocator.block_table.values() for b in blocks]
        if ledger is not None:
            held += [*ledger.shared_ref_counts, *ledger.block_to_hash, *ledger.cached_blocks]
        trees = cache.pool._free_blocks[allocator.index].trees
        for sector in {b // per_sector for b in held} | set(trees):
            if sector >= cut:
                owners[sector] = allocator
    return owners


def move_below(cache: Any, state: CacheState, cut: int) -> None:
    """Copies every held sector at or past `cut` into a free sector below it, and renames its
    blocks everywhere transformers keeps a block id (the block tables, the ledger, the free
    blocks of the allocator's pool): all or nothing, the loop paused by the caller. The copy
    is transformers' own (`copy_blocks`), after the device has finished the last step."""
    pool = cache.pool
    owners = sector_owners(cache, cut)
    below = sorted(sector for sector in pool.free_sectors if sector < cut)
    if len(below) < len(owners):
        raise RuntimeError(
            f"cannot move {len(owners)} held sectors below sector {cut}: only {len(below)} are "
            "free there; finish requests or shrink less"
        )
    moves = dict(zip(sorted(owners), below, strict=False))
    state.synchronize()  # the last step's kernels may still write the sectors copied
    for old, new in moves.items():
        allocator = owners[old]
        per_sector = allocator.blocks_per_sector
        blocks = range(old * per_sector, (old + 1) * per_sector)
        allocator.copy_blocks(list(blocks), [new * per_sector + b - blocks[0] for b in blocks])
    state.synchronize()
    for old, new in moves.items():
        rename_sector(cache, owners[old], old, new)
    moved = set(moves.values())
    pool.free_sectors[:] = [s for s in pool.free_sectors if s not in moved] + sorted(moves)
    logger.info("Moved %d live KV sectors below sector %d", len(moves), cut)


def rename_sector(cache: Any, allocator: Any, old: int, new: int) -> None:
    """Renames the blocks of sector `old` to those of sector `new` in `allocator`'s books."""
    per_sector = allocator.blocks_per_sector
    offset = (new - old) * per_sector

    def rename(block: int) -> int:
        return block + offset if block // per_sector == old else block

    for request_id, blocks in allocator.block_table.items():
        allocator.block_table[request_id] = [rename(b) for b in blocks]
    ledger: Any = getattr(allocator, "ledger", None)
    if ledger is not None:
        ledger.shared_ref_counts = {rename(b): n for b, n in ledger.shared_ref_counts.items()}
        ledger.hash_to_block = {h: rename(b) for h, b in ledger.hash_to_block.items()}
        ledger.block_to_hash = {rename(b): h for b, h in ledger.block_to_hash.items()}
        ledger.cached_blocks = {rename(b): None for b in ledger.cached_blocks}
    trees = cache.pool._free_blocks[allocator.index].trees
    if old in trees:
        trees[new] = [rename(b) for b in trees.pop(old)]


def evict_cached_blocks(cache: Any, cut: int) -> None:
    """Blocks at or past `cut` that transformers keeps only for prefix sharing (no request
    holds them) are forgotten and freed, as its own eviction does."""
    for allocator in cache.cache_allocators.values():
        ledger: Any = getattr(allocator, "ledger", None)
        cached = getattr(ledger, "cached_blocks", None)
        if not cached:
            continue
        per_sector = allocator.blocks_per_sector
        gone = [block for block in cached if block // per_sector >= cut]
        for block in gone:
            del cached[block]
            block_hash = ledger.block_to_hash.pop(block, None)
            if block_hash is not None:
                ledger.hash_to_block.pop(block_hash, None)
        if gone:
            cache.pool.free_blocks(allocator.index, gone)


# ---------------------------------------------------------------------------------------------
# what the books say


def requests_holding(cache: Any, cut: int) -> list[str]:
    """The requests holding a block of a sector at or past `cut` (a sector's blocks are
    `sector * blocks_per_sector + j` for each allocator)."""
    busy: set[str] = set()
    for allocator in cache.cache_allocators.values():
        per_sector = allocator.blocks_per_sector
        for request_id, blocks in getattr(allocator, "block_table", {}).items():
            if any(block // per_sector >= cut for block in blocks):
                busy.add(request_id)
    return sorted(busy)


def busy_requests(cache: Any) -> list[str]:
    """The requests that hold blocks now."""
    return sorted({rid for a in cache.cache_allocators.values() for rid in a.block_table})


def missing_sectors(cache: Any, request: Any, request_len: int) -> int:
    """The sectors `request` needs for `request_len` more tokens beyond the pool's free ones
    (transformers' own count, as `can_store_request_tokens` makes it)."""
    past = request.current_len()
    needed = sum(
        max(0, int(allocator.needs_new_sectors(request.request_id, past, request_len)))
        for allocator in cache.cache_allocators.values()
    )
    return needed - len(cache.pool.free_sectors)


def margin_sectors(cache: Any) -> int:
    """The sectors that bring the cache's free share up to `GROW_BELOW_FREE` (0 or less: it
    is there)."""
    total, free = int(cache.num_sectors), len(cache.pool.free_sectors)
    # Sectors s such that (free + s) / (total + s) reaches the margin.
    return math.ceil((GROW_BELOW_FREE * total - free) / (1 - GROW_BELOW_FREE))


@dataclass(frozen=True)
class QueueNeed:
    """What the scheduler's requests need to finish: `sectors` beyond the pool's free memory
    (0 or less: it holds them), `waiting` requests among them, the first of which arrived at
    `since` (transformers' `created_time`, a `time.perf_counter()` time; None with none
    waiting)."""

    sectors: int
    waiting: int
    since: float | None


def queue_need(cache: Any, scheduler: Any, request: Any = None) -> QueueNeed:
    """What every request `scheduler` holds (waiting, and active: admitted ones still grow as
    they decode), and `request`, needs to finish: its prompt plus its most new tokens
    (`max_new_tokens`; a request without one counts its prompt), less what it holds, in each
    allocator's blocks (transformers' own count, `needs_new_blocks`: a sliding window's
    allocator holds at most its window), less the allocator's free blocks, in sectors, less
    the pool's free sectors."""
    requests: dict[str, Any] = {}
    for group in ("active_requests", "waiting_requests"):
        requests.update(getattr(scheduler, group, None) or {})
    waiting = dict(getattr(scheduler, "waiting_requests", None) or {})
    if request is not None:
        requests.setdefault(request.request_id, request)
        if _pending(request):
            waiting.setdefault(request.request_id, request)
    needed = 0
    for allocator in cache.cache_allocators.values():
        blocks = sum(_blocks_to_finish(allocator, state) for state in requests.values())
        fresh = blocks - int(cache.pool.count_free_blocks(allocator.index))
        if fresh > 0:
            needed += -(-fresh // allocator.blocks_per_sector)
    times = [float(state.created_time) for state in waiting.values()]
    return QueueNeed(
        needed - len(cache.pool.free_sectors), len(waiting), min(times) if times else None
    )


def _blocks_to_finish(allocator: Any, request: Any) -> int:
    """The blocks `allocator` must still give `request` for its whole length."""
    generated = len(getattr(request, "generated_tokens", ()))
    most_new = getattr(request, "max_new_tokens", None) or 0
    total = len(request.initial_tokens) + max(0, most_new - generated)
    past = request.current_len()
    return max(0, int(allocator.needs_new_blocks(request.request_id, past, max(0, total - past))))


def _pending(request: Any) -> bool:
    """Whether `request` has not started (transformers' `RequestStatus.PENDING`)."""
    status = getattr(request, "status", None)
    return getattr(status, "name", None) == "PENDING"
