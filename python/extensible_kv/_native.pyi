"""Type stubs for the native module (Rust, PyO3). Checked against the module by mypy.stubtest."""

from collections.abc import Callable, Sequence
from typing import Any, Final, Self

from typing_extensions import disjoint_base

__all__ = [
    "CUDA_BUILT",
    "DEFAULT_MAX_HANDLE_BYTES",
    "EXPORT_FABRIC",
    "EXPORT_POSIX_FD",
    "HANDLE_SIZING_KINDS",
    "ClosedError",
    "DriverError",
    "ExtensibleTensor",
    "LoanConflictError",
    "LoanTimeoutError",
    "OutOfMemoryError",
    "PtraceRefusedError",
    "UnsupportedError",
    "_loan_decline",
    "_loan_owner_fds",
    "_owner_fds",
    "_set_stream_provider",
    "extent_bytes",
    "footprint_bytes",
    "host_free_bytes",
    "host_mem_info",
    "parse_start_time",
    "process_start_time",
    "vmm_unavailable_reason",
]

CUDA_BUILT: Final[bool]
DEFAULT_MAX_HANDLE_BYTES: Final[int]
# The names of `handle_sizing`'s kinds, the default first (the facade's `HandleSizingKind`).
HANDLE_SIZING_KINDS: Final[tuple[str, ...]]
# CUDA's `CUmemAllocationHandleType` bits of the export types the core supports.
EXPORT_POSIX_FD: Final[int]
EXPORT_FABRIC: Final[int]

class OutOfMemoryError(MemoryError):
    """Physical memory could not be committed; the tensor is unchanged."""

    op: str
    code: str
    requested_bytes: int
    free_bytes: int | None

class DriverError(RuntimeError):
    """The backend (CUDA driver or OS) failed; `code` holds its name for the failure."""

    op: str
    code: str

class UnsupportedError(RuntimeError):
    """The backend or device cannot do this (e.g. no CUDA VMM support)."""

class ClosedError(ValueError):
    """The tensor was closed."""

class LoanTimeoutError(TimeoutError):
    """A loan was not given back in time; nothing was changed."""

class LoanConflictError(ValueError):
    """Memory that is not this tensor's alone to pass on: a borrowed handle lent onward or
    shared, or a handle share() described lent; nothing was changed."""

class PtraceRefusedError(PermissionError):
    """The kernel refused this process another one's fd (pidfd_getfd: EPERM or EACCES, where
    it may not trace that process); nothing was mapped. Have the owner send the fds over a
    Unix socket instead (send_shared, then recv_shared or recv_loan)."""

    call: str
    pid: int
    code: str

def vmm_unavailable_reason(device: object) -> str | None: ...
def footprint_bytes(segment_offsets: Sequence[int], prefix_bytes: int, granularity: int) -> int: ...
def extent_bytes(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> int: ...
def host_mem_info(meminfo: str = "/proc/meminfo") -> tuple[int, int]: ...
def _owner_fds(description: tuple[Any, ...]) -> list[int]: ...
def _loan_owner_fds(loan: tuple[Any, ...]) -> list[int]: ...
def _loan_decline(
    loan: tuple[Any, ...], indices: Sequence[int], fds: list[int] | None = None
) -> int: ...
def _set_stream_provider(provider: Callable[[int], int] | None) -> None:
    """Registers what names the current stream of a CUDA device (`provider(index) -> int`),
    for calls given no stream; the facade registers torch's."""

def host_free_bytes() -> int:
    """The bytes a host commit can take now: MemAvailable, or the memory cgroup's room."""

def process_start_time(pid: int) -> int | None:
    """Process `pid`'s start time in clock ticks since boot (`/proc/PID/stat` field 22), or
    None when there is no such live process (a zombie is dead)."""

def parse_start_time(stat: bytes) -> int | None:
    """The start time a `/proc/PID/stat` line gives, or None where it names a dead process or
    is not such a line (the command name may hold any bytes)."""

# Every `stream` below is a raw CUstream (an int; 0 the legacy default stream) that the caller
# vouches for, as for `torch.cuda.ExternalStream`: a live stream of the tensor's device that
# stays live until the call returns. Nothing checks it; a dead or foreign stream is undefined
# behaviour in the CUDA driver. A call given none that uses a stream runs on the current stream
# of the tensor's device, as the registered provider names it (torch's, once the facade is
# imported; the default stream without one).

@disjoint_base
class ExtensibleTensor:
    def __new__(
        cls,
        max_bytes: int,
        num_segments: int | None = None,
        device: object = None,
        *,
        segment_capacities: Sequence[int] | None = None,
        granularity: int | None = None,
        handle_sizing: tuple[str, int | None] | None = None,
        export_handle_types: int = 0,
        _fault: tuple[str, int, str] | None = None,
        _profile: bool = False,
    ) -> Self: ...
    @classmethod
    def _import(
        cls,
        description: tuple[Any, ...],
        device: object,
        *,
        granularity: int | None = None,
        fds: list[int] | None = None,
        _fault: tuple[str, int, str] | None = None,
    ) -> Self: ...
    def resize_per_segment_(
        self,
        bytes_per_segment: int | Sequence[int],
        zero_new: bool = True,
        stream: int | None = None,
        *,
        one_handle_per_run: bool = False,
    ) -> Self: ...
    def resize_(self, num_bytes: int, zero_new: bool = True, stream: int | None = None) -> Self: ...
    def shrink_per_segment_(
        self,
        bytes_per_segment: int | Sequence[int],
        *,
        exact: bool = False,
        stream: int | None = None,
    ) -> Self: ...
    def shrink_(
        self, num_bytes: int, *, exact: bool = False, stream: int | None = None
    ) -> Self: ...
    def consolidate(self, *, stream: int | None = None) -> None: ...
    def _is_noop_resize(self, bytes_per_segment: int | Sequence[int]) -> bool: ...
    def _share(self) -> tuple[Any, ...]: ...
    def _refresh(self, description: tuple[Any, ...], fds: list[int] | None = None) -> None: ...
    def _lend(
        self, bytes_per_segment: int | Sequence[int], stream: int | None = None
    ) -> tuple[Any, ...]: ...
    def _borrow(
        self,
        loan: tuple[Any, ...],
        fds: list[int] | None = None,
        zero: bool = True,
        stream: int | None = None,
    ) -> None: ...
    def _borrow_placed(
        self,
        loans: Sequence[tuple[Any, ...]],
        fds: Sequence[list[int] | None],
        placed: Sequence[tuple[int, int, int]],
        segment_bytes: Sequence[int],
        zero: bool = True,
        stream: int | None = None,
    ) -> None: ...
    def _borrow_room(self) -> list[tuple[int, int, int, int]]: ...
    def _lend_runs(self, bytes_per_segment: int | Sequence[int]) -> list[tuple[int, int]]: ...
    def _give_back(self, loan: tuple[Any, ...], stream: int | None = None) -> None: ...
    def _give_back_loans(
        self, loans: Sequence[tuple[Any, ...]], stream: int | None = None
    ) -> int: ...
    def _reclaim(
        self,
        loan: tuple[Any, ...],
        zero: bool = True,
        timeout: float | None = None,
        stream: int | None = None,
    ) -> None: ...
    @property
    def lent_bytes(self) -> int: ...
    @property
    def borrowed_bytes(self) -> int: ...
    @property
    def export_handle_types(self) -> int: ...
    @property
    def imported_from(self) -> int | None: ...
    @property
    def tensor_id(self) -> int: ...
    def release_physical(self, *, stream: int | None = None) -> None: ...
    @property
    def pending_release_bytes(self) -> int: ...
    @property
    def driver_rate(self) -> int | None: ...
    @driver_rate.setter
    def driver_rate(self, rate: int | None) -> None: ...
    def wait_released(self, timeout: float | None = None) -> bool: ...
    def export_ahead(self, max_handles: int) -> int: ...
    def _hold_events(self, held: bool) -> None: ...
    def close(self) -> None: ...
    def _capsule(self, offset: int, num_bytes: int, versioned: bool = True) -> Any: ...
    def _view_capsule(
        self, offset: int, code: int, bits: int, shape: Sequence[int], strides: Sequence[int]
    ) -> Any: ...
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    def _check_invariants(self) -> None: ...
    def take_deferred_errors(self) -> list[str]: ...
    def _profile_report(self, reset: bool = False) -> dict[str, tuple[int, int]]: ...
    def handle_runs(self) -> list[tuple[int, int]]: ...
    @property
    def base_ptr(self) -> int: ...
    @property
    def capacity_bytes(self) -> int: ...
    @property
    def segment_capacity_bytes(self) -> int: ...
    @property
    def segment_offsets(self) -> tuple[int, ...]: ...
    @property
    def segment_capacities(self) -> tuple[int, ...]: ...
    @property
    def bytes_per_segment(self) -> int: ...
    @property
    def segment_bytes(self) -> tuple[int, ...]: ...
    @property
    def num_segments(self) -> int: ...
    @property
    def physical_bytes(self) -> int: ...
    @property
    def num_handles(self) -> int: ...
    @property
    def granularity(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def backend(self) -> str: ...
    @property
    def live_views(self) -> int: ...
    @property
    def closed(self) -> bool: ...
