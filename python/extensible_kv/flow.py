"""The extensible flow (docs/design.md §5): reserve → warm up and capture → measure → extend.

    flow = KVCacheFlow.reserve(spec, capacity_blocks, "cuda:0")   # one block committed
    ...warm up, capture CUDA graphs against flow.cache.views...
    report = flow.extend_to_fit()                                  # the rest of free memory

`reserve` notes free memory, reserves every buffer for the capacity and commits one block, so
the views the graphs capture exist and their addresses never move. `extend_to_fit` measures
what warm-up and capture left (`torch.cuda.mem_get_info` on a GPU, after returning torch's
cached unused blocks; on the host backend a budget the caller gives, or, when asked,
`host_free_bytes()`: `MemAvailable` or the memory cgroup's room, whichever is less, the very
figure the host backend checks each commit against), keeps the safety margin, converts the
rest to blocks granule-aware, takes the minimum over a process group, commits (zeroing the new
blocks on the current stream), logs `Extended KV cache to N blocks (X GiB)` on the
`extensible_kv` logger and returns an `ExtendReport`.
Replaying the graphs then uses the new blocks: nothing is re-captured.

`legacy=True` is the same API over a cache committed in full at `reserve` (as engines
allocate today): `extend_to_fit` measures and reports the same way but has nothing to map.
Nothing here maps while a stream is capturing a graph (docs/design.md §6): both steps refuse.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, Self, TypeVar

from extensible_kv import _args, _torch, sizing
from extensible_kv._native import UnsupportedError, vmm_unavailable_reason
from extensible_kv.distributed import min_over_group
from extensible_kv.kv_cache import ExtensibleKVCache, KVCacheTensorSpec
from extensible_kv.tensor import close_on_exit

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = [
    "ExtendReport",
    "ExtendableCache",
    "KVCacheFlow",
    "Measurement",
    "free_bytes_or_none",
    "measure_budget_now",
    "normalize_device",
    "refuse_while_capturing",
]

GIB = 1 << 30
logger = logging.getLogger("extensible_kv")


@dataclass(frozen=True)
class ExtendReport:
    """What one `extend_to_fit` did. Bytes are physical (whole granules, every buffer).

    `fit_blocks` is what this rank's budget fits; `blocks_after` is that after the cap and the
    minimum over ranks. `budget_asked_bytes` is the budget the caller gave (what the cache may
    hold in all; `None` when measured), `budget_bytes` what this call could still commit: the
    measured free memory less the margin, or the given budget less what the cache already held
    (so a given 64 MiB shows as 62 MiB when 2 MiB were committed before). `free_bytes`
    is the measured free memory (`None` when the caller gave the budget), `budget_source`
    names where the budget came from. `commit_ms` times the
    commit alone (mapping and zeroing, synchronised on a GPU), `total_ms` the whole call.
    Handles are the VMM handles mapped; a legacy cache counts one allocation per buffer.
    """

    blocks_before: int
    blocks_after: int
    capacity_blocks: int
    fit_blocks: int
    bytes_before: int
    bytes_after: int
    handles_before: int
    handles_after: int
    commit_ms: float
    total_ms: float
    budget_bytes: int
    margin_bytes: int
    free_bytes: int | None
    non_kv_used_bytes: int | None
    budget_source: str
    legacy: bool
    budget_asked_bytes: int | None = None

    @property
    def gib_after(self) -> float:
        """`bytes_after` in GiB (what the log line prints)."""
        return self.bytes_after / GIB

    @property
    def committed_bytes(self) -> int:
        """Bytes this call committed."""
        return self.bytes_after - self.bytes_before


class ExtendableCache(Protocol):
    """What `KVCacheFlow` drives: a cache that commits whole blocks, from `committed_blocks` up
    to `capacity_blocks`, and says what they cost (`footprint`). `ExtensibleKVCache` is one;
    `extensible_kv.transformers` makes transformers' cache one."""

    @property
    def capacity_blocks(self) -> int: ...
    @property
    def committed_blocks(self) -> int: ...
    @property
    def physical_bytes(self) -> int: ...
    @property
    def num_handles(self) -> int: ...
    @property
    def legacy(self) -> bool: ...
    def footprint(self) -> sizing.CacheFootprint: ...
    def commit(self, num_blocks: int) -> None: ...
    def close(self) -> None: ...


CacheT = TypeVar("CacheT", bound=ExtendableCache)


@dataclass(frozen=True)
class Measurement:
    """Step 3's result (`KVCacheFlow.measure`): the budget the cache may still commit and where
    it came from (`measure_budget_now`), the most blocks it fits (`fit_blocks`, never fewer
    than are committed), the budget the caller gave (`None` when measured), and when the
    measurement began (`time.perf_counter()`: an extension's `total_ms` runs from it)."""

    budget: sizing.MemoryBudget
    source: str
    fit_blocks: int
    budget_asked_bytes: int | None
    start: float


class KVCacheFlow(Generic[CacheT]):
    """A cache with the flow's steps: `reserve` builds an `ExtensibleKVCache` and its flow; any
    other `ExtendableCache` gets one from the constructor. `report_units` turns the cache's
    blocks into the blocks its reports and log lines count (default: the same)."""

    def __init__(
        self,
        cache: CacheT,
        device: str | torch.device,
        free_at_init_bytes: int | None = None,
        *,
        report_units: Callable[[int], int] | None = None,
    ) -> None:
        _torch.require("KVCacheFlow")
        import torch

        self.cache = cache
        self.device = torch.device(device)
        self.free_at_init_bytes = free_at_init_bytes
        self.report_units = report_units

    @classmethod
    def reserve(
        cls,
        spec: Sequence[KVCacheTensorSpec],
        capacity_blocks: int,
        device: str | torch.device = "cpu",
        *,
        legacy: bool = False,
        granularity: int | None = None,
        initial_blocks: int = 1,
    ) -> KVCacheFlow[ExtensibleKVCache]:
        """Step 1: note free memory, reserve every buffer for `capacity_blocks`, commit
        `initial_blocks` (legacy: allocate and zero everything)."""
        _torch.require("KVCacheFlow")
        initial_blocks = _args.size(initial_blocks, "initial_blocks")
        device = normalize_device(device, legacy)
        refuse_while_capturing(device, "reserve")
        free_at_init = free_bytes_or_none(device)
        cache = ExtensibleKVCache(
            spec, capacity_blocks, device, legacy=legacy, granularity=granularity
        )
        try:
            cache.commit(initial_blocks)
        except BaseException:
            cache.close()
            raise
        return KVCacheFlow(cache, device, free_at_init)

    def extend_to_fit(
        self,
        *,
        budget_bytes: int | None = None,
        host_free: bool = False,
        margin_bytes: int | None = None,
        transient_peak_bytes: int | None = None,
        max_blocks: int | None = None,
        group: ProcessGroup | None = None,
    ) -> ExtendReport:
        """Steps 3 and 4: measure, convert to blocks, agree, commit, log, report.

        `budget_bytes` is the physical bytes the KV cache may hold in all, counting what it
        holds already, and skips the measurement (no margin): a second call with the same
        budget commits nothing more. It is required on the host backend unless
        `host_free=True` measures `host_free_bytes()` (`MemAvailable`, or the memory
        cgroup's room where that is less). A measured budget is the free memory now, so it
        is what the cache may add; it keeps `margin_bytes` (default `max(1 GiB, 0.75 *
        transient_peak_bytes)`; the peak defaults to torch's allocator statistics on a GPU,
        0 on the host). `max_blocks` caps the commit; `group` (a `torch.distributed` process
        group, e.g. `group.WORLD`) makes every rank commit the minimum of their counts. Every
        byte count is an int >= 0; a wrong argument raises before anything is committed.
        """
        max_blocks = _args.optional_size(max_blocks, "max_blocks")
        measured = self.measure(
            budget_bytes=budget_bytes,
            host_free=host_free,
            margin_bytes=margin_bytes,
            transient_peak_bytes=transient_peak_bytes,
        )
        target = measured.fit_blocks if max_blocks is None else min(measured.fit_blocks, max_blocks)
        if group is not None:
            target = min_over_group(target, group, self.device)
        return self.extend_to(target, measured)

    def measure(
        self,
        *,
        budget_bytes: int | None = None,
        host_free: bool = False,
        margin_bytes: int | None = None,
        transient_peak_bytes: int | None = None,
    ) -> Measurement:
        """Step 3 alone: the budget (`extend_to_fit`'s arguments and rule) and the blocks it
        fits, for a caller that picks the count itself before `extend_to`."""
        budget_bytes = _args.optional_size(budget_bytes, "budget_bytes")
        host_free = _args.flag(host_free, "host_free")
        margin_bytes = _args.optional_size(margin_bytes, "margin_bytes")
        transient_peak_bytes = _args.optional_size(transient_peak_bytes, "transient_peak_bytes")
        start = time.perf_counter()
        refuse_while_capturing(self.device, "extend_to_fit")
        budget, source = measure_budget_now(
            self.device,
            kv_committed_bytes=self.cache.physical_bytes,
            free_at_init_bytes=self.free_at_init_bytes,
            budget_bytes=budget_bytes,
            host_free=host_free,
            margin_bytes=margin_bytes,
            transient_peak_bytes=transient_peak_bytes,
        )
        fit = sizing.blocks_within(budget.budget_bytes, self.cache.footprint())
        return Measurement(budget, source, fit, budget_bytes, start)

    def extend_to(self, num_blocks: int, measured: Measurement) -> ExtendReport:
        """Step 4 alone: commits `num_blocks` (never fewer than are committed), then logs and
        reports the extension `measured` led to."""
        num_blocks = _args.size(num_blocks, "num_blocks")
        if not isinstance(measured, Measurement):
            raise TypeError(f"measured must be a Measurement, not {type(measured).__name__}")
        before, commit_ms = self._commit_timed(num_blocks)
        units = self.report_units or (lambda blocks: blocks)
        after = self._state()
        return report_extension(
            measured.budget,
            measured.source,
            measured.start,
            before=(units(before[0]), *before[1:]),
            after=(units(after[0]), *after[1:]),
            capacity_blocks=units(self.cache.capacity_blocks),
            fit_blocks=units(measured.fit_blocks),
            commit_ms=commit_ms,
            legacy=self.cache.legacy,
            budget_asked_bytes=measured.budget_asked_bytes,
        )

    def _commit_timed(self, num_blocks: int) -> tuple[tuple[int, int, int], float]:
        """Commits `num_blocks` (never fewer than are committed); returns the state before and
        the milliseconds the commit took, finished on the device."""
        before = self._state()
        self._synchronize()  # earlier work (warm-up, replays) is not the commit's
        start = time.perf_counter()
        self.cache.commit(max(num_blocks, self.cache.committed_blocks))
        self._synchronize()
        return before, (time.perf_counter() - start) * 1e3

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def _state(self) -> tuple[int, int, int]:
        """`(committed blocks, physical bytes, handles)` of the cache."""
        cache = self.cache
        return cache.committed_blocks, cache.physical_bytes, cache.num_handles

    def shrink_to(
        self: KVCacheFlow[ExtensibleKVCache], num_blocks: int, *, exact: bool = False
    ) -> None:
        """Gives back the memory of the blocks at and past `num_blocks`, keeping the contents
        of those below (e.g. to lend memory to another model on the GPU); logs `Shrank KV cache
        to N blocks (X GiB)`. `extend_to_fit` or `cache.commit` grows it again, zeroed. Like
        any unmap, not while a stream is capturing a graph."""
        num_blocks = _args.size(num_blocks, "num_blocks")
        exact = _args.flag(exact, "exact")
        refuse_while_capturing(self.device, "shrink_to")
        self.cache.shrink_to(num_blocks, exact=exact)
        logger.info(
            "Shrank KV cache to %d blocks (%.2f GiB)",
            self.cache.committed_blocks,
            self.cache.physical_bytes / GIB,
        )

    def close(self) -> None:
        """Closes the cache and gives its memory back (its views must be gone)."""
        self.cache.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: object,
    ) -> None:
        """Closes; leaving on an exception never hides it (`tensor.close_on_exit`)."""
        close_on_exit(self.close, exc)


def measure_budget_now(
    device: torch.device,
    *,
    kv_committed_bytes: int,
    free_at_init_bytes: int | None = None,
    budget_bytes: int | None = None,
    host_free: bool = False,
    margin_bytes: int | None = None,
    transient_peak_bytes: int | None = None,
) -> tuple[sizing.MemoryBudget, str]:
    """Step 3 for any cache on `device` (`KVCacheFlow.extend_to_fit`, the transformers cache):
    the budget the KV cache may still commit and where it came from, with `extend_to_fit`'s
    arguments and margin rule. `kv_committed_bytes` is what the cache holds now; a given
    `budget_bytes` is what it may hold in all, so that counts against it."""
    if budget_bytes is not None:
        still = max(0, budget_bytes - kv_committed_bytes)
        return sizing.MemoryBudget(still, 0, kv_committed_bytes), "given"
    if device.type == "cuda":
        import torch

        # Blocks torch caches but does not use count as free: the margin covers their
        # coming back (as vLLM measures).
        torch.cuda.empty_cache()
        free_now, source = torch.cuda.mem_get_info(device)[0], "cuda mem_get_info"
        if transient_peak_bytes is None:
            transient_peak_bytes = sizing.cuda_transient_peak_bytes(device)
    elif host_free:
        free_now, source = sizing.host_free_bytes(), "host_free_bytes"
    else:
        raise ValueError(
            "the host backend has no free-memory figure: pass budget_bytes (the bytes the "
            "KV cache may hold in all), or host_free=True to use host_free_bytes() "
            "(MemAvailable and the memory cgroup's room)"
        )
    budget = sizing.measure_budget(
        free_now,
        free_at_init_bytes=free_at_init_bytes,
        kv_committed_bytes=kv_committed_bytes,
        transient_peak_bytes=transient_peak_bytes or 0,
        margin_bytes=margin_bytes,
    )
    return budget, source


def normalize_device(device: str | torch.device, legacy: bool) -> torch.device:
    """`cuda` → `cuda:N` with the current device: the index every later call must agree on.
    A GPU that cannot hold the cache is our `UnsupportedError` with the probe's reason, before
    torch raises its own error from wherever it first touches the device."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return device
    torch_sees_cuda = torch.cuda.is_available()
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if torch_sees_cuda else 0
    # A legacy cache is plain torch memory: only an extensible one needs the VMM API.
    reason = None if legacy else vmm_unavailable_reason(f"cuda:{index}")
    if reason is None and not (torch_sees_cuda and index < torch.cuda.device_count()):
        reason = f"torch {torch.__version__} sees no CUDA device {index}"
    if reason is not None:
        raise UnsupportedError(f"unsupported: {reason}")
    return torch.device("cuda", index)


def refuse_while_capturing(device: torch.device, step: str) -> None:
    """Mapping memory while a stream captures a graph would break the capture
    (docs/design.md §6)."""
    if device.type != "cuda":
        return
    import torch

    with torch.cuda.device(device):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"{step} maps memory and cannot run while a stream is capturing a CUDA graph: "
                "call it after the capture"
            )


def free_bytes_or_none(device: torch.device) -> int | None:
    """Free memory before the reservation: the driver's on a GPU, `host_free_bytes()` on the
    host (used only to report `non_kv_used`; `None` where unreadable)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return sizing.host_free_bytes()
    except (OSError, RuntimeError):
        return None


def report_extension(
    budget: sizing.MemoryBudget,
    source: str,
    start: float,
    *,
    before: tuple[int, int, int],
    after: tuple[int, int, int],
    capacity_blocks: int,
    fit_blocks: int,
    commit_ms: float,
    legacy: bool,
    budget_asked_bytes: int | None = None,
) -> ExtendReport:
    """The `ExtendReport` of one extension, logged: `before` and `after` are (blocks, physical
    bytes, handles), `budget` and `source` what `measure_budget_now` returned, `start` the
    `time.perf_counter()` the call began at (`total_ms` runs from it to now)."""
    report = ExtendReport(
        blocks_before=before[0],
        blocks_after=after[0],
        capacity_blocks=capacity_blocks,
        fit_blocks=fit_blocks,
        bytes_before=before[1],
        bytes_after=after[1],
        handles_before=before[2],
        handles_after=after[2],
        commit_ms=commit_ms,
        total_ms=(time.perf_counter() - start) * 1e3,
        budget_bytes=budget.budget_bytes,
        margin_bytes=budget.margin_bytes,
        free_bytes=None if source == "given" else budget.free_now_bytes,
        non_kv_used_bytes=budget.non_kv_used_bytes,
        budget_source=source,
        legacy=legacy,
        budget_asked_bytes=budget_asked_bytes,
    )
    _log(report)
    return report


def _log(report: ExtendReport) -> None:
    note = " (legacy: committed at reserve)" if report.legacy else ""
    logger.info(
        "Extended KV cache to %d blocks (%.2f GiB)%s",
        report.blocks_after,
        report.gib_after,
        note,
    )
