"""transformers' `PagedAttentionCache` placed in one `ExtensibleTensor` reservation.

transformers 5.18+ keeps a continuous-batching KV cache in one flat uint8 tensor: two trash
sectors first (sector 0: the zeroed read trash and the sliding window's sentinel; sector 1: the
write trash), then the data sectors its `CachePool` hands to the allocators (full, sliding; from
5.25 MLA's, which views the same bytes as one row of latents per token). That is one segment
that grows at its end, so the flow (docs/design.md §5) fits as it is:

1. `ExtensiblePagedAttentionCache.__init__` runs transformers' own constructor (allocators,
   sector geometry, `max_batch_tokens`, its own sizing as `estimate`), then reserves
   `2 + capacity` sectors, commits the trash sectors (zeroed) and registers every allocator
   over a view that spans the capacity: the addresses never move.
2. Warm-up: the pool hands out sectors lowest first and commits each one before handing it
   out (`ExtensiblePool.allocate_sector`), so the warm-up requests touch committed memory only
   and CUDA graphs capture the final addresses. From 5.21 the warm-up's prefill request has
   one page of past: it touches `max_batch_tokens` plus a page. 5.18 to 5.20 give it the
   whole cache as its past, so there the warm-up commits transformers' own size.
3. `extend` runs the flow's steps 3 and 4 (`KVCacheFlow` over the data sectors, the trash
   counted below them: `measure`, then `extend_to`): measures, converts bytes to sectors
   granule-aware, commits, logs `Extended KV cache to N blocks (X GiB)` and returns an
   `ExtendReport`; then gives the new sectors to the pool.

Units: the pool counts sectors; transformers' `num_blocks`, and the reports and logs here,
count whole-model blocks of `page_size` tokens (`sectors * bytes_per_sector //
bytes_per_block`, as `PagedAttentionCache.num_blocks`).

Buffers sized from the block count: transformers sizes the read indices `(groups, R + M)` and,
for eager/sdpa, the attention masks `(1, 1, M, R + M)` from `max_tokens_read` (R), which its own
cache sets to the tokens it holds. Here R is the tokens of transformers' own sizing (its memory
handler's sector count at `max_memory_percent`, or the user's `num_blocks`), capped by the
capacity; never the capacity itself (the device's whole memory: masks of M x that would not
fit). Why that bound: the buffers are allocated and captured into graphs before warm-up, so
they cannot follow the final size, and R is not the cache's size but the scheduler's budget of
cache tokens one batch reads; correctness needs only R >= the longest request. With
transformers' own R, the buffers, the warm-up sizes (hence the graph pool) and the batches are
the very ones transformers' own cache gets, so the outputs are identical and the buffers take
at most what transformers' cache of the final size takes whenever the extension reaches
transformers' own size (its purpose: it sets aside 10% of free memory, where the flow keeps
`max(1 GiB, 0.75 * transient peak)`). When the measurement finds less, the slack is the
buffers' share of the missing blocks: `(R_own - R_final) * (groups * 8 + masks * M * itemsize)`
bytes per IO set, which is what transformers' own cache would have failed to place anyway.

Invariants: every sector the pool holds or has handed out is committed; the trash sectors are
committed (and the read trash zero) for as long as the cache lives; a resize never runs while a
stream captures a graph.

This module builds the classes and extends the cache; what sizes it afterwards is its sizer
(`state.Sizer`: fixed, `auto`, `pooled`), and the changes to transformers' pool are
`sectors`'.
"""

from __future__ import annotations

import contextvars
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from extensible_kv import _native, flow, sizing
from extensible_kv._native import OutOfMemoryError, UnsupportedError
from extensible_kv.flow import ExtendReport
from extensible_kv.layouts import round_up
from extensible_kv.tensor import ExtensibleTensor
from extensible_kv.transformers import options as _options
from extensible_kv.transformers import sectors
from extensible_kv.transformers.auto import AutoSizer
from extensible_kv.transformers.options import AutoResize, Options
from extensible_kv.transformers.pooled import PooledSizer
from extensible_kv.transformers.state import (
    GIB,
    GROW_BELOW_FREE,
    TRASH_SECTORS,
    CacheState,
    SectorView,
    logger,
    state_of,
)

if TYPE_CHECKING:
    import torch

# `AutoResize`, `Options`, `TRASH_SECTORS` and `GROW_BELOW_FREE` are this module's names too,
# as before the integration was split into rooms.
__all__ = [
    "GROW_BELOW_FREE",
    "TRASH_SECTORS",
    "AutoResize",
    "Classes",
    "Options",
    "build_classes",
    "extend",
    "modelled_transient_peak_bytes",
]


@dataclass
class _Build:
    """What transformers' own sizing said while our cache's constructor ran."""

    options: Options
    handler: Any = None
    estimate_sectors: int = 0


# Set only while an `ExtensiblePagedAttentionCache` runs transformers' constructor: the memory
# handler then records its sizing and asks transformers for a one-sector tensor.
_BUILD: contextvars.ContextVar[_Build | None] = contextvars.ContextVar("ekv_build", default=None)


# ---------------------------------------------------------------------------------------------
# the classes bound into transformers (built at enable(), over the running version's bases)


@dataclass(frozen=True)
class Classes:
    cache: type
    handler: type
    pool: type


def build_classes(cache_base: Any, handler_base: Any, pool_base: Any) -> Classes:
    """Subclasses of the running transformers' `PagedAttentionCache`,
    `PagedAttentionMemoryHandler` and `CachePool` (transformers is only imported by
    `enable`)."""
    pool = _pool_class(pool_base)
    handler = _handler_class(handler_base)
    return Classes(_cache_class(cache_base, pool), handler, pool)


def _pool_class(base: Any) -> type:
    class ExtensiblePool(base):  # type: ignore[misc]
        """`CachePool` whose sectors are committed before they are handed out. Until the cache
        is extended the pool counts transformers' own sizing (so the warm-up runs at the sizes
        transformers' own cache would). It always hands out its lowest free sector: the
        warm-up commits only what its requests touch, and live blocks gather at the bottom,
        so that a shrink (`resize`) finds the sectors at the top free."""

        def __init__(self, num_sectors: int, num_allocators: int, state: CacheState) -> None:
            self._ekv_state = state
            super().__init__(num_sectors, num_allocators)

        def allocate_sector(self, index: int) -> None:
            free = self.free_sectors
            if free:
                lowest = min(range(len(free)), key=free.__getitem__)
                free[lowest], free[-1] = free[-1], free[lowest]  # transformers pops the end
                self._ekv_state.grow_to_hold(free[-1])
            super().allocate_sector(index)

    return ExtensiblePool


def _handler_class(base: Any) -> type:
    class ExtensibleMemoryHandler(base):  # type: ignore[misc]
        """transformers' `PagedAttentionMemoryHandler`, unchanged except while our cache is
        built: it then records transformers' sizing and has a one-sector tensor allocated (the
        reservation replaces it), and a `num_blocks` larger than memory is a cap, not an
        error (the flow measures after warm-up)."""

        def infer_max_batch_tokens_and_num_sectors(self) -> tuple[int, int]:
            build = _BUILD.get()
            max_batch_tokens, num_sectors = super().infer_max_batch_tokens_and_num_sectors()
            if build is None:
                return max_batch_tokens, num_sectors
            build.handler, build.estimate_sectors = self, num_sectors
            return max_batch_tokens, 1

        def _check_footprint(self, max_batch_tokens: int, num_sectors: int) -> tuple[int, int]:
            if _BUILD.get() is None:
                result: tuple[int, int] = super()._check_footprint(max_batch_tokens, num_sectors)
                return result
            if max_batch_tokens <= 0 or num_sectors <= 0:
                raise ValueError(
                    f"transformers' sizing leaves no room for a KV cache: max_batch_tokens="
                    f"{max_batch_tokens}, num_sectors={num_sectors}; set num_blocks in the "
                    "ContinuousBatchingConfig"
                )
            return max_batch_tokens, num_sectors

    return ExtensibleMemoryHandler


def _cache_class(base: Any, pool_class: type) -> type:
    signature = inspect.signature(base.__init__)

    class ExtensiblePagedAttentionCache(base):  # type: ignore[misc]
        """transformers' `PagedAttentionCache` (same API and tensors) in one `ExtensibleTensor`
        reservation, sized after warm-up (see the module's docstring)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            options = _current_options()
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            if getattr(arguments["distributed_helper"], "tp_size", 1) > 1:
                raise UnsupportedError(
                    "extensible_kv.transformers does not support tensor parallelism yet: "
                    "disable it (extensible_kv.transformers.disable()) for TP managers"
                )
            _refuse_mla_without_its_layout(base, arguments["config"])
            device = flow.normalize_device(arguments["device"], legacy=False)
            if device.type != "cuda" and options.budget_bytes is None and not options.host_free:
                raise ValueError(
                    "the host backend has no free-memory figure: enable(budget_bytes=...) (the "
                    "bytes the KV cache may commit after warm-up), or enable(host_free=True)"
                )
            free_at_init = flow.free_bytes_or_none(device)
            build = _Build(options)
            token = _BUILD.set(build)
            try:
                super().__init__(*args, **kwargs)
            finally:
                _BUILD.reset(token)
            _place(self, device, build, arguments["continuous_batching_config"], free_at_init)

        def can_store_request_tokens(
            self, state: Any, request_len: int, *args: Any, **kwargs: Any
        ) -> bool:
            """transformers' check, and where it fails the sizer's grow (`state.Sizer`: the
            policy's, or an ask to the pool for the queue), then the check again."""
            fits = bool(super().can_store_request_tokens(state, request_len, *args, **kwargs))
            if fits or not self._ekv.sizer.grow_on_demand(self, state, request_len):
                return fits
            return bool(super().can_store_request_tokens(state, request_len, *args, **kwargs))

        def compute_free_capacity(self, relative: bool = True) -> Any:
            """transformers' free capacity; under `GROW_BELOW_FREE`, the sizer's grow first
            (the policy's, or the pool's while requests wait): under its safety margin (the FIFO
            scheduler's is 15%) the scheduler admits no new request while others decode, so it
            never asks `can_store_request_tokens` for one, and the cache would not grow."""
            free = super().compute_free_capacity(relative)
            if relative and free < GROW_BELOW_FREE and self._ekv.sizer.grow_to_margin(self):
                free = super().compute_free_capacity(relative)
            return free

    def _place(
        cache: Any, device: torch.device, build: _Build, cb_config: Any, free_at_init: int | None
    ) -> None:
        bytes_per_sector = cache.bytes_per_sector
        capacity = _capacity_sectors(build, cb_config, device, bytes_per_sector)
        read_sectors = min(build.estimate_sectors, capacity)
        granularity = sizing.device_granularity(device, build.options.granularity)
        num_bytes = (TRASH_SECTORS + capacity) * bytes_per_sector
        # Loans travel as POSIX fds: a cache that may lend its handles exports them.
        lends = build.options.pool is not None and build.options.pool_via == "loan"
        tensor = ExtensibleTensor(
            round_up(num_bytes, granularity),
            1,
            device,
            granularity=build.options.granularity,
            export_handle_types="posix_fd" if lends else 0,
        )
        tensor.driver_rate = build.options.driver_rate
        try:
            state = CacheState(
                tensor=tensor,
                device=device,
                options=build.options,
                handler=build.handler,
                bytes_per_sector=bytes_per_sector,
                bytes_per_block=build.handler.bytes_per_block,
                capacity_sectors=capacity,
                read_sectors=read_sectors,
                free_at_init_bytes=free_at_init,
            )
            _refuse_impossible_budget(state)
            state.commit(0)  # the trash sectors
            view = tensor.full_view()[:num_bytes]
            pool = pool_class(read_sectors, len(cache.cache_allocators), state)
            for allocator in cache.cache_allocators.values():
                allocator.register_cache_tensor(
                    bytes_per_sector, capacity * bytes_per_sector, view, pool
                )
        except BaseException:
            tensor.close()
            raise
        cache.cache_tensor, cache.pool, cache._ekv = view, pool, state
        sectors.set_num_sectors(cache, read_sectors)
        cache.max_tokens_read = read_sectors * _tokens_read_per_sector(cache)
        logger.info(
            "Reserved KV cache for %d blocks (%.2f GiB of addresses); reads per batch sized "
            "for %d blocks, transformers' own sizing (%s)",
            state.blocks(capacity),
            num_bytes / GIB,
            state.blocks(read_sectors),
            device,
        )
        _warn_reads_past_the_maximum(state)

    return ExtensiblePagedAttentionCache


def _warn_reads_past_the_maximum(state: CacheState) -> None:
    """transformers sized its reads per batch as if alone on the device; engines that share it
    in a pool each pay masks and attention scores for keys they may never hold: a warning
    where they are sized past the pooled cache's maximum."""
    options = state.options
    if options.pool is None:
        return
    if options.max_bytes is not None:
        most, named = options.max_bytes // state.bytes_per_block, f"max_bytes={options.max_bytes}"
    elif options.max_blocks is not None:
        most, named = options.max_blocks, f"max_blocks={options.max_blocks}"
    else:
        return
    if state.blocks(state.read_sectors) > most:
        logger.warning(
            "reads per batch are sized for %d blocks, more than this pooled cache's %s: set "
            "ContinuousBatchingConfig(num_blocks=%d) to size them (and transformers' warm-up) "
            "for what the cache may hold",
            state.blocks(state.read_sectors),
            named,
            most,
        )


def _refuse_mla_without_its_layout(base: Any, config: Any) -> None:
    """An MLA model (its config has `kv_lora_rank`) caches two latents per token in one row,
    which only 5.25's `MLACacheAllocator` lays out. Before it, transformers gives MLA layers
    the per-head key/value pages of full attention, and the first write fails in the loop's
    thread (`index_copy_`: the slice shapes differ), its own cache's as ours: refused here,
    before anything is reserved, with the reason. From 5.25 the MLA layout is served like any
    other: views of the same flat tensor, one row per token."""
    if getattr(config, "kv_lora_rank", None) is None:
        return
    if getattr(inspect.getmodule(base), "MLACacheAllocator", None) is not None:
        return
    import transformers

    raise UnsupportedError(
        f"this model's attention is MLA (its config has kv_lora_rank="
        f"{config.kv_lora_rank}): transformers {transformers.__version__}'s continuous "
        "batching has no cache layout for its latents (its own cache fails on the first step "
        "too); transformers 5.25 added it (MLACacheAllocator): upgrade, or disable "
        "extensible_kv.transformers for this model"
    )


def _refuse_impossible_budget(state: CacheState) -> None:
    """Before the warm-up, what no measurement after it could change: a given budget that cannot
    hold one block or that asks for more than is free (the budget capped by the reservation), or
    free memory that cannot hold one block beside the least margin."""
    options, free = state.options, state.free_at_init_bytes
    need = _one_block_bytes(state)
    if options.budget_bytes is not None:
        if options.budget_bytes < need:
            raise _no_block(state, f"budget_bytes={options.budget_bytes}")
        reservation = round_up(
            (TRASH_SECTORS + state.capacity_sectors) * state.bytes_per_sector,
            state.tensor.granularity,
        )
        wanted = min(options.budget_bytes, reservation)
        if free is not None and wanted > free:
            error = OutOfMemoryError(
                f"budget_bytes={options.budget_bytes} asks for {wanted} bytes of KV cache (the "
                f"budget, capped by the reservation of {reservation}), more than the {free} "
                f"bytes free on {state.device} now: give a budget of at most the free memory, "
                "or cap the cache with num_blocks"
            )
            error.op, error.code = "extend", "budget"
            error.requested_bytes, error.free_bytes = wanted, free
            raise error
    elif free is not None:
        margin = options.margin_bytes
        if margin is None:
            margin = sizing.default_margin_bytes(0)
        if free - margin < need:
            raise _no_block(
                state,
                f"{free} bytes free on {state.device} before the warm-up, less a margin of at "
                f"least {margin} bytes",
            )


def _current_options() -> Options:
    options = _options.current()
    if options is None:
        raise RuntimeError(
            "ExtensiblePagedAttentionCache was built while extensible_kv.transformers is "
            "disabled: call extensible_kv.transformers.enable() first"
        )
    return options


def _capacity_sectors(
    build: _Build, cb_config: Any, device: torch.device, bytes_per_sector: int
) -> int:
    """The reservation's data sectors: the user's `num_blocks` when set (it caps the cache),
    else the device's whole memory (address space is cheap: an upper bound costs nothing)."""
    if cb_config.num_blocks is not None:
        return int(build.handler.num_sectors_from_config())
    if device.type == "cuda":
        import torch

        total = int(torch.cuda.mem_get_info(device)[1])
    else:
        total = int(_native.host_mem_info()[1])
    return max(1, total // bytes_per_sector - TRASH_SECTORS)


def _tokens_read_per_sector(cache: Any) -> int:
    """transformers' `max_tokens_read` per sector: `max(tokens_per_page * num_blocks)` over the
    allocators, with `num_blocks = sectors * blocks_per_sector`."""
    return max(
        int(allocator.tokens_per_page * allocator.blocks_per_sector)
        for allocator in cache.cache_allocators.values()
    )


# ---------------------------------------------------------------------------------------------
# the flow's steps on a live cache


def modelled_transient_peak_bytes(cache: Any) -> int:
    """transformers' own model of the activations of its largest batch (what its sizing sets
    aside): the margin's transient peak when the warm-up ran no forward pass to measure."""
    state: CacheState = cache._ekv
    handler = state.handler
    per_batch = cache.max_batch_tokens * handler.bytes_per_batch_token
    per_read = state.read_sectors * handler.tokens_per_sector * handler.bytes_per_cache_token
    return int(per_batch + per_read)


def extend(cache: Any, *, transient_peak_bytes: int | None = None) -> ExtendReport | None:
    """Steps 3 and 4 on a warmed-up cache, by the flow (`KVCacheFlow` over its sectors):
    measure, commit the most sectors that fit (capped by the capacity, never fewer than
    committed), hand them to the pool, log, report. None when the cache was extended before."""
    state = state_of(cache)
    if state.final_sectors is not None:
        return None
    options = state.options
    steps = flow.KVCacheFlow(
        SectorView(state), state.device, state.free_at_init_bytes, report_units=state.blocks
    )
    measured = steps.measure(
        budget_bytes=options.budget_bytes,
        host_free=options.host_free,
        margin_bytes=options.margin_bytes,
        transient_peak_bytes=transient_peak_bytes,
    )
    fit = measured.fit_blocks
    if max(fit, state.committed_sectors) < 1:
        raise _no_block(state, _budget_words(options, measured.budget, measured.source))
    target = fit
    if options.auto_resize is not None:
        auto = AutoSizer.within(state, options.auto_resize, max(fit, 1))
        state.sizer = auto
        target = min(fit, auto.min_sectors)
    elif options.pool is not None:
        pooled = PooledSizer.within(state, max(fit, 1))
        state.sizer = pooled
        # What the warm-up committed stays; the end is made a granule boundary for borrows.
        target = state.aligned_up(max(min(fit, pooled.min_sectors), state.committed_sectors))
    state.report = steps.extend_to(target, measured)
    state.final_sectors = state.committed_sectors
    sectors.hand_to_pool(cache, state.final_sectors)
    return state.report


def _one_block_bytes(state: CacheState) -> int:
    """The physical bytes of a cache of one data sector: the trash and that sector, in whole
    granules (what the smallest cache that can serve holds)."""
    return round_up((TRASH_SECTORS + 1) * state.bytes_per_sector, state.tensor.granularity)


def _budget_words(options: Options, budget: sizing.MemoryBudget | None, source: str) -> str:
    if options.budget_bytes is not None:
        return f"budget_bytes={options.budget_bytes}"
    assert budget is not None
    return (
        f"{budget.free_now_bytes} bytes free ({source}) less a margin of "
        f"{budget.margin_bytes} bytes leave {budget.budget_bytes} for the cache"
    )


def _no_block(state: CacheState, budget: str) -> OutOfMemoryError:
    """The error of a cache that would hold no data block: transformers' scheduler divides by
    the block count (a cache of none fails every request), and its own sizing refuses too."""
    need = _one_block_bytes(state)
    error = OutOfMemoryError(
        f"the KV cache would hold no block: {budget}, where one block needs {need} bytes in all "
        f"(the {TRASH_SECTORS} trash sectors and one sector of {state.bytes_per_sector} bytes, "
        "in whole granules of "
        f"{state.tensor.granularity}); give a larger budget_bytes, a smaller margin_bytes or "
        "free memory"
    )
    error.op, error.code = "extend", "budget"
    error.requested_bytes, error.free_bytes = need, None
    return error
