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
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from extensible_kv import _args, _native, flow, sizing
from extensible_kv._native import OutOfMemoryError, UnsupportedError
from extensible_kv.flow import ExtendReport
from extensible_kv.layouts import round_up
from extensible_kv.pool.ledger import ENGINE_NAME
from extensible_kv.pool.member import VIAS
from extensible_kv.pool.store import Pool
from extensible_kv.tensor import ExtensibleTensor

if TYPE_CHECKING:
    import torch

__all__ = ["AutoResize", "Options", "build_classes", "extend", "release", "resume"]

GIB = 1 << 30
TRASH_SECTORS = 2
# Under the policy or in a pool, the free share of the cache below which it grows before the
# scheduler asks: above the FIFO scheduler's default safety margin (0.15), under which it
# admits no new request while others decode (`compute_free_capacity`).
GROW_BELOW_FREE = 0.2
logger = logging.getLogger("extensible_kv")


@dataclass(frozen=True)
class AutoResize:
    """The automatic resize policy, `enable(auto_resize=AutoResize(...))` (or `True` for these
    defaults). The extension measures free memory as usual, but commits only `min_blocks`;
    then, while the manager serves:

    - **grow on demand**: when the scheduler finds too few free sectors for a request, the
      cache grows first, by what that request lacks, at least `step_blocks` (default: an
      eighth of the most) and at least its current size (it doubles: a burst that starts from
      the least grows in a few commits, each of which pauses the generation loop), up to
      `max_blocks` (default: what the extension measured as fitting), so no request waits or
      is preempted while memory is there; it grows the same way when the scheduler's margin
      check finds under `GROW_BELOW_FREE` of the cache free (under its margin the scheduler
      would admit no new request); a commit the device refuses (out of memory: another
      engine took it) leaves the size as it is;
    - **shrink when idle**: once no request has held a block for `idle_s` seconds, the cache
      shrinks back to `min_blocks` (sectors that are all free, as `resize` does).

    Every change is logged on `extensible_kv`."""

    min_blocks: int = 1
    max_blocks: int | None = None
    step_blocks: int | None = None
    idle_s: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_blocks", _args.size(self.min_blocks, "min_blocks", minimum=1))
        for name in ("max_blocks", "step_blocks"):
            object.__setattr__(
                self, name, _args.optional_size(getattr(self, name), name, minimum=1)
            )
        if self.max_blocks is not None and self.max_blocks < self.min_blocks:
            raise ValueError(f"max_blocks {self.max_blocks} is below min_blocks {self.min_blocks}")
        object.__setattr__(self, "idle_s", _args.seconds(self.idle_s, "idle_s", optional=False))


@dataclass(frozen=True)
class Options:
    """What `enable(**options)` takes, checked at `enable` as the core checks sizes (any
    integer `operator.index` takes; `TypeError` or `ValueError` naming the option).

    - `budget_bytes`: the physical bytes the KV cache may hold in all once it is extended: its
      two trash sectors, what the warm-up committed and the blocks the extension adds, in whole
      granules. It replaces the measurement (no margin is kept from it). Required on the host
      backend unless `host_free`. A budget that cannot hold one block, or that is more than
      the free memory when the cache is built, is refused then (`OutOfMemoryError`), before the
      warm-up. `last_report()` shows it as `budget_asked_bytes`, and what the extension could
      still commit from it as `budget_bytes`.
    - `host_free`: on the host backend, measure `host_free_bytes()` instead.
    - `margin_bytes`: kept free from a measured budget, instead of the flow's `max(1 GiB, 0.75 *
      transient peak)`.
    - `granularity`: the reservation's granule, a power of two (a power-of-two multiple of the
      device's; the device's by default).
    - `auto_resize`: an `AutoResize` policy (`True`: its defaults), or None: the cache keeps
      the extension's size until `resize`.
    - `pool`: a node pool (`extensible_kv.pool.Pool`, or its name) that every manager's
      cache joins while its generation loop runs (docs/design.md §11): the extension commits
      `min_blocks` (default 1), the cache grows through the pool up to `max_blocks` (default:
      what the extension measured as fitting), and lends its free top blocks to the pool's
      other engines. Not with `auto_resize` (the pool sizes the cache).
    - `engine`: the engine's name in the pool (default `transformers-<pid>-<n>`, unique in
      the process); a name two live engines share is refused when the second joins.
    - `pool_via`: how a donor's memory moves, `"loan"` (its handles change owner) or
      `"driver"` (released, then created again by the needy engine, as kvcached does).
    - `pool_step_blocks`: the blocks the cache commits at a time, which are also the
      smallest unit it can lend (default: a sixteenth of `max_blocks`).
    - `pool_move`: asked to lend, the cache moves its live blocks down into free ones first
      (as `resize(..., move=True)` does, between the loop's steps), so that it lends every
      free block above its minimum, not only the free ones at its top.
    - `driver_rate`: bytes per second the cache creates (grows) and gives back (an
      `AutoResize` or `resize` shrink, a `release`) through the driver at most, one handle at
      a time (`ExtensibleTensor.driver_rate`); None (the default): unpaced. The driver's work
      on the device for that memory (its scrub) slows the steps of a decode loop that shares
      the GPU when gigabytes come at once; paced, it is spread thin, and a grow takes as long
      as its bytes at the rate (docs/benchmarks.md, "Pacing the releases"). A shrink still
      returns at once.
    """

    budget_bytes: int | None = None
    host_free: bool = False
    margin_bytes: int | None = None
    granularity: int | None = None
    auto_resize: AutoResize | None = None
    pool: Pool | str | None = None
    min_blocks: int | None = None
    max_blocks: int | None = None
    engine: str | None = None
    pool_via: str = "loan"
    pool_step_blocks: int | None = None
    pool_move: bool = False
    driver_rate: int | None = None

    def __post_init__(self) -> None:
        for name, least in (
            ("budget_bytes", 0),
            ("margin_bytes", 0),
            ("granularity", 1),
            ("driver_rate", 1),
        ):
            value = _args.optional_size(getattr(self, name), name, minimum=least)
            object.__setattr__(self, name, value)
        object.__setattr__(self, "host_free", _args.flag(self.host_free, "host_free"))
        auto: object = self.auto_resize
        if auto is True:
            object.__setattr__(self, "auto_resize", AutoResize())
        elif auto is not None and not isinstance(auto, AutoResize):
            raise TypeError(
                f"auto_resize must be an AutoResize, True or None, not {type(auto).__name__}"
            )
        granularity = self.granularity
        if granularity is not None and granularity & (granularity - 1):
            raise ValueError(
                f"granularity {granularity} must be a power of two (a power-of-two multiple "
                "of the device's granule: 2 MiB on CUDA, the page size on the host)"
            )
        self._check_pool_options()

    def _check_pool_options(self) -> None:
        object.__setattr__(self, "pool_move", _args.flag(self.pool_move, "pool_move"))
        for name in ("min_blocks", "max_blocks", "pool_step_blocks"):
            value = _args.optional_size(getattr(self, name), name, minimum=1)
            object.__setattr__(self, name, value)
        pool = self.pool
        if pool is None:
            given = [
                name
                for name in ("min_blocks", "max_blocks", "engine", "pool_step_blocks")
                if getattr(self, name) is not None
            ]
            if self.pool_via != "loan":
                given.append("pool_via")
            if self.pool_move:
                given.append("pool_move")
            if given:
                named = ", ".join(given)
                raise ValueError(
                    f"{named} without pool: they size a cache in a node pool; give "
                    "pool='name' too (or auto_resize=AutoResize(...) for a cache of its own)"
                )
            return
        if not isinstance(pool, str | Pool):
            raise TypeError(f"pool must be a pool's name or a Pool, not {type(pool).__name__}")
        if isinstance(pool, str) and not ENGINE_NAME.match(pool):
            raise ValueError(
                f"pool {pool!r}: 1 to 64 letters, digits, '.', '_' or '-', starting with a "
                "letter or digit"
            )
        if self.auto_resize is not None:
            raise ValueError(
                "pool and auto_resize both size the cache: give one (the pool grows it on "
                "demand, through the other engines, and takes back what they give back)"
            )
        if self.engine is not None and (
            not isinstance(self.engine, str) or not ENGINE_NAME.match(self.engine)
        ):
            raise ValueError(
                f"engine {self.engine!r}: 1 to 64 letters, digits, '.', '_' or '-', starting "
                "with a letter or digit"
            )
        if self.pool_via not in VIAS:
            raise ValueError(
                f"pool_via must be one of {', '.join(map(repr, VIAS))}, not {self.pool_via!r}"
            )
        low, high = self.min_blocks, self.max_blocks
        if low is not None and high is not None and high < low:
            raise ValueError(f"max_blocks {high} is below min_blocks {low}")


@dataclass
class _Build:
    """What transformers' own sizing said while our cache's constructor ran."""

    options: Options
    handler: Any = None
    estimate_sectors: int = 0


# Set only while an `ExtensiblePagedAttentionCache` runs transformers' constructor: the memory
# handler then records its sizing and asks transformers for a one-sector tensor.
_BUILD: contextvars.ContextVar[_Build | None] = contextvars.ContextVar("ekv_build", default=None)


@dataclass
class _State:
    """The extensible side of one cache (its `_ekv` attribute)."""

    tensor: ExtensibleTensor
    device: torch.device
    options: Options
    handler: Any
    bytes_per_sector: int
    bytes_per_block: int
    capacity_sectors: int
    read_sectors: int
    free_at_init_bytes: int | None
    committed_sectors: int = 0  # data sectors, past the trash
    final_sectors: int | None = None  # set by `extend`
    pause: _PauseHolder | None = None  # the manager's pause while released (a running loop)
    guarded: Any = None  # the manager whose `start` and `stop` are guarded while released
    auto: _Auto | None = None  # the automatic policy, set by `extend` when asked
    pool_plan: PoolPlan | None = None  # the cache's place in a node pool, set by `extend`
    pooled: Any = None  # its `pooled.Joined` while its loop runs in the pool
    # Held by every resize (`resize`, the policy's): one at a time.
    resizing: threading.Lock = field(default_factory=threading.Lock, repr=False)
    report: ExtendReport | None = field(default=None, repr=False)

    @property
    def released(self) -> bool:
        """Whether `release` gave the memory back (the tensor remembers the size to resume)."""
        return self.tensor.released

    def blocks(self, sectors: int) -> int:
        """Sectors in transformers' whole-model blocks."""
        return sectors * self.bytes_per_sector // self.bytes_per_block

    def sectors(self, blocks: int) -> int:
        """The sectors that hold `blocks` of transformers' whole-model blocks (rounded up)."""
        return math.ceil(blocks * self.bytes_per_block / self.bytes_per_sector)

    def commit(self, data_sectors: int) -> None:
        """Grows the tensor to the trash plus `data_sectors` (zeroed), finished on the device
        before any other stream can use it (transformers computes on its own stream)."""
        num_bytes = (TRASH_SECTORS + data_sectors) * self.bytes_per_sector
        if num_bytes <= self.tensor.bytes_per_segment:
            return
        flow.refuse_while_capturing(self.device, "committing KV cache memory")
        self.tensor.resize_(num_bytes)
        self.committed_sectors = data_sectors
        self._synchronize()

    def grow_to_hold(self, sector_id: int) -> None:
        """Commits up to sector `sector_id` (a tensor index) before the pool hands it out:
        at least doubling what is committed (within transformers' own size), so that a
        warm-up touching n sectors costs O(log n) commits, not n."""
        needed = sector_id + 1 - TRASH_SECTORS
        if needed > self.committed_sectors:
            doubled = min(2 * self.committed_sectors, self.read_sectors)
            self.commit(max(needed, doubled))

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)


def _state(cache: Any) -> _State:
    state = getattr(cache, "_ekv", None)
    if not isinstance(state, _State):
        raise ValueError(
            "this manager's KV cache is not extensible: create the manager while "
            "extensible_kv.transformers is enabled"
        )
    return state


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

        def __init__(self, num_sectors: int, num_allocators: int, state: _State) -> None:
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
            """transformers' check, and under the `AutoResize` policy a grow when it fails."""
            fits = bool(super().can_store_request_tokens(state, request_len, *args, **kwargs))
            if fits or not grow_on_demand(self, state, request_len):
                return fits
            return bool(super().can_store_request_tokens(state, request_len, *args, **kwargs))

        def compute_free_capacity(self, relative: bool = True) -> Any:
            """transformers' free capacity; under the `AutoResize` policy or in a pool, a grow
            first when it is under `GROW_BELOW_FREE`: under its safety margin (the FIFO
            scheduler's is 15%) the scheduler admits no new request while others decode, so it
            never asks `can_store_request_tokens` for one, and the cache would not grow."""
            free = super().compute_free_capacity(relative)
            if relative and free < GROW_BELOW_FREE and grow_to_margin(self):
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
            state = _State(
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
        _set_num_sectors(cache, read_sectors)
        cache.max_tokens_read = read_sectors * _tokens_read_per_sector(cache)
        logger.info(
            "Reserved KV cache for %d blocks (%.2f GiB of addresses); reads per batch sized "
            "for %d blocks, transformers' own sizing (%s)",
            state.blocks(capacity),
            num_bytes / GIB,
            state.blocks(read_sectors),
            device,
        )
        most = build.options.max_blocks if build.options.pool is not None else None
        if most is not None and state.blocks(read_sectors) > most:
            # transformers sized itself as if alone on the device; engines that share it each
            # pay masks and attention scores for keys they may never hold.
            logger.warning(
                "reads per batch are sized for %d blocks, more than this pooled cache's "
                "max_blocks=%d: set ContinuousBatchingConfig(num_blocks=%d) to size them "
                "(and transformers' warm-up) for what the cache may hold",
                state.blocks(read_sectors),
                most,
                most,
            )

    return ExtensiblePagedAttentionCache


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


def _refuse_impossible_budget(state: _State) -> None:
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
    from extensible_kv.transformers import patch

    options = patch.current_options()
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


def _set_num_sectors(cache: Any, sectors: int) -> None:
    """The pool's and the cache's sector counts (the scheduler's free-capacity ratio, `reset`),
    and `num_blocks` in transformers' unit."""
    state: _State = cache._ekv
    cache.num_sectors = cache.pool.num_sectors = sectors
    cache.num_blocks = state.blocks(sectors)


# ---------------------------------------------------------------------------------------------
# the flow's steps on a live cache


def modelled_transient_peak_bytes(cache: Any) -> int:
    """transformers' own model of the activations of its largest batch (what its sizing sets
    aside): the margin's transient peak when the warm-up ran no forward pass to measure."""
    state: _State = cache._ekv
    handler = state.handler
    per_batch = cache.max_batch_tokens * handler.bytes_per_batch_token
    per_read = state.read_sectors * handler.tokens_per_sector * handler.bytes_per_cache_token
    return int(per_batch + per_read)


def extend(cache: Any, *, transient_peak_bytes: int | None = None) -> ExtendReport | None:
    """Steps 3 and 4 on a warmed-up cache, by the flow (`KVCacheFlow` over its sectors):
    measure, commit the most sectors that fit (capped by the capacity, never fewer than
    committed), hand them to the pool, log, report. None when the cache was extended before."""
    state = _state(cache)
    if state.final_sectors is not None:
        return None
    options = state.options
    steps = flow.KVCacheFlow(
        _Sectors(state), state.device, state.free_at_init_bytes, report_units=state.blocks
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
        state.auto = _Auto.within(state, options.auto_resize, max(fit, 1))
        target = min(fit, state.auto.min_sectors)
    elif options.pool is not None:
        plan = state.pool_plan = PoolPlan.within(state, max(fit, 1))
        # What the warm-up committed stays; the end is made a granule boundary for borrows.
        target = plan.aligned_up(max(min(fit, plan.min_sectors), state.committed_sectors))
    state.report = steps.extend_to(target, measured)
    state.final_sectors = state.committed_sectors
    _hand_to_pool(cache, state.final_sectors)
    return state.report


class _Sectors:
    """The cache's data sectors as the flow drives them (a `flow.ExtendableCache`): its blocks
    are the sectors past the trash, which every footprint counts below them."""

    def __init__(self, state: _State) -> None:
        self._state = state

    @property
    def capacity_blocks(self) -> int:
        return self._state.capacity_sectors

    @property
    def committed_blocks(self) -> int:
        return self._state.committed_sectors

    @property
    def physical_bytes(self) -> int:
        return self._state.tensor.physical_bytes

    @property
    def num_handles(self) -> int:
        return self._state.tensor.num_handles

    @property
    def legacy(self) -> bool:
        return False

    def footprint(self) -> sizing.CacheFootprint:
        state = self._state
        buffer = sizing.BufferFootprint((0,), state.bytes_per_sector, state.tensor.granularity)
        return sizing.CacheFootprint(
            (buffer,), state.capacity_sectors, state.committed_sectors, TRASH_SECTORS
        )

    def commit(self, num_blocks: int) -> None:
        self._state.commit(num_blocks)

    def close(self) -> None:
        self._state.tensor.close()


def _one_block_bytes(state: _State) -> int:
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


def _no_block(state: _State, budget: str) -> OutOfMemoryError:
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


def _hand_to_pool(cache: Any, sectors: int) -> None:
    """The pool holds `sectors` data sectors, all free. Only called with no request holding
    blocks (after warm-up's reset, or release's)."""
    _set_num_sectors(cache, sectors)
    cache.pool.reset()


def _refuse_pooled(state: _State, what: str) -> None:
    if state.pool_plan is not None:
        plan = state.pool_plan
        raise RuntimeError(
            f"this manager's KV cache is sized by the node pool it joins (engine "
            f"{plan.engine}): it cannot {what} on its own; change its limits with "
            f"`python -m extensible_kv pool limit {plan.engine} --min N --max N`"
        )


def _busy_requests(cache: Any) -> list[str]:
    return sorted({rid for a in cache.cache_allocators.values() for rid in a.block_table})


def release(manager: Any, cache: Any, keep_blocks: int) -> None:
    """See `extensible_kv.transformers.release`."""
    state = _state(cache)
    keep_blocks = _args.size(keep_blocks, "keep_blocks")
    _refuse_pooled(state, "release")
    with state.resizing:  # not while a resize (the policy's, say) runs: read what it left
        if state.final_sectors is None:
            raise RuntimeError(
                "the KV cache is not sized yet: release it after the manager's warm-up or start"
            )
        if state.released:
            raise RuntimeError("the KV cache is already released: call resume(manager) first")
        keep = min(state.sectors(keep_blocks), state.final_sectors)
        state.pause = _release(manager, cache, state, keep)
        _guard(manager, state)
    logger.info(
        "Released KV cache: %d blocks kept (%.2f GiB)",
        state.blocks(keep),
        state.tensor.physical_bytes / GIB,
    )


def _release(manager: Any, cache: Any, state: _State, keep: int) -> _PauseHolder | None:
    """`release`'s work, all or nothing: the loop paused (if it runs), every block freed, the
    memory past the trash and `keep` sectors unmapped; the pause it holds, if any."""
    pause = _PauseHolder(manager) if manager.is_running() else None
    try:
        busy = _busy_requests(cache)
        if busy:
            raise RuntimeError(
                f"{len(busy)} requests hold KV blocks ({', '.join(busy[:3])}...): release the "
                "cache once they are finished"
            )
        flow.refuse_while_capturing(state.device, "release")
        cache.reset()  # every block free, the prefix cache forgotten: the contents are gone
        state._synchronize()
        # Exact, and gone on return (released for another user): what stays is the
        # granule-rounded footprint of the trash and the kept sectors. The tensor remembers
        # its size for `resume`.
        state.tensor.release((TRASH_SECTORS + keep) * state.bytes_per_sector)
        state.committed_sectors = keep
        state._synchronize()
        _hand_to_pool(cache, keep)
    except BaseException:
        if pause is not None:
            pause.leave()
        raise
    return pause


def resume(cache: Any) -> None:
    """See `extensible_kv.transformers.resume`."""
    state = _state(cache)
    with state.resizing:  # a resume it waited for leaves nothing to resume
        if not state.released or state.final_sectors is None:
            raise RuntimeError("the KV cache is not released: nothing to resume")
        flow.refuse_while_capturing(state.device, "resume")
        state.tensor.resume()  # all or nothing: on OutOfMemoryError, still released
        state._synchronize()  # zeroed before transformers' own stream reads it
        # The size released from is the final one; were it less, the commit grows the rest.
        state.committed_sectors = (
            state.tensor.bytes_per_segment // state.bytes_per_sector - TRASH_SECTORS
        )
        state.commit(state.final_sectors)
        _hand_to_pool(cache, state.final_sectors)
        _unguard(state)
        _leave_pause(state)
    logger.info(
        "Resumed KV cache at %d blocks (%.2f GiB)",
        state.blocks(state.final_sectors),
        state.tensor.physical_bytes / GIB,
    )


# Numbers the engines a process puts in pools without a name of their own.
_ENGINE_SERIAL = itertools.count()


@dataclass(frozen=True)
class PoolPlan:
    """The cache's place in a node pool (`enable(pool=...)`), in sectors: the extension
    commits `min_sectors`, and the cache grows through the pool up to `max_sectors`,
    `step_sectors` at a time (the smallest unit it lends), as engine `engine`.

    Where a sector is not whole granules (`align_sectors` > 1 sectors a granule), the counts
    are ones whose committed end, past the trash, is a granule boundary: a borrow maps there,
    and a loan is whole granules. Commits round down to such a count (`aligned_down`), so a
    commit never takes more than the pool counted."""

    pool: Pool | str
    engine: str
    via: str
    move: bool
    min_sectors: int
    max_sectors: int
    step_sectors: int
    align_sectors: int
    capacity_sectors: int

    @classmethod
    def within(cls, state: _State, fit_sectors: int) -> PoolPlan:
        """The options' limits in sectors, within the reservation; the most is what the
        extension measured as fitting (`fit_sectors`) unless `max_blocks` says otherwise."""
        options = state.options
        assert options.pool is not None
        granularity = state.tensor.granularity
        align = granularity // math.gcd(state.bytes_per_sector, granularity)
        capacity = state.capacity_sectors
        engine = options.engine or f"transformers-{os.getpid()}-{next(_ENGINE_SERIAL)}"
        plan = cls(
            options.pool, engine, options.pool_via, options.pool_move, 0, 0, 0, align, capacity
        )
        least = plan.aligned_up(min(state.sectors(options.min_blocks or 1), capacity))
        most = fit_sectors if options.max_blocks is None else state.sectors(options.max_blocks)
        most = max(plan.aligned_down(min(most, capacity)), least)
        step = state.sectors(options.pool_step_blocks or 0) or max(1, most // 16)
        step = math.ceil(step / align) * align
        return dataclasses.replace(plan, min_sectors=least, max_sectors=most, step_sectors=step)

    def aligned_up(self, sectors: int) -> int:
        """The least count from `sectors` up whose end is a granule boundary (the capacity
        at most)."""
        return min(
            sectors + (-(TRASH_SECTORS + sectors)) % self.align_sectors, self.capacity_sectors
        )

    def aligned_down(self, sectors: int) -> int:
        """The most count up to `sectors` whose end is a granule boundary."""
        return sectors - (TRASH_SECTORS + sectors) % self.align_sectors


@dataclass
class _Auto:
    """`AutoResize` in sectors, with what the policy observes."""

    min_sectors: int
    max_sectors: int
    step_sectors: int
    idle_s: float
    last_active: float = field(default_factory=time.monotonic)
    watching: bool = False
    out_of_memory_logged: bool = False

    @classmethod
    def within(cls, state: _State, policy: AutoResize, fit_sectors: int) -> _Auto:
        """The policy's bounds, in sectors: the most is what the extension measured as fitting
        (`fit_sectors`) unless `max_blocks` says otherwise, within the reservation."""

        sectors = state.sectors
        most = fit_sectors if policy.max_blocks is None else sectors(policy.max_blocks)
        most = min(most, state.capacity_sectors)
        least = min(sectors(policy.min_blocks), most)
        step = sectors(policy.step_blocks) if policy.step_blocks else max(1, most // 8)
        logger.info(
            "KV cache resizes itself between %d and %d blocks (idle after %.1f s)",
            state.blocks(least),
            state.blocks(most),
            policy.idle_s,
        )
        return cls(least, most, step, float(policy.idle_s))


def grow_on_demand(cache: Any, request: Any, request_len: int) -> bool:
    """Under the policy, called when transformers' scheduler found too few free sectors for
    `request` (on the generation loop's thread, which is then not computing): grows by what it
    lacks, at least a step and at least its size (it doubles), up to the most. True when it
    grew."""
    return _grow_by(cache, missing_sectors(cache, request, request_len))


def _grow_by(cache: Any, missing: int) -> bool:
    """Grows by at least `missing` sectors: through the pool in a node pool, else by the
    policy (nothing without it). True when it grew."""
    state = _state(cache)
    if state.pooled is not None:
        return bool(state.pooled.grow_on_demand(missing))
    return _auto_grow(cache, state, missing)


def _auto_grow(cache: Any, state: _State, missing: int) -> bool:
    """The policy's grow by `missing` sectors (at least a step, at least doubling)."""
    auto = state.auto
    if auto is None or not state.resizing.acquire(blocking=False):
        return False
    try:
        # Under the lock: a release or resize that held it changed them.
        final = state.final_sectors
        if state.released or final is None:
            return False
        auto.last_active = time.monotonic()
        target = min(auto.max_sectors, final + max(missing, auto.step_sectors, final))
        if missing <= 0 or target <= final or _capturing(state):
            return False
        try:
            _grow_live(cache, state, target)
        except OutOfMemoryError as error:
            if not auto.out_of_memory_logged:
                auto.out_of_memory_logged = True
                logger.warning("KV cache could not grow on demand (it stays as it is): %s", error)
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


def grow_to_margin(cache: Any) -> bool:
    """Under the policy or in a pool, grows the cache so that at least `GROW_BELOW_FREE` of it
    is free (on the generation loop's thread, from the scheduler's margin check). True when it
    grew."""
    total, free = cache.num_sectors, len(cache.pool.free_sectors)
    # Sectors s such that (free + s) / (total + s) reaches the margin.
    missing = math.ceil((GROW_BELOW_FREE * total - free) / (1 - GROW_BELOW_FREE))
    return missing > 0 and _grow_by(cache, missing)


def missing_sectors(cache: Any, request: Any, request_len: int) -> int:
    """The sectors `request` needs for `request_len` more tokens beyond the pool's free ones
    (transformers' own count, as `can_store_request_tokens` makes it)."""
    past = request.current_len()
    needed = sum(
        max(0, int(allocator.needs_new_sectors(request.request_id, past, request_len)))
        for allocator in cache.cache_allocators.values()
    )
    return needed - len(cache.pool.free_sectors)


def _capturing(state: _State) -> bool:
    try:
        flow.refuse_while_capturing(state.device, "resize")
    except RuntimeError:
        return True
    return False


def watch_idle(manager: Any, cache: Any) -> None:
    """Under the policy, a daemon thread that shrinks the cache back to its least once no
    request has held a block for the idle time; it ends with the manager or the cache."""
    state = _state(cache)
    auto = state.auto
    if auto is None or auto.watching:
        return
    auto.watching = True
    manager_ref, cache_ref = weakref.ref(manager), weakref.ref(cache)

    def watch() -> None:
        while True:
            time.sleep(min(max(auto.idle_s / 4, 0.01), 1.0))
            manager, cache = manager_ref(), cache_ref()
            if manager is None or cache is None or cache._ekv.auto is not auto:
                return
            _shrink_if_idle(manager, cache, auto)
            del manager, cache

    threading.Thread(target=watch, name="extensible-kv-auto-resize", daemon=True).start()


def _shrink_if_idle(manager: Any, cache: Any, auto: _Auto) -> None:
    state: _State = cache._ekv
    idle = time.monotonic() - auto.last_active >= auto.idle_s
    if not idle or not manager.is_running() or _requests_holding(cache, TRASH_SECTORS):
        return
    if not state.resizing.acquire(blocking=False):
        return
    try:
        # Under the lock: a release or resize that held it changed them.
        final = state.final_sectors
        if state.released or final is None or final <= auto.min_sectors:
            return
        _shrink_live(manager, cache, state, auto.min_sectors, timeout=0, move=False)
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
        state.blocks(auto.min_sectors),
        state.tensor.physical_bytes / GIB,
    )


def resize(
    manager: Any, cache: Any, num_blocks: int, timeout: float | None, move: bool = False
) -> ExtendReport:
    """See `extensible_kv.transformers.resize`."""
    state = _state(cache)
    num_blocks = _args.size(num_blocks, "num_blocks", minimum=1)
    _refuse_pooled(state, "resize")
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
        # Read under the lock: a resize, release or resume it waited for changes them.
        final = state.final_sectors
        if final is None:
            raise RuntimeError(
                "the KV cache is not sized yet: resize it after the warm-up or start"
            )
        if state.released:
            raise RuntimeError("the KV cache is released: resume(manager) before resizing it")
        before = (state.blocks(final), tensor.physical_bytes, tensor.num_handles)
        if target > final:
            with _paused(manager):
                _grow_live(cache, state, target)
        elif target < final:
            _shrink_live(manager, cache, state, target, timeout, move)
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


@contextlib.contextmanager
def _paused(manager: Any) -> Iterator[None]:
    """transformers' pause of a running loop, on this thread (entered and left here); nothing
    when no loop runs."""
    if manager.is_running():
        with manager.pause():
            yield
    else:
        yield


def _grow_live(cache: Any, state: _State, target: int) -> None:
    """Commits up to `target` data sectors (zeroed) and gives the new ones to the pool, with
    requests in flight (the loop paused, or on its own thread between steps)."""
    flow.refuse_while_capturing(state.device, "resize")
    state.commit(target)
    set_pool_size(cache, state, target)


def set_pool_size(cache: Any, state: _State, sectors: int) -> None:
    """transformers' pool holds `sectors` data sectors, all committed: the ones past its
    size before join its free list; fewer, and the ones past `sectors` must have left it
    already (`take_out_of_pool`)."""
    final = state.final_sectors
    assert final is not None
    if sectors > final:
        cache.pool.free_sectors[:0] = range(TRASH_SECTORS + final, TRASH_SECTORS + sectors)
    state.final_sectors = sectors
    _set_num_sectors(cache, sectors)


def take_out_of_pool(cache: Any, state: _State, target: int) -> bool:
    """Takes the data sectors at and past `target` out of transformers' pool if they are all
    free now (blocks cached only for prefix sharing are evicted first; a sector a request
    holds is never taken): whether it did. Nothing changes when it did not, but evictions."""
    pool, cut = cache.pool, TRASH_SECTORS + target
    final = state.final_sectors
    assert final is not None
    if _requests_holding(cache, cut):
        return False
    _evict_cached_blocks(cache, cut)
    pool.try_to_free_sectors()
    if sum(sector >= cut for sector in pool.free_sectors) != final - target:
        return False
    pool.free_sectors[:] = [sector for sector in pool.free_sectors if sector < cut]
    return True


def put_back_in_pool(cache: Any, state: _State, target: int) -> None:
    """Undoes `take_out_of_pool(cache, state, target)` when what followed it failed."""
    final = state.final_sectors
    assert final is not None
    cache.pool.free_sectors.extend(range(TRASH_SECTORS + target, TRASH_SECTORS + final))


def _shrink_live(
    manager: Any, cache: Any, state: _State, target: int, timeout: float | None, move: bool
) -> None:
    """Unmaps the sectors at and past `target` once they are all free at the same time (blocks
    cached only for prefix sharing are evicted first); until then the pool keeps them, so the
    requests in flight may still grow into them while the loop runs between the tries. Past
    `timeout`, `TimeoutError` names the requests that hold them, and nothing has changed."""
    cut = TRASH_SECTORS + target
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with _paused(manager):
            busy = _requests_holding(cache, cut)
            if busy and move:
                move_below(cache, state, cut)
                busy = _requests_holding(cache, cut)
            if not busy and take_out_of_pool(cache, state, target):
                try:
                    unmap_past(cache, state, target)
                except BaseException:
                    put_back_in_pool(cache, state, target)
                    raise
                return
        waiting = manager.is_running() and (deadline is None or time.monotonic() < deadline)
        if not waiting:
            raise TimeoutError(_still_held(state, target, busy, timeout))
        time.sleep(0.005)


def unmap_past(cache: Any, state: _State, target: int) -> None:
    """Unmaps the data sectors at and past `target`, which the pool no longer holds."""
    flow.refuse_while_capturing(state.device, "resize")
    state._synchronize()  # the last steps' kernels may still read them
    state.tensor.shrink_((TRASH_SECTORS + target) * state.bytes_per_sector, exact=True)
    state.committed_sectors = target
    set_pool_size(cache, state, target)


def _still_held(state: _State, target: int, busy: list[str], timeout: float | None) -> str:
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


def move_below(cache: Any, state: _State, cut: int) -> None:
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
    state._synchronize()  # the last step's kernels may still write the sectors copied
    for old, new in moves.items():
        allocator = owners[old]
        per_sector = allocator.blocks_per_sector
        blocks = range(old * per_sector, (old + 1) * per_sector)
        allocator.copy_blocks(list(blocks), [new * per_sector + b - blocks[0] for b in blocks])
    state._synchronize()
    for old, new in moves.items():
        _rename_sector(cache, owners[old], old, new)
    moved = set(moves.values())
    pool.free_sectors[:] = [s for s in pool.free_sectors if s not in moved] + sorted(moves)
    logger.info("Moved %d live KV sectors below sector %d", len(moves), cut)


def _rename_sector(cache: Any, allocator: Any, old: int, new: int) -> None:
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


def _requests_holding(cache: Any, cut: int) -> list[str]:
    """The requests holding a block of a sector at or past `cut` (a sector's blocks are
    `sector * blocks_per_sector + j` for each allocator)."""
    busy: set[str] = set()
    for allocator in cache.cache_allocators.values():
        per_sector = allocator.blocks_per_sector
        for request_id, blocks in getattr(allocator, "block_table", {}).items():
            if any(block // per_sector >= cut for block in blocks):
                busy.add(request_id)
    return sorted(busy)


def _evict_cached_blocks(cache: Any, cut: int) -> None:
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


class _PauseHolder:
    """transformers' `manager.pause()`, entered and left by a thread of its own.

    transformers counts a pause per thread: only the thread that entered it may leave it, and
    `stop` refuses to run on a thread that holds one. Held by the thread that called `release`,
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


def _leave_pause(state: _State) -> None:
    pause, state.pause = state.pause, None
    if pause is not None:
        pause.leave()


# Managers stopped without `keep_for_next_session` while released: their cache went with the
# batch processor, so `resume` has nothing to resume (`_cache_of` says so).
DROPPED_WHILE_RELEASED: weakref.WeakSet[Any] = weakref.WeakSet()


def _guard(manager: Any, state: _State) -> None:
    """While the cache is released, this manager's `start` refuses (its pool holds no block to
    serve from) and its `stop` first ends the pause that `release` holds (transformers' `stop`
    would wait forever for a paused loop). Instance attributes, on this manager for the release's
    duration only: transformers' class is never patched for them, so `disable()` cannot leave
    them stale."""
    original_stop = manager.stop

    @functools.wraps(original_stop)
    def stop(*args: Any, **kwargs: Any) -> Any:
        _leave_pause(state)
        result = original_stop(*args, **kwargs)
        if getattr(getattr(manager.batch_processor, "cache", None), "_ekv", None) is not state:
            _unguard(state)
            DROPPED_WHILE_RELEASED.add(manager)
            logger.info(
                "Manager stopped while its KV cache is released, without "
                "keep_for_next_session: the cache went with its batch processor, and the next "
                "start builds a new one"
            )
        else:
            logger.info(
                "Manager stopped while its KV cache is released: resume(manager) before "
                "starting it again"
            )
        return result

    @functools.wraps(manager.start)
    def start(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "this manager's KV cache is released (it holds no block to serve from): call "
            "extensible_kv.transformers.resume(manager) before starting it"
        )

    manager.stop, manager.start = stop, start
    state.guarded = manager


def _unguard(state: _State) -> None:
    manager, state.guarded = state.guarded, None
    if manager is not None:
        for name in ("start", "stop"):
            vars(manager).pop(name, None)
