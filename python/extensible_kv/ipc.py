"""Sharing an `ExtensibleTensor`'s memory with other processes.

The owner creates the tensor exportable (`export_handle_types="posix_fd"`, or `"fabric"`
where the device supports it) and describes its memory with `share()`: a picklable
`SharedTensor` of the tensor's random id, the geometry, the committed sizes and, per physical
handle, its granule run, a serial number and how to get it (the owner's pid and an fd it
keeps open, or a fabric handle). Another process maps the same memory at the same offsets of
a reservation of its own with `ExtensibleTensor.from_shared(description)`;
`refresh(description)` follows the owner's later grows and shrinks. An importer can never
grow, shrink or free the owner's memory; what it maps stays valid, whatever the owner does,
until the importer lets go.

Fds are taken from the owner by pid (`pidfd_getfd`, Linux 5.6+, which needs ptrace access to
the owner). Where that is refused, `send_shared(sock, description)` passes the description
and the fds over a connected Unix socket (SCM_RIGHTS) and `recv_shared(sock)` returns a
description carrying the received fds, which `from_shared` / `refresh` then use (and close).

A description is untrusted: every field is checked, and every fd is checked against the
owner's export registry (a memfd named after the tensor's id, which says which fd backs which
handle) after it is taken and before anything is mapped. A stale description — one whose
handles the owner has released since, so that its fd numbers may name other memory by now —
is refused with a `ValueError` that says so; `share()` again for a current one. `refresh`
refuses a description of another tensor.

Each handle is exported once, on the first `share()` that needs it (the export cost,
docs/design.md §2): few, large handles — the default handle policy — make sharing cheap.

Lending moves memory instead of sharing it: `loan = lender.lend(bytes_per_segment)` shrinks
the lender to that size and makes the whole handles past it a `Loan` (picklable), which one
other tensor, in this process or another, maps at the ends of its segments with
`borrower.borrow(loan)`; `borrower.give_back(loan)` returns them and
`lender.reclaim(loan)` maps them back at the lender's same addresses. A loan names the
lender's loan board (a memfd named after the tensor and the loan, holding a random epoch,
the loan's state and what was lent): a tampered, stale or replayed loan is a `ValueError`
before anything is mapped. Its fds are taken by pid like a description's, or travel over a
Unix socket: `send_shared(sock, loan)` in the lender, `recv_loan(sock)` in the borrower.
Where the kernel refuses the fds by pid (another user, Yama's ptrace_scope), a borrow or an
import raises `PtraceRefusedError`, a `PermissionError`: send them over a socket instead.

A loan moves memory, a share maps it twice, and the two refuse each other
(`LoanConflictError`, a `ValueError`, nothing changed): a tensor that maps borrowed memory
cannot `share()` (its importers would keep the lender's memory after the give-back and the
reclaim, reading the lender's bytes and writing into them), and a handle `share()` described
is never lent (its importers would read what the borrower writes, and write into its memory),
since an importer may map it for as long as it likes. A borrowed handle is never lent onward
either: it goes back to its lender. So a shared tensor lends only memory grown after its last
`share()`, and a borrower shares once it has given its loans back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from extensible_kv import _args
from extensible_kv._native import EXPORT_FABRIC, EXPORT_POSIX_FD

if TYPE_CHECKING:
    import socket

__all__ = [
    "LOAN_FORMAT",
    "Loan",
    "LoanHandle",
    "SharedHandle",
    "SharedTensor",
    "export_handle_types_bits",
    "recv_loan",
    "recv_shared",
    "send_shared",
]

_NAMES = {"posix_fd": EXPORT_POSIX_FD, "fabric": EXPORT_FABRIC, "none": 0}
# The version of a loan's JSON form (`Loan.to_json`): the pool's ledger and the socket carry it.
LOAN_FORMAT = 1
# Every integer of a loan's JSON form is below it (tensor ids are 128 bits).
_MAX_LOAN_INT = 2**128
_MAX_FDS_PER_MESSAGE = 250  # below the kernel's SCM_MAX_FD (253)
_MAX_DESCRIPTION_BYTES = 1 << 26  # ~500,000 handles: far past any real tensor


def export_handle_types_bits(types: int | str | list[int | str] | tuple[int | str, ...]) -> int:
    """CUDA's `CUmemAllocationHandleType` bits for `types`: an int (0, 1 POSIX fd, 8 fabric,
    9 both; numpy and torch integer scalars too), a name (`"posix_fd"`, `"fabric"`) or a list
    of those."""
    if isinstance(types, bool) or not isinstance(types, str | list | tuple):
        # An int, or any integer `operator.index` takes (numpy, torch scalars), as the core.
        return _args.integer(types, "export_handle_types")
    if isinstance(types, str):
        try:
            return _NAMES[types.lower()]
        except KeyError:
            known = ", ".join(repr(n) for n in _NAMES)
            raise ValueError(f"unknown export handle type {types!r}; known: {known}") from None
    bits = 0
    for item in types:
        bits |= export_handle_types_bits(item)
    return bits


class _Carrier:
    """What a `SharedTensor` and a `Loan` have in common: a description of another process's
    memory that may carry fds received over a socket (`received_fds`, set only by
    `recv_shared` / `recv_loan`: this process's own fds, the registry's or board's first,
    then one per handle). The native call that maps the memory takes them once
    (`_take_fds`) and closes them; `close_received_fds` closes those nothing took. The fds
    are this process's alone: never pickled, never compared."""

    received_fds: tuple[int, ...] | None

    def _take_fds(self) -> list[int] | None:
        """The received fds, once: the caller closes them after the native call, which only
        borrows (duplicates) them."""
        fds = self.received_fds
        if fds is None:
            return None
        object.__setattr__(self, "received_fds", ())
        return list(fds)

    def close_received_fds(self) -> None:
        """Closes the received fds that no call took (a borrow or an import that never
        happened); nothing for a description that carries none."""
        for fd in self._take_fds() or ():
            os.close(fd)

    def __reduce__(self) -> tuple[Any, ...]:
        values = tuple(
            getattr(self, f.name)
            for f in fields(self)  # type: ignore[arg-type]
            if f.name != "received_fds"
        )
        return (type(self), values)


@dataclass(frozen=True)
class SharedHandle:
    """One physical handle of a shared tensor: granules `[first_granule, +num_granules)`, the
    owner's `serial` for it, and either the owner's `pid` and `fd` or `fabric` bytes."""

    first_granule: int
    num_granules: int
    serial: int
    pid: int | None = None
    fd: int | None = None
    fabric: bytes | None = None


@dataclass(frozen=True)
class SharedTensor(_Carrier):
    """What another process needs to map a tensor's memory (from `ExtensibleTensor.share`).

    Picklable. `tensor_id` names the owner's tensor (random, never 0); `registry_fd` is the
    owner's fd of its export registry. `received_fds` is set only by `recv_shared`: fds this
    process holds (the registry's, then one per fd handle, in order), used and then closed by
    the next `from_shared` / `refresh`; it is never pickled."""

    device: str
    granularity: int
    segment_capacities: tuple[int, ...]
    segment_bytes: tuple[int, ...]
    owner_pid: int
    handles: tuple[SharedHandle, ...]
    tensor_id: int = 0
    registry_fd: int | None = None
    received_fds: tuple[int, ...] | None = field(default=None, compare=False, repr=False)

    @property
    def num_bytes(self) -> int:
        """The physical bytes the description maps."""
        return sum(h.num_granules for h in self.handles) * self.granularity

    @classmethod
    def _from_native(cls, raw: tuple[Any, ...]) -> SharedTensor:
        device, granularity, capacities, sizes, owner_pid, tensor_id, registry_fd, handles = raw
        return cls(
            device,
            granularity,
            tuple(capacities),
            tuple(sizes),
            owner_pid,
            tuple(SharedHandle(*h) for h in handles),
            tensor_id,
            registry_fd,
        )

    def _to_native(self) -> tuple[Any, ...]:
        """The tuple the native module takes; it checks every field's type and value."""
        handles: Any = self.handles
        if isinstance(handles, tuple | list):
            handles = [
                (h.first_granule, h.num_granules, h.serial, h.pid, h.fd, h.fabric)
                if isinstance(h, SharedHandle)
                else h  # the native check names what is wrong with it
                for h in handles
            ]
        return (
            self.device,
            self.granularity,
            self.segment_capacities,
            self.segment_bytes,
            self.owner_pid,
            self.tensor_id,
            self.registry_fd,
            handles,
        )


@dataclass(frozen=True)
class LoanHandle:
    """One lent handle: the lender's granules `[first_granule, +num_granules)`, its `serial`
    for the handle, and the number of the fd it keeps open for it."""

    first_granule: int
    num_granules: int
    serial: int
    fd: int


@dataclass(frozen=True)
class Loan(_Carrier):
    """Memory one tensor lends another (from `ExtensibleTensor.lend`): borrowed at most once.

    Picklable. `tensor_id` names the lender's tensor, `loan_id` and `epoch` (random) this
    loan, `board_fd` the lender's fd of its loan board, which the borrower checks every other
    field against. `received_fds` is set only by `recv_loan`: fds this process holds (the
    board's, then one per handle), used and then closed by the next `borrow`; never pickled."""

    device: str
    granularity: int
    owner_pid: int
    tensor_id: int
    loan_id: int
    epoch: int
    board_fd: int
    handles: tuple[LoanHandle, ...]
    received_fds: tuple[int, ...] | None = field(default=None, compare=False, repr=False)

    @property
    def num_bytes(self) -> int:
        """The physical bytes the loan moves."""
        return sum(h.num_granules for h in self.handles) * self.granularity

    @property
    def key(self) -> tuple[int, int, int]:
        """What names this loan wherever it travels: its lender's tensor, its id and epoch
        (a borrower's books key what it holds by it)."""
        return (self.tensor_id, self.loan_id, self.epoch)

    @classmethod
    def _from_native(cls, raw: tuple[Any, ...]) -> Loan:
        device, granularity, owner_pid, tensor_id, loan_id, epoch, board_fd, handles = raw
        return cls(
            device,
            granularity,
            owner_pid,
            tensor_id,
            loan_id,
            epoch,
            board_fd,
            tuple(LoanHandle(*h) for h in handles),
        )

    def _to_native(self) -> tuple[Any, ...]:
        """The tuple the native module takes; it checks every field's type and value."""
        handles: Any = self.handles
        if isinstance(handles, tuple | list):
            handles = [
                (h.first_granule, h.num_granules, h.serial, h.fd)
                if isinstance(h, LoanHandle)
                else h  # the native check names what is wrong with it
                for h in handles
            ]
        return (
            self.device,
            self.granularity,
            self.owner_pid,
            self.tensor_id,
            self.loan_id,
            self.epoch,
            self.board_fd,
            handles,
        )

    def to_json(self) -> dict[str, Any]:
        """The loan as a JSON object, versioned (`version`: `LOAN_FORMAT`): the one form it
        takes outside this process, in the pool's ledger and on a socket. Never its received
        fds (they are this process's)."""
        return {
            "version": LOAN_FORMAT,
            "device": self.device,
            "granularity": self.granularity,
            "owner_pid": self.owner_pid,
            "tensor_id": self.tensor_id,
            "loan_id": self.loan_id,
            "epoch": self.epoch,
            "board_fd": self.board_fd,
            "handles": [[h.first_granule, h.num_granules, h.serial, h.fd] for h in self.handles],
        }

    @classmethod
    def from_json(cls, raw: object) -> Loan:
        """The loan `raw` (a `to_json` object, maybe another process's) describes: every
        field's type and range checked, else a `ValueError` naming it. The values themselves
        are checked again by the borrow, against the lender's loan board, before anything is
        mapped."""
        if not isinstance(raw, dict):
            raise ValueError(f"a loan is a JSON object, not {type(raw).__name__}")
        if set(raw) != _LOAN_KEYS:
            missing, extra = sorted(_LOAN_KEYS - set(raw)), sorted(set(raw) - _LOAN_KEYS)
            raise ValueError(f"a loan has missing keys {missing} / unknown keys {extra}")
        if raw["version"] != LOAN_FORMAT or isinstance(raw["version"], bool):
            raise ValueError(
                f"a loan of format {str(raw['version'])[:16]!r}: this library reads {LOAN_FORMAT}"
            )
        device = raw["device"]
        if not isinstance(device, str) or not 0 < len(device) <= 32:
            raise ValueError("a loan's device is not a short string")
        numbers = [_loan_int(raw[key], key) for key in _LOAN_INTS]
        handles = raw["handles"]
        if not isinstance(handles, list):
            raise ValueError("a loan's handles are not a list")
        parsed = []
        for i, handle in enumerate(handles):
            if not isinstance(handle, list) or len(handle) != 4:
                raise ValueError(f"a loan's handles[{i}] is not 4 integers")
            parsed.append(LoanHandle(*(_loan_int(v, f"handles[{i}]") for v in handle)))
        granularity, owner_pid, tensor_id, loan_id, epoch, board_fd = numbers
        return cls(
            device, granularity, owner_pid, tensor_id, loan_id, epoch, board_fd, tuple(parsed)
        )


_LOAN_INTS = ("granularity", "owner_pid", "tensor_id", "loan_id", "epoch", "board_fd")
_LOAN_KEYS = {"version", "device", "handles", *_LOAN_INTS}


def _loan_int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"a loan's {where} is not an integer")
    if not 0 <= value < _MAX_LOAN_INT:
        raise ValueError(f"a loan's {where} is {value}, out of range")
    return value


def _to_wire(description: SharedTensor | Loan) -> bytes:
    """JSON, not pickle: the receiver must not run whatever a peer sends."""
    import json

    if isinstance(description, Loan):
        return json.dumps({"loan": description.to_json()}).encode()
    raw = list(description._to_native())
    raw[-1] = [[*h[:5], None if h[5] is None else bytes(h[5]).hex()] for h in raw[-1]]
    return json.dumps(raw).encode()


def _from_wire(payload: bytes) -> SharedTensor:
    import json

    try:
        raw = json.loads(payload)
        if isinstance(raw, dict):
            raise ValueError("it is a loan: receive it with recv_loan")
        *fields_, handles = raw
        handles = [(*h[:5], None if h[5] is None else bytes.fromhex(h[5])) for h in handles]
        return SharedTensor._from_native((*fields_, handles))
    except (ValueError, TypeError, IndexError) as error:
        raise ValueError(f"received a malformed shared description: {error}") from None


def _loan_from_wire(payload: bytes) -> Loan:
    import json

    try:
        raw = json.loads(payload)
        if not isinstance(raw, dict) or "loan" not in raw:
            raise ValueError("it is a shared description: receive it with recv_shared")
        return Loan.from_json(raw["loan"])
    except (ValueError, TypeError, IndexError) as error:
        raise ValueError(f"received a malformed loan: {error}") from None


def send_shared(sock: socket.socket, description: SharedTensor | Loan) -> None:
    """Sends `description` (or a `Loan`) and the owner's fds over the connected Unix socket
    `sock`, for a peer that may not take them by pid (`recv_shared`, or `recv_loan`, on the
    other end). Call it from the process that called `share()` (or `lend()`): it sends that
    process's fds, checked current first (a stale description or loan is a `ValueError`), with
    its credentials, which the kernel vouches for."""
    # Imported here: only the socket path needs them (`import extensible_kv` stays lean).
    import array
    import socket
    import struct

    if description.owner_pid != os.getpid():
        raise ValueError(
            f"send_shared must run in the owner process ({description.owner_pid}), not "
            f"{os.getpid()}: the fds it sends are the owner's"
        )
    from extensible_kv import _native

    # Checked current first: a stale description's fd numbers may name other memory by now.
    if isinstance(description, Loan):
        fds = _native._loan_owner_fds(description._to_native())
    else:
        fds = _native._owner_fds(description._to_native())
    credentials = struct.pack("3i", os.getpid(), os.getuid(), os.getgid())
    try:
        payload = _to_wire(description)
        sock.sendall(struct.pack("!Q", len(payload)) + payload)
        for start in range(0, len(fds), _MAX_FDS_PER_MESSAGE):
            chunk = array.array("i", fds[start : start + _MAX_FDS_PER_MESSAGE])
            ancillary = [
                (socket.SOL_SOCKET, socket.SCM_RIGHTS, chunk.tobytes()),
                (socket.SOL_SOCKET, socket.SCM_CREDENTIALS, credentials),
            ]
            sock.sendmsg([b"F"], ancillary)
    finally:
        for fd in fds:
            os.close(fd)


def recv_shared(sock: socket.socket) -> SharedTensor:
    """Receives a description sent by `send_shared`, carrying the received fds (given up to
    the next `ExtensibleTensor.from_shared` or `refresh` of it). The fds must come from the
    description's owner, as the kernel-checked credentials of their messages say: else a
    `ValueError`, and they are closed."""
    payload = _recv_payload(sock)
    description = _from_wire(payload)
    expected = sum(h.fd is not None for h in description.handles)
    if expected and description.registry_fd is not None:
        expected += 1  # the registry's fd comes first
    received = _recv_all_fds(sock, expected, description.owner_pid)
    object.__setattr__(description, "received_fds", tuple(received))
    return description


def recv_loan(sock: socket.socket) -> Loan:
    """Receives a loan sent by `send_shared`, carrying the received fds (its board's, then one
    per handle), given up to the next `ExtensibleTensor.borrow` of it. The fds must come from
    the lender, as the kernel-checked credentials of their messages say: else a `ValueError`,
    and they are closed."""
    loan = _loan_from_wire(_recv_payload(sock))
    received = _recv_all_fds(sock, 1 + len(loan.handles), loan.owner_pid)
    object.__setattr__(loan, "received_fds", tuple(received))
    return loan


def _recv_payload(sock: socket.socket) -> bytes:
    import socket
    import struct

    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    (length,) = struct.unpack("!Q", _recv_exactly(sock, 8))
    if length > _MAX_DESCRIPTION_BYTES:
        raise ValueError(f"a shared description of {length} bytes is too large")
    return _recv_exactly(sock, length)


def _recv_all_fds(sock: socket.socket, expected: int, owner_pid: int) -> list[int]:
    """`expected` fds, each message's checked to come from `owner_pid`; closed on error."""
    received: list[int] = []
    try:
        while len(received) < expected:
            want = min(_MAX_FDS_PER_MESSAGE, expected - len(received))
            fds, sender = _recv_fds(sock, want)
            received.extend(fds)
            if sender != owner_pid:
                raise ValueError(
                    f"the fds came from process {sender}, not from the description's owner "
                    f"({owner_pid})"
                )
    except BaseException:
        for fd in received:
            os.close(fd)
        raise
    return received


def _recv_fds(sock: socket.socket, max_fds: int) -> tuple[list[int], int | None]:
    """One message's fds and its sender's pid (`None` if it carried no credentials)."""
    import array
    import socket
    import struct

    space = socket.CMSG_SPACE(max_fds * 4) + socket.CMSG_SPACE(struct.calcsize("3i"))
    data, ancillary, _, _ = sock.recvmsg(1, space)
    fds: list[int] = []
    sender = None
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            chunk = array.array("i")
            chunk.frombytes(payload[: len(payload) - len(payload) % 4])
            fds.extend(chunk)
        elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            sender = struct.unpack("3i", payload[:12])[0]
    if not data or not fds:
        for fd in fds:
            os.close(fd)
        raise ConnectionError("the peer closed the socket before sending every fd")
    return fds, sender


def _recv_exactly(sock: socket.socket, num_bytes: int) -> bytes:
    chunks, left = [], num_bytes
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise ConnectionError("the peer closed the socket mid-description")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
