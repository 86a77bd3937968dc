"""A drop-in for vLLM 0.34's `vllm.utils.extensible_tensor.ExtensibleTensor`, on extensible-kv.

Same constructor, methods, properties, defaults and error types and wording as vLLM's class
(`docs/design.md` §7 lists what vLLM calls), and no vLLM import: vLLM's
`ExtensibleKVCache` runs on it unchanged, through the plugin (`extensible_kv.vllm.plugin`) or
by assignment. Where it differs, it is to be safer, never to surprise vLLM's callers:

- **Handles.** vLLM's class maps one driver allocation per run of missing granules, on every
  grow. Ours cuts a run only where it crosses a multiple of 1 GiB in the reservation (the
  core's default: few handles whatever granule a layer's run starts at, so a segment's memset
  starts while the next handle is created) -- except a grow of an empty tensor (new, or after
  `release_physical()`), which maps one handle per run as vLLM does. That keeps vLLM's RDMA
  contract: `commit(defragment=True)` releases everything and grows again, after which every
  granule-aligned segment lies in one allocation (UCX cannot register a range across
  allocations), and a `recommit()` after sleep gives connectors the same.
  `EXTENSIBLE_KV_VLLM_HANDLES` (read when a tensor is made) picks the core's `HandleSizing`
  kind for the other grows, for measurements: `cap_aligned` (the default), `whole_runs`
  (vLLM's count), `aligned_powers_of_two`.
- **All or nothing.** A failed grow leaves the tensor exactly as it was (vLLM's may leave
  chunks mapped). Out of memory: torch's caching allocator is emptied and the grow retried
  once, as vLLM does; then `extensible_kv.OutOfMemoryError` (a `MemoryError`; vLLM raises the
  driver's `RuntimeError`).
- **`free()` with live views.** vLLM calls `free()` while views are alive. Physical memory is
  returned at once, as vLLM's accounting expects, but the address range stays reserved (and
  inaccessible) until the last view is gone: a stale view faults instead of aliasing memory
  that someone else mapped at the same address. Views also keep the range when the tensor
  object is garbage collected (vLLM's views dangle then). After `free()`, calls that need
  memory raise `extensible_kv.ClosedError` (a `ValueError`); vLLM's would use a null pointer.
- **`device="cpu"`** is accepted: the host backend (mmap + memfd), which is how CI runs
  vLLM's own code without a GPU. Other non-CUDA devices raise `ValueError`, as in vLLM.
- **`export_handle_types`** (POSIX fd = 1, fabric = 8) is asked of every physical allocation,
  with the GPUDirect-RDMA flag where the device allows it on VMM memory, so connectors that
  retain the allocation from a pointer (`cuMemRetainAllocationHandle`) and export it (LMCache,
  UCX cuda_ipc) work. As in vLLM, both together give fabric alone where the device has it
  (fds with fabric are unverified) and fds otherwise.
- **Keeping data** (`EXTENSIBLE_KV_VLLM_KEEP_DATA=1`, through the plugin): vLLM's
  `commit(shrink=True)` and `commit(defragment=True)` release everything and re-grow zeroed;
  with the opt-in they shrink in place and consolidate instead (`shrink_segments_`,
  `consolidate`), and the blocks below the count keep their contents.
- **`max_num_bytes=0`** raises `ValueError`: the core reserves no empty range (vLLM reserves
  one granule); vLLM's KV cache never asks for one.
- ROCm is not supported: the core drives CUDA (and the host), not HIP.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from extensible_kv import _args
from extensible_kv._native import EXPORT_FABRIC as FABRIC
from extensible_kv._native import EXPORT_POSIX_FD as POSIX_FD
from extensible_kv._native import HANDLE_SIZING_KINDS, OutOfMemoryError, UnsupportedError
from extensible_kv._native import ExtensibleTensor as _NativeTensor
from extensible_kv.layouts import round_up
from extensible_kv.sizing import device_granularity
from extensible_kv.tensor import ExtensibleTensor as _CoreTensor
from extensible_kv.tensor import HandleSizing

if TYPE_CHECKING:
    import torch

__all__ = ["HANDLES_ENV_VAR", "ExtensibleTensor", "granule_size"]

HANDLES_ENV_VAR = "EXTENSIBLE_KV_VLLM_HANDLES"
# The core's handle sizings of a grow that does not start from empty (every one but
# `per_run`, which is SGLang's); the first is the core's default.
_CUTS = tuple(kind for kind in HANDLE_SIZING_KINDS if kind != "per_run")


@functools.cache
def _fabric_supported(device: str) -> bool:
    """Whether `device` gives allocations fabric handles (a probe that maps nothing)."""
    try:
        probe = _NativeTensor(1, 1, device, export_handle_types=FABRIC)
    except UnsupportedError:
        return False  # fabric alone is refused where it is missing (or the device is unusable)
    supported = bool(probe.export_handle_types & FABRIC)
    probe.close()
    return supported


# vLLM floors its commit granule at 2 MiB (ROCm reports 4 KiB); `granularity` must match
# `granule_size()`, which vLLM pads layer segments with.
_MIN_GRANULARITY = 2 << 20


def _current_cuda_index() -> int:
    import torch

    # Without a usable CUDA device, index 0 lets the core report why it cannot map memory.
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _resolve_device(device: torch.device | str | int | None, name: str = "device") -> torch.device:
    """`cpu` or `cuda:N` (the current CUDA device when `device` is None or has no index)."""
    import torch

    if device is None:
        return torch.device("cuda", _current_cuda_index())
    if not isinstance(device, str | torch.device):
        try:
            device = _args.size(device, name)
        except TypeError:
            kind = type(device).__name__
            raise TypeError(
                f"{name} must be a torch.device, a name or a CUDA index, not {kind}"
            ) from None
    if isinstance(device, int):
        dev = torch.device("cuda", device)
    else:
        dev = device if isinstance(device, torch.device) else torch.device(device)
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(
            f"ExtensibleTensor requires a cuda device, got {dev}. "
            "(extensible-kv also accepts 'cpu', its host backend.)"
        )
    return torch.device("cuda", _current_cuda_index() if dev.index is None else dev.index)


def _device_name(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"cuda:{device.index}"


@functools.cache
def _granule_size_of(device_name: str) -> int:
    driver_granularity = device_granularity(device_name)
    return round_up(max(driver_granularity, _MIN_GRANULARITY), driver_granularity)


def granule_size(device_index: int | str | torch.device) -> int:
    """Commit granule of a device: the driver's granularity, floored at 2 MiB (as vLLM's).

    `device_index` is a CUDA device index, as vLLM passes it; a device name or
    `torch.device` (`"cpu"`: the host backend) is accepted too.
    """
    return _granule_size_of(_device_name(_resolve_device(device_index, "device_index")))


def _empty_torch_cache(device: torch.device) -> None:
    """Hands memory idling in torch's caching allocator back to the driver (CUDA only: torch
    caches nothing on the host). A hook, so tests can observe the retry."""
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


class ExtensibleTensor:
    """A device byte buffer that grows without moving its base pointer (vLLM 0.34's API).

    The reservation is divided into contiguous segments whose committed bytes form a prefix
    of each: `num_segments` equal segments by default, or the explicit `segment_capacities`
    (in bytes, summing to `max_num_bytes`). `device=None` is the current CUDA device.
    """

    def __init__(
        self,
        max_num_bytes: int,
        device: torch.device | str | int | None = None,
        num_segments: int = 1,
        segment_capacities: Sequence[int] | None = None,
        export_handle_types: int = 0,
    ) -> None:
        # Types first, by name (vLLM's class fails on them somewhere inside); then vLLM's own
        # range checks and wording.
        max_num_bytes = _args.integer(max_num_bytes, "max_num_bytes")
        num_segments = _args.integer(num_segments, "num_segments")
        if segment_capacities is not None:
            segment_capacities = _args.sizes(segment_capacities, "segment_capacities", minimum=None)
        if max_num_bytes < 0:
            raise ValueError("max_num_bytes must be non-negative.")
        if segment_capacities is None:
            if num_segments < 1:
                raise ValueError(f"num_segments must be positive, got {num_segments}.")
            if max_num_bytes % num_segments != 0:
                raise ValueError(
                    f"max_num_bytes ({max_num_bytes}) must be divisible by "
                    f"num_segments ({num_segments})."
                )
            capacities = [max_num_bytes // num_segments] * num_segments
        elif not segment_capacities or any(c <= 0 for c in segment_capacities):
            raise ValueError("segment_capacities must be non-empty and positive.")
        elif sum(segment_capacities) != max_num_bytes:
            raise ValueError(
                f"segment_capacities sum to {sum(segment_capacities)}, not "
                f"max_num_bytes ({max_num_bytes})."
            )
        else:
            capacities = [int(c) for c in segment_capacities]
        if max_num_bytes == 0:
            raise ValueError(
                "max_num_bytes must be positive: extensible-kv reserves no empty address range."
            )
        export_handle_types = _args.size(export_handle_types, "export_handle_types")
        if export_handle_types & ~(POSIX_FD | FABRIC):
            raise UnsupportedError(
                f"export_handle_types={export_handle_types}: only POSIX fd (1) and fabric (8) "
                "are supported"
            )
        cut = os.environ.get(HANDLES_ENV_VAR) or _CUTS[0]
        if cut not in _CUTS:
            raise ValueError(f"{HANDLES_ENV_VAR}={cut!r}: expected one of {', '.join(_CUTS)}")
        self._device = _resolve_device(device)
        device_name = _device_name(self._device)
        if export_handle_types == POSIX_FD | FABRIC:
            # As vLLM: fabric alone where the device has it (fds with fabric are unverified).
            fabric = _fabric_supported(device_name)
            export_handle_types = FABRIC if fabric else POSIX_FD
        self._max_num_bytes = max_num_bytes
        self._segment_capacities = capacities
        self._granularity = _granule_size_of(device_name)
        self._tensor: _CoreTensor | None = _CoreTensor(
            max_num_bytes,
            device=device_name,
            segment_capacities=capacities,
            granularity=self._granularity,
            export_handle_types=export_handle_types,
            handle_sizing=HandleSizing(cut),  # type: ignore[arg-type]
        )
        self._segment_offsets = list(self._tensor.segment_offsets)

    def _open(self) -> _CoreTensor:
        """The core tensor; ClosedError (a ValueError) after `free()`."""
        if self._tensor is None:
            from extensible_kv._native import ClosedError

            raise ClosedError("this ExtensibleTensor was freed")
        return self._tensor

    def full_view(self) -> torch.Tensor:
        """Uint8 view spanning the whole reservation."""
        return self._open().full_view()

    def segment_view(self, index: int) -> torch.Tensor:
        """Uint8 tensor over one segment's committed prefix, sized exactly to it."""
        index = _args.integer(index, "index")
        if not 0 <= index < self.num_segments:
            raise IndexError(f"Segment {index} out of range ({self.num_segments}).")
        return self._open().segment_view(index)

    def resize_per_segment_(self, bytes_per_segment: int, zero_new: bool = False) -> None:
        """Grow every segment's committed prefix to the same size."""
        size = _args.integer(bytes_per_segment, "bytes_per_segment")
        self.resize_segments_([size] * self.num_segments, zero_new)

    def resize_segments_(self, sizes: Sequence[int], zero_new: bool = False) -> None:
        """Grow each segment's committed prefix; optionally zero the new bytes.

        All or nothing; out of memory, torch's cache is emptied and the grow retried once.
        """
        sizes = _args.sizes(sizes, "sizes", minimum=None)
        zero_new = _args.flag(zero_new, "zero_new")
        tensor = self._open()
        if len(sizes) != self.num_segments:
            raise ValueError(f"Expected {self.num_segments} sizes, got {len(sizes)}.")
        committed = tensor.segment_bytes
        for old, new, capacity in zip(committed, sizes, self._segment_capacities, strict=True):
            if new < old:
                raise ValueError(
                    f"ExtensibleTensor is grow-only: cannot resize from {old} "
                    f"to {new} bytes per segment."
                )
            if new > capacity:
                raise ValueError(
                    f"Requested {new} bytes per segment exceeds the segment capacity {capacity}."
                )
        # From empty, one handle per run of granules: the RDMA contract (module docstring).
        whole_runs = tensor.num_handles == 0
        try:
            tensor.resize_per_segment_(sizes, zero_new, one_handle_per_run=whole_runs)
        except OutOfMemoryError:
            _empty_torch_cache(self._device)
            tensor.resize_per_segment_(sizes, zero_new, one_handle_per_run=whole_runs)

    def shrink_segments_(self, sizes: Sequence[int]) -> None:
        """Shrink each segment's committed prefix to `sizes[i]`, keeping its bytes below and
        giving back every granule no committed byte needs (extensible-kv's own: vLLM's class
        is grow-only). All or nothing."""
        sizes = _args.sizes(sizes, "sizes", minimum=None)
        tensor = self._open()
        if len(sizes) != self.num_segments:
            raise ValueError(f"Expected {self.num_segments} sizes, got {len(sizes)}.")
        tensor.shrink_per_segment_(list(sizes), exact=True)
        # vLLM measures the memory a commit leaves (as its own tensor's, freed on return).
        tensor.wait_released()

    def consolidate(self) -> None:
        """Back each segment's committed prefix by one allocation, keeping its contents and
        addresses (extensible-kv's own; vLLM releases and re-grows, losing them)."""
        self._open().consolidate()

    def release_physical(self) -> None:
        """Drop all physical pages but keep the reservation and its views."""
        if self._tensor is not None:
            self._tensor.release_physical()
            self._tensor.wait_released()  # vLLM's sleep frees memory: gone on return, as its own

    @property
    def num_bytes(self) -> int:
        """Current committed size in bytes, summed over all segments."""
        return sum(self._committed())

    @property
    def segment_bytes(self) -> list[int]:
        """Each segment's committed prefix in bytes (extensible-kv's own): 0 after
        `release_physical`, whatever the cache counts."""
        return self._committed()

    @property
    def bytes_per_segment(self) -> int:
        """Current committed prefix size of each segment in bytes (equal segments)."""
        return self._uniform(self._committed())

    @property
    def num_segments(self) -> int:
        return len(self._segment_capacities)

    @property
    def segment_capacity_bytes(self) -> int:
        """Maximum size of each segment (equal segments)."""
        return self._uniform(self._segment_capacities)

    @property
    def segment_capacities(self) -> list[int]:
        return list(self._segment_capacities)

    @property
    def segment_offsets(self) -> list[int]:
        """Byte offset of each segment within the reservation."""
        return list(self._segment_offsets)

    @property
    def capacity_bytes(self) -> int:
        """Bytes reserved: the capacity rounded up to whole granules."""
        return round_up(self._max_num_bytes, self._granularity)

    @property
    def physical_bytes(self) -> int:
        """Physically mapped bytes, including granule rounding."""
        return 0 if self._tensor is None else self._tensor.physical_bytes

    @property
    def num_physical_chunks(self) -> int:
        """Number of driver allocations currently mapped into the reservation."""
        return 0 if self._tensor is None else self._tensor.num_handles

    def segments_backed_by_one_chunk(self, sizes: Sequence[int]) -> list[bool]:
        """Whether each segment's first `sizes[i]` bytes lie within a single driver
        allocation, as RDMA registration of the segment requires."""
        sizes = _args.sizes(sizes, "sizes", minimum=None)
        runs = [] if self._tensor is None else self._tensor.handle_runs()
        g = self._granularity
        chunks = [(first * g, (first + count) * g) for first, count in runs]
        return [
            any(start <= offset and offset + size <= end for start, end in chunks)
            # vLLM's zip: extra sizes are ignored, missing ones give fewer answers.
            for offset, size in zip(self._segment_offsets, sizes, strict=False)
        ]

    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def base_ptr(self) -> int:
        """The reservation's address (0 after `free()`, as vLLM's)."""
        return 0 if self._tensor is None else self._tensor.base_ptr

    @property
    def device(self) -> torch.device:
        return self._device

    def free(self) -> None:
        """Return physical memory now; the addresses go with the last view. Idempotent."""
        tensor, self._tensor = self._tensor, None
        if tensor is not None:
            tensor.free()

    def _committed(self) -> list[int]:
        if self._tensor is None:
            return [0] * self.num_segments
        return list(self._tensor.segment_bytes)

    @staticmethod
    def _uniform(values: list[int]) -> int:
        if any(v != values[0] for v in values):
            raise ValueError(f"Segments differ: {values}.")
        return values[0]

    def __repr__(self) -> str:
        return (
            f"ExtensibleTensor(device={self._device}, capacity_bytes={self.capacity_bytes}, "
            f"num_segments={self.num_segments}, num_bytes={self.num_bytes}, "
            f"physical_bytes={self.physical_bytes}, "
            f"num_physical_chunks={self.num_physical_chunks}, freed={self._tensor is None})"
        )
