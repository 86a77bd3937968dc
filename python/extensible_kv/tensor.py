"""`ExtensibleTensor` with torch views.

Every view is a torch tensor over memory exported through DLPack; the export holds a
reference to the reservation, so memory lives as long as any view of it, whatever happens to
the `ExtensibleTensor` object. Views over the capacity are valid for addressing, but touching
bytes past a segment's committed prefix faults: paged indexing never does. `segment_view`
covers exactly the committed prefix, for consumers that register memory.

What such a stray access reports:
- on the host backend, a SIGSEGV. Before the process dies, a handler prints the tensor
  (`base_ptr`, bytes reserved), the offset, the segment and its committed bytes, then the
  Python stack (the facade enables `faulthandler` unless it is on already). It chains to
  the handlers installed before it, and the exit status is the signal's, as without it.
  `EXTENSIBLE_KV_STRAY_REPORT=0` (or `false`, `no`, `off`) leaves the signal handlers and
  faulthandler alone.
- on CUDA, `CUDA_ERROR_ILLEGAL_ADDRESS` ("an illegal memory access was encountered"),
  reported by a later call, usually the next synchronising one, and without the address.
  The error is sticky: the CUDA context of the process is unusable from then on, and every
  later CUDA call fails. `CUDA_LAUNCH_BLOCKING=1` moves the report to the faulty launch, and
  `compute-sanitizer` names the address.

A `stream` argument is a raw `CUstream` (an int, as `torch.cuda.Stream.cuda_stream` gives).
The caller vouches for it, as for `torch.cuda.ExternalStream`: it must be 0 (the legacy
default stream) or a live stream of the tensor's device, and stay live until the call
returns. Nothing can check that, and a dead or foreign stream is undefined behaviour in the
CUDA driver. By default a call runs on torch's current stream of the tensor's device, which
is always valid: the facade registers it with the native module once (`_current_stream`), and
the native methods ask for it only when they use a stream.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, Self, TypeVar

from extensible_kv import _args, _native, _torch
from extensible_kv._native import EXPORT_FABRIC
from extensible_kv._plugins import env_flag
from extensible_kv.ipc import Loan, SharedTensor, export_handle_types_bits
from extensible_kv.layouts import contiguous_strides

if TYPE_CHECKING:
    import torch

__all__ = ["ExtensibleTensor", "HandleSizing"]

logger = logging.getLogger("extensible_kv")

_DLPACK_CODES: dict[torch.dtype, tuple[int, int]] = {}

P = ParamSpec("P")
R = TypeVar("R")


def _current_stream(cuda_index: int) -> int:
    """torch's current stream on CUDA device `cuda_index`: what a native call given no stream
    runs on (registered below, once for the process)."""
    import torch

    return int(torch.cuda.current_stream(cuda_index).cuda_stream)


_native._set_stream_provider(_current_stream)


def _dlpack_code(dtype: torch.dtype) -> tuple[int, int, bool]:
    """`(code, bits, exact)`: DLPack's name for `dtype`, or (`exact` False) a signed integer of
    the same size that the caller reinterprets with `.view(dtype)`."""
    if not _DLPACK_CODES:
        import torch

        kdl_int, kdl_uint, kdl_float, kdl_bfloat, kdl_bool = 0, 1, 2, 4, 6
        _DLPACK_CODES.update(
            {
                torch.bool: (kdl_bool, 8),
                torch.uint8: (kdl_uint, 8),
                torch.int8: (kdl_int, 8),
                torch.int16: (kdl_int, 16),
                torch.int32: (kdl_int, 32),
                torch.int64: (kdl_int, 64),
                torch.float16: (kdl_float, 16),
                torch.float32: (kdl_float, 32),
                torch.float64: (kdl_float, 64),
                torch.bfloat16: (kdl_bfloat, 16),
            }
        )
    code = _DLPACK_CODES.get(dtype)
    if code is not None:
        return code[0], code[1], True
    return 0, dtype.itemsize * 8, False


def deprecated_alias(old: str, new: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Marks a function as `old`, the deprecated name of `new`: each call warns
    (`DeprecationWarning`, at the caller), then does what `new` does. The function carries
    `__deprecated__` (PEP 702's attribute), by which tests tell a deprecated name from the
    public API."""
    message = f"{old} is deprecated: use {new}"

    def mark(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def warned(*args: P.args, **kwargs: P.kwargs) -> R:
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            return function(*args, **kwargs)

        warned.__deprecated__ = message  # type: ignore[attr-defined]
        return warned

    return mark


def _check_description(description: object) -> None:
    if not isinstance(description, SharedTensor):
        raise TypeError(
            f"description must be a SharedTensor (from ExtensibleTensor.share), not "
            f"{type(description).__name__}"
        )


def _check_loan(loan: object) -> None:
    if not isinstance(loan, Loan):
        kind = type(loan).__name__
        raise TypeError(f"loan must be a Loan (from ExtensibleTensor.lend), not {kind}")


def _close_all(fds: list[int] | None) -> None:
    """Closes received fds once the native call that borrowed (duplicated) them is done."""
    import os

    for fd in fds or ():
        try:
            os.close(fd)
        except OSError:
            pass  # the caller closed it itself


@functools.cache
def _enable_stray_report() -> None:
    """Turns Python's faulthandler on before the first tensor, so that the native report of a
    stray access (module docstring) is followed by the Python stack. Off with
    `EXTENSIBLE_KV_STRAY_REPORT=0`."""
    if not env_flag("EXTENSIBLE_KV_STRAY_REPORT", True):
        return
    import faulthandler

    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable()
    except (RuntimeError, OSError, ValueError):  # no usable stderr (a daemon, a capture)
        logger.debug("faulthandler could not be enabled; stray accesses print no Python stack")


def _export_bits(types: object) -> int:
    """`export_handle_types` as CUDA's bits, each wrong type or value named."""
    name = "export_handle_types"
    if isinstance(types, str | list | tuple):
        for item in types if isinstance(types, list | tuple) else ():
            if isinstance(item, str):
                continue
            try:
                _args.integer(item, name)  # ints as the core takes them
            except TypeError:
                raise TypeError(
                    f"{name} entries must be ints or names, not {type(item).__name__}"
                ) from None
        try:
            bits = export_handle_types_bits(types)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
    else:
        bits = _args.size(types, name)  # a TypeError naming it for anything but an int
    if not 0 <= bits < 2**32:
        raise ValueError(f"{name} must be CUDA's handle-type bits (0 to 2**32-1), got {bits}")
    return bits


# The kinds are the core's (`_native.HANDLE_SIZING_KINDS`, which checks them); this restates
# them for type checkers only, and tests/test_tensor.py keeps the two equal.
HandleSizingKind = Literal["cap_aligned", "aligned_powers_of_two", "per_run", "whole_runs"]


@dataclasses.dataclass(frozen=True)
class HandleSizing:
    """How grows cut each run of missing granules into physical handles (the one handle-sizing
    knob, `ExtensibleTensor(..., handle_sizing=HandleSizing(...))`).

    `kind`:
    - `"cap_aligned"` (the default): cut at the multiples of `max_bytes` in the reservation,
      nowhere else; few handles whatever granule a run starts at.
    - `"aligned_powers_of_two"`: aligned power-of-two handles of at most `max_bytes`.
    - `"per_run"`: one handle per run from its start, in pieces of `max_bytes` (SGLang's arena;
      a granule-sized `max_bytes` is what per-granule allocators do).
    - `"whole_runs"`: one handle per run, however long (takes no `max_bytes`).

    `max_bytes` is the largest handle, a positive multiple of the granularity, taken as given
    (an explicit 1 GiB with a 2 GiB granularity is a `ValueError`); `None` means
    `DEFAULT_MAX_HANDLE_BYTES` (1 GiB), raised to the granularity where that is larger: only
    the default rises. A wrong value raises a `TypeError` or `ValueError` naming
    `handle_sizing` when the tensor is built.
    """

    kind: HandleSizingKind = "cap_aligned"
    max_bytes: int | None = None


def _handle_sizing(sizing: object) -> tuple[str, int | None] | None:
    """`handle_sizing` as the native module takes it: `(kind, max_bytes)`, or None."""
    if sizing is None:
        return None
    if not isinstance(sizing, HandleSizing):
        raise TypeError(f"handle_sizing must be a HandleSizing, not {type(sizing).__name__}")
    return sizing.kind, sizing.max_bytes


class ExtensibleTensor(_native.ExtensibleTensor):
    """One address reservation of `max_bytes`, in `num_segments` segments that grow in lockstep.

    `ExtensibleTensor(max_bytes, num_segments=1, device="cpu", *, segment_capacities=None,
    granularity=None, handle_sizing=None, export_handle_types=0)`: `device` is `"cpu"` (host
    backend), `"cuda"`, `"cuda:N"`, a `torch.device`, or a CUDA index `N` (an int, as torch
    takes it). `segment_capacities` gives unequal
    segments (summing to `max_bytes`). `handle_sizing` (a `HandleSizing`) says how grows cut
    new memory into physical handles: by default at multiples of 1 GiB. `export_handle_types`
    (`"posix_fd"`, `"fabric"`, CUDA's bits, or a list) makes the memory shareable with other
    processes (`share`, `from_shared`). Fabric asked with POSIX fds (`["posix_fd", "fabric"]`,
    as vLLM asks for NIXL) is dropped, with a warning, where the device does not support it
    (no NVLink fabric or IMEX channel; the host backend never): the memory is shared through
    fds. Fabric asked alone where it is not supported is an `UnsupportedError`, since the
    memory could not be shared at all. Use as a context manager to `close()` on exit.

    Sizes are ints or any integer with `__index__` (numpy, torch scalars); each wrong argument
    raises a `TypeError` or `ValueError` naming it, and leaves the tensor unchanged.
    """

    def __new__(
        cls,
        max_bytes: int,
        num_segments: int | None = None,
        device: object = None,
        *,
        segment_capacities: Sequence[int] | None = None,
        granularity: int | None = None,
        handle_sizing: HandleSizing | None = None,
        export_handle_types: int | str | list[int | str] | tuple[int | str, ...] = 0,
        **private: Any,
    ) -> Self:
        """See the class's docstring. `private` takes the underscored test hooks of the native
        constructor (`_profile`, `_fault`) and nothing else."""
        unknown = sorted(k for k in private if not k.startswith("_"))
        if unknown:
            raise TypeError(f"ExtensibleTensor() got an unexpected keyword argument {unknown[0]!r}")
        bits = _export_bits(export_handle_types)
        sizing = _handle_sizing(handle_sizing)
        _enable_stray_report()
        tensor = super().__new__(
            cls,
            max_bytes,
            num_segments,
            device,
            segment_capacities=segment_capacities,
            granularity=granularity,
            handle_sizing=sizing,
            export_handle_types=bits,
            **private,
        )
        if bits & EXPORT_FABRIC and not tensor.export_handle_types & EXPORT_FABRIC:
            # Only with POSIX fds: fabric alone where it is missing is the core's refusal.
            logger.warning(
                "%s cannot export fabric handles; the memory is exportable as POSIX fds only",
                tensor.device,
            )
        return tensor

    def share(self) -> SharedTensor:
        """A picklable description of this tensor's memory for other processes (see
        `extensible_kv.ipc`); each handle is exported once, on the first call that needs it.

        Loans and shares refuse each other: a tensor that maps borrowed memory is refused with
        `LoanConflictError` (its importers would keep mapping the lender's memory after the
        give-back; give the loans back first), and a handle described here is never lent."""
        return SharedTensor._from_native(self._share())

    @classmethod
    def from_shared(cls, description: SharedTensor, device: object = None) -> Self:
        """The memory `description` describes, mapped in this process at the same offsets of a
        reservation of its own (on `device`, by default the owner's). Views keep it alive,
        whatever the owner does. It cannot grow, shrink or release the owner's memory:
        `refresh` follows the owner instead. All or nothing: a failure maps nothing and keeps
        no fd or handle. Where this process may not take the owner's fds by pid (another user,
        Yama's ptrace_scope), `PtraceRefusedError` (a `PermissionError`): have the owner
        `send_shared` the description instead."""
        _check_description(description)
        target = description.device if device is None else device
        fds = description._take_fds()
        try:
            # The granularity is the owner's: the host backend's is its own to pick otherwise.
            return cls._import(
                description._to_native(), target, granularity=description.granularity, fds=fds
            )
        finally:
            _close_all(fds)

    def refresh(self, description: SharedTensor) -> None:
        """Follows the owner to a newer `description` of its memory: maps what it grew, unmaps
        (after the device is done with it) what it released; the committed sizes become the
        description's. All or nothing. A stale description (handles the owner released since)
        or one of another tensor is a `ValueError`."""
        _check_description(description)
        fds = description._take_fds()
        try:
            self._refresh(description._to_native(), fds)
        finally:
            _close_all(fds)

    def lend(self, bytes_per_segment: int | Sequence[int], *, stream: int | None = None) -> Loan:
        """Lends the memory past `bytes_per_segment` (the size this tensor keeps: an int, or
        one per segment) to another tensor, in this process or another: a picklable `Loan`.

        The segments shrink to that size, keeping the bytes below; every whole handle past it
        is exported (once per handle: a later loan reuses the export) and unmapped once the
        work queued on `stream` is done (an event on it, by default torch's current stream:
        the device need not be idle; work on other streams is the caller's to order). A handle
        that straddles the size kept stays here. The addresses stay reserved, so views and
        CUDA graphs stay valid, and a grow over the lent memory is refused until `reclaim`.
        Needs `export_handle_types="posix_fd"`. All or nothing: `ValueError` when no whole
        handle lies past the size kept, and `LoanConflictError` (a `ValueError`) when one is
        not this tensor's alone to lend: a borrowed handle (it goes back to its lender, never
        onward) or one that `share()` described (importers may map it still)."""
        return Loan._from_native(self._lend(bytes_per_segment, stream))

    def borrow(self, loan: Loan, *, zero: bool = True, stream: int | None = None) -> None:
        """Maps `loan`'s memory at the ends of this tensor's segments, each growing by the
        loan's bytes split evenly: a loan from a tensor of the same geometry. The loan must
        fit: the same device and granularity, segments that end at a granule boundary with
        nothing mapped past it, room for the loan, and no handle crossing a segment's end;
        else a `ValueError` says why, before anything is mapped. A loan of another geometry
        (another model's cache) is dealt over the segments instead: `borrow_dealt`, or the
        caches' `borrow`. A tampered, stale or replayed loan is a `ValueError` too (each
        handle is borrowed at most once), and so is a loan whose lender closed its tensor,
        even while this call runs: every fd taken is checked against the lender's board after
        it is taken. Where this process may not take the lender's fds by pid,
        `PtraceRefusedError` (a `PermissionError`): have the lender `send_shared` the loan,
        and `recv_loan` it here. With `zero` (the default) the borrowed bytes are zeroed on
        `stream`; `zero=False` keeps the lender's bytes, for a trusted pair. All or nothing. A
        borrow waits first for what shrinks gave back to be released; Ctrl-C ends that wait,
        with nothing borrowed."""
        _check_loan(loan)
        _args.flag(zero, "zero")
        fds = loan._take_fds()
        try:
            self._borrow(loan._to_native(), fds, zero, stream)
        finally:
            _close_all(fds)

    def give_back(self, loan: Loan, *, stream: int | None = None) -> None:
        """Returns `loan`'s memory to its lender: every segment shrinks to where the loan's
        memory begins in it (memory this tensor grew past it is released), once the work
        queued on `stream` is done. A shrink past part of a loan gives back whole handles, as
        this does. If the lender is gone, the memory goes back to the driver."""
        _check_loan(loan)
        self._give_back(loan._to_native(), stream)

    def reclaim(
        self,
        loan: Loan,
        *,
        zero: bool = True,
        timeout: float | None = None,
        stream: int | None = None,
    ) -> None:
        """Takes `loan` back: waits, without the GIL, until the borrower has given it back,
        or died, or never borrowed it (then no one can any more), up to `timeout` seconds
        (`None`: for ever), then maps the memory back at its addresses, zeroed on `stream`
        unless `zero=False`. The segments grow back to their size before the lend if they
        hold what it kept and every byte up to there is mapped (after an exact shrink, a
        `consolidate` or a shrink and grow, the tail of a handle that straddled the size kept
        may not be: then the memory comes back unused past the committed bytes, and a grow
        uses it). Past the timeout, `LoanTimeoutError` and nothing changes. Ctrl-C (any
        signal whose handler raises) ends the wait: before the loan is back, its exception is
        raised and nothing changed; once it is back, the reclaim completes and a
        `KeyboardInterrupt` says so. One reclaim of a loan at a time: a second is a
        `ValueError` while the first waits."""
        _check_loan(loan)
        _args.flag(zero, "zero")
        timeout = _args.seconds(timeout)
        self._reclaim(loan._to_native(), zero, timeout, stream)

    def wait_released(self, timeout: float | None = None) -> bool:
        """Waits (without the GIL) until the memory that shrinks and `release_physical` gave
        back has been released, or for `timeout` seconds: whether it has.
        `pending_release_bytes` is what is still on its way back. Ctrl-C ends the wait."""
        return super().wait_released(_args.seconds(timeout))

    def export_ahead(self, max_handles: int) -> int:
        """Exports up to `max_handles` of the handles not exported yet, the top ones first (a
        lend gives the top of each segment), so that a later `lend` of them only unmaps: what
        a pool donor does between its steps, a few handles at a time (an export has a cost,
        docs/design.md §2, and the tensor's lock is held while it exports). Returns how many
        of its own handles (not borrowed ones) are still not exported: 0 once all are, and
        always for a tensor whose handles do not export as POSIX fds (no loan could take
        them). Each export holds one fd until its handle is released. A failed export (out of
        fds, say) raises, keeping the exports made before it."""
        return super().export_ahead(_args.size(max_handles, "max_handles"))

    _export_ahead = export_ahead  # its name before it was public (the pool's tests use it)

    # -- suspending: the memory goes back, the addresses stay (the integrations' pause) -------
    # "release" is the driver's word (`release_physical`: the memory goes for good); a
    # suspended tensor remembers its sizes for `resume`.

    _suspended_sizes: tuple[int, ...] | None = None  # each segment's bytes before `suspend`

    @property
    def suspended(self) -> bool:
        """Whether `suspend` gave the memory back and `resume` has not taken it again."""
        return self._suspended_sizes is not None

    def suspend(
        self, bytes_per_segment: int | Sequence[int] = 0, *, stream: int | None = None
    ) -> None:
        """Gives back the memory past `bytes_per_segment` (an int, or one per segment; by
        default all of it) and waits until it is gone, remembering every segment's size for
        `resume`. The addresses stay reserved, so views and CUDA graphs stay valid; the bytes
        kept keep their contents (an exact shrink, as `shrink_per_segment_`), the others are
        lost. Suspending again before `resume` does nothing. `stream` as `release_physical`."""
        if self.suspended:
            return
        sizes = self.segment_bytes
        if type(bytes_per_segment) is int and bytes_per_segment == 0:
            self.release_physical(stream=stream)  # all of it: every handle goes as it is
        else:
            self.shrink_per_segment_(bytes_per_segment, exact=True, stream=stream)
        # Suspended from here on, even if the wait is interrupted (Ctrl-C): `resume` must grow
        # back what went, and takes back whatever is still on its way.
        self._suspended_sizes = sizes
        self.wait_released()

    def resume(self, *, zero_new: bool = True, stream: int | None = None) -> None:
        """Grows every segment back to its size at `suspend`, at the same addresses, zeroing
        the new bytes unless `zero_new=False` (as `resize_per_segment_`). All or nothing: on
        `OutOfMemoryError` the tensor stays suspended. Does nothing when not suspended."""
        _args.flag(zero_new, "zero_new")
        sizes = self._suspended_sizes
        if sizes is None:
            return
        self.resize_per_segment_(list(sizes), zero_new, stream)
        self._suspended_sizes = None

    @property
    @deprecated_alias("ExtensibleTensor.released", "ExtensibleTensor.suspended")
    def released(self) -> bool:
        """Deprecated: `suspended`."""
        return self.suspended

    @deprecated_alias("ExtensibleTensor.release()", "ExtensibleTensor.suspend()")
    def release(
        self, bytes_per_segment: int | Sequence[int] = 0, *, stream: int | None = None
    ) -> None:
        """Deprecated: `suspend` (the same call). "Release" is the driver's word
        (`release_physical`: the memory goes for good)."""
        self.suspend(bytes_per_segment, stream=stream)

    def free(self) -> bool:
        """Gives every byte of memory back now, and the addresses too unless views are alive:
        then they stay reserved (and inaccessible) until the last view is gone, so that a stale
        view faults instead of reaching memory someone else mapped at its address (what a
        stack that frees a buffer its views outlive needs). Either way the tensor is done
        with: True when it is closed, False when only its memory went (then every grow still
        works, and `close()` succeeds once the views are gone). Idempotent."""
        try:
            self.close()
        except BufferError:
            self.release_physical()
            self._suspended_sizes = None  # done with, even if the wait is interrupted
            self.wait_released()
            return False
        return True

    def view(
        self,
        dtype: torch.dtype,
        shape: Sequence[int],
        strides: Sequence[int] | None = None,
        offset: int = 0,
    ) -> torch.Tensor:
        """A strided view: `strides` in elements (default: contiguous), `offset` in bytes.

        The view's storage spans exactly the bytes it can address, from `offset` on.
        """
        _torch.require("ExtensibleTensor.view")
        from torch.utils.dlpack import from_dlpack

        dtype = _args.torch_dtype(dtype)
        shape = _args.sizes(shape, "shape")
        strides = contiguous_strides(shape) if strides is None else _args.sizes(strides, "strides")
        offset = _args.size(offset, "offset")
        code, bits, exact = _dlpack_code(dtype)
        view = from_dlpack(self._view_capsule(offset, code, bits, shape, strides))
        # Types DLPack consumers may not know (float8, complex) travel as same-sized ints.
        return view if exact else view.view(dtype)

    def full_view(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole capacity as a 1-D tensor of `dtype` (default uint8)."""
        _torch.require("ExtensibleTensor.full_view")
        import torch

        dtype = torch.uint8 if dtype is None else _args.torch_dtype(dtype)
        itemsize = dtype.itemsize
        if self.capacity_bytes % itemsize:
            raise ValueError(
                f"capacity of {self.capacity_bytes} bytes is not a multiple of {dtype}'s "
                f"{itemsize}-byte items"
            )
        return self.view(dtype, (self.capacity_bytes // itemsize,))

    def segment_view(self, index: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The committed prefix of segment `index`, as a 1-D tensor whose storage is exactly it."""
        _torch.require("ExtensibleTensor.segment_view")
        import torch

        index = _args.integer(index, "index")
        if not 0 <= index < self.num_segments:
            raise IndexError(f"segment {index} out of range for {self.num_segments} segments")
        dtype = torch.uint8 if dtype is None else _args.torch_dtype(dtype)
        itemsize = dtype.itemsize
        committed = self.segment_bytes[index]
        if committed % itemsize:
            raise ValueError(
                f"segment {index} holds {committed} bytes, not a multiple of {itemsize}"
            )
        return self.view(dtype, (committed // itemsize,), offset=self.segment_offsets[index])

    def __enter__(self) -> ExtensibleTensor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: object,
    ) -> None:
        """Closes the tensor; leaving on an exception never hides it (`close_on_exit`)."""
        close_on_exit(self.close, exc)


def close_on_exit(close: Callable[[], None], exc: BaseException | None) -> None:
    """What leaving a `with` does: `close()`; and when leaving on the exception `exc`, never
    hiding it. Where `close` fails then (`BufferError` while views are alive: the memory is
    freed when the last view dies), the failure is logged and noted on `exc`, and the caller
    returns, so that `exc` goes on unchanged."""
    if exc is None:
        close()
        return
    try:
        close()
    except Exception as error:
        note = f"extensible_kv: leaving `with` did not close: {type(error).__name__}: {error}"
        if isinstance(error, BufferError):
            note += " (the memory is freed when the last view dies)"
        logger.warning("%s", note)
        exc.add_note(note)


# ---------------------------------------------------------------------------------------------
# borrowing loans of any geometry: dealt here (policy), placed and checked by the core
# (mechanism), docs/design.md §3.10


def borrow_dealt(
    tensors: Sequence[ExtensibleTensor],
    segment_block_bytes: Sequence[int],
    loans: Sequence[Loan],
    *,
    zero: bool = True,
    stream: int | None = None,
    max_blocks: int | None = None,
) -> int:
    """Borrows `loans` (of any geometry, on the tensors' device and granularity) into
    `tensors`, the buffers of one cache whose segments grow in lockstep, buffer `i` by
    `segment_block_bytes[i]` a block: the most blocks `N` (at most `max_blocks`) that the
    loans' whole handles hold in this layout, every segment of every buffer growing by `N`
    blocks. Returns `N`.

    The handles are dealt by `extensible_kv.shape.deal` from what each segment maps past its
    committed end now (`_borrow_room`); each tensor then maps its handles where the dealing put
    them, which the core checks (`ExtensibleTensor::borrow_placed`). Handles the layout cannot
    use go back to their lender at once, unmapped, so the lender's `reclaim` never waits for
    them. A `ValueError` before anything changes for a loan of another device or granularity,
    of one of these tensors, or that holds no block here. Where the first tensor's borrow
    fails, nothing changed and the loans stay offered; where a later step fails, what was
    mapped goes back and so does every other handle of the loans (their lender reclaims them
    at once)."""
    from extensible_kv.shape import BufferShape, CacheShape, deal

    zero = _args.flag(zero, "zero")
    loans = tuple(loans)
    tensors = tuple(tensors)
    if not loans:
        raise ValueError("no loan to borrow")
    if not tensors or len(tensors) != len(segment_block_bytes):
        raise ValueError(
            f"{len(segment_block_bytes)} block sizes for {len(tensors)} tensors: one per tensor"
        )
    for loan in loans:
        _check_loan(loan)
    keys = [(loan.tensor_id, loan.loan_id) for loan in loans]
    if len(set(keys)) != len(keys):
        raise ValueError("a loan is listed twice")
    device, granularity = tensors[0].device, tensors[0].granularity
    own = {t.tensor_id for t in tensors}
    for loan in loans:
        if loan.device != device or loan.granularity != granularity:
            raise ValueError(
                f"cannot borrow a loan of {loan.device} with granularity {loan.granularity} "
                f"into a cache on {device} with granularity {granularity}: the device and "
                "granularity must be the same"
            )
        if loan.tensor_id in own:
            raise ValueError("a cache cannot borrow its own loan: reclaim it instead")
    rooms = [t._borrow_room() for t in tensors]
    shape = CacheShape(
        device,
        granularity,
        tuple(BufferShape(len(r), bb) for r, bb in zip(rooms, segment_block_bytes, strict=True)),
    )
    limit = min(
        room[3] // bb for r, bb in zip(rooms, segment_block_bytes, strict=True) for room in r
    )
    if max_blocks is not None:
        limit = min(limit, max_blocks)
    handles = [(li, hi) for li, loan in enumerate(loans) for hi in range(len(loan.handles))]
    dealing = deal(
        shape,
        [[room[1] for room in r] for r in rooms],
        [loans[li].handles[hi].num_granules for li, hi in handles],
        room_granules=[[room[2] for room in r] for r in rooms],
        max_blocks=max(0, limit),
    )
    if dealing.blocks == 0:
        total = sum(loan.num_bytes for loan in loans)
        raise ValueError(
            f"the loans' {len(handles)} handles ({total} bytes) hold no block of this cache "
            f"({shape.block_bytes()} bytes a block over {shape.num_segments} segments, room "
            f"for {max(0, limit)} more blocks): nothing was borrowed"
        )
    natives = [loan._to_native() for loan in loans]
    fds = [loan._take_fds() for loan in loans]
    unused: dict[int, list[int]] = {}
    for k in dealing.unused:
        li, hi = handles[k]
        unused.setdefault(li, []).append(hi)
    done: list[ExtensibleTensor] = []
    touched = False
    try:
        for ti, tensor in enumerate(tensors):
            placed = []
            for k, where in enumerate(dealing.placements):
                if where is not None and where[0] == ti:
                    li, hi = handles[k]
                    placed.append((li, hi, where[1]))
            bb = segment_block_bytes[ti]
            sizes = [b + dealing.blocks * bb for b in tensor.segment_bytes]
            tensor._borrow_placed(natives, fds, placed, sizes, zero, stream)
            done.append(tensor)
            touched = True
        # What this layout cannot use goes back last: a borrow that fails at its first
        # tensor has changed nothing, and its loans stay offered.
        for li, indices in unused.items():
            _native._loan_decline(natives[li], indices, fds[li])
    except BaseException as error:
        if touched:
            _give_back_whole(done, natives, fds, stream, error)
        raise
    finally:
        for received in fds:
            _close_all(received)
    return dealing.blocks


def _give_back_whole(
    tensors: Sequence[ExtensibleTensor],
    natives: Sequence[tuple[Any, ...]],
    fds: Sequence[list[int] | None],
    stream: int | None,
    error: BaseException,
) -> None:
    """A borrow that failed after it changed something: what `tensors` mapped goes back, and
    every other handle of the loans is returned at once, so that their lenders reclaim them
    whole rather than wait for handles nobody holds. Best effort: what fails is noted on
    `error` (a lender gone needs nothing back)."""
    for tensor in tensors:
        try:
            tensor._give_back_loans(list(natives), stream)
        except Exception as failed:
            error.add_note(f"extensible_kv: giving back after the failed borrow failed: {failed}")
    for native, received in zip(natives, fds, strict=True):
        try:
            _native._loan_decline(native, list(range(len(native[7]))), received)
        except Exception as failed:
            error.add_note(f"extensible_kv: returning a loan's handles failed: {failed}")


def give_back_dealt(
    tensors: Sequence[ExtensibleTensor],
    segment_block_bytes: Sequence[int],
    loans: Sequence[Loan],
    *,
    stream: int | None = None,
    leading_blocks: int = 0,
) -> tuple[int, int]:
    """Gives back whatever of `loans` any of `tensors` maps (`borrow_dealt`'s buffers), each
    tensor's segments shrinking to where a loan's handles begin in them, then every segment
    to the blocks all of them still hold (in lockstep: a handle that straddles that end stays,
    as slack). Returns `(bytes given back, blocks held now)`, blocks counted past
    `leading_blocks`."""
    loans = tuple(loans)
    for loan in loans:
        _check_loan(loan)
    natives = [loan._to_native() for loan in loans]
    given = sum(t._give_back_loans(natives, stream) for t in tensors)
    held = min(
        max(0, min(t.segment_bytes) // bb - leading_blocks)
        for t, bb in zip(tensors, segment_block_bytes, strict=True)
    )
    for t, bb in zip(tensors, segment_block_bytes, strict=True):
        target = (leading_blocks + held) * bb
        sizes = t.segment_bytes
        if max(sizes) > target:
            t.shrink_per_segment_([min(size, target) for size in sizes], stream=stream)
    return given, held
