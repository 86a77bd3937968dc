"""Sharing a tensor's memory across processes (`share`, `from_shared`, `refresh`,
`send_shared` / `recv_shared`), every test on every backend (see conftest.py): on the host
backend memfds travel, on CUDA exported allocation handles; two processes on one GPU.

The child is a spawned process that takes commands over a pipe, so each step (import, write,
refresh, hold views while the owner closes, let go) is ordered against the parent's.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from extensible_kv import (
    DriverError,
    ExtensibleTensor,
    HandleSizing,
    OutOfMemoryError,
    SharedTensor,
    UnsupportedError,
    recv_shared,
    send_shared,
)
from support.child import Child
from support.memory import MakeTensor


def pattern(n: int, seed: int) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 13 + seed) % 251 + 1).to(torch.uint8)


def open_fds() -> set[str]:
    """This process's open fds that name shared memory: extensible-kv's memfds (host backend)
    and the NVIDIA driver's files (exported CUDA handles)."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "extensible-kv" in target or "nvidia" in target:
            names.add(f"{fd}:{target}")
    return names


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------
# the child process: a small command loop


def _child_main(conn: Any, device: str) -> None:
    """Commands: ("import", desc) -> segment sizes, the owner's pid and the device memory the
    import took (free memory before minus after, with this process's CUDA context already
    made, 0 on the host); ("write", seed) fills every committed prefix;
    ("read", segment, offset, n) -> bytes; ("refresh", desc); ("hold",) keeps segment views
    and drops the tensor object; ("check_held", seed, n) -> whether the held views still read
    the pattern (and take a write); ("release",) -> fds left open vs before the import."""
    t: ExtensibleTensor | None = None
    held: list[torch.Tensor] = []
    fds_before = open_fds()
    try:
        while True:
            command, *args = conn.recv()
            if command == "import":
                free_before = _device_free(device)
                fds_before = open_fds()  # the CUDA context's own device files are open now
                t = ExtensibleTensor.from_shared(args[0])
                taken = free_before - _device_free(device)
                conn.send(("ok", t.segment_bytes, t.imported_from, taken))
            elif command == "write":
                assert t is not None
                _write_every_segment(t, args[0])
                _sync(device)
                conn.send(("ok",))
            elif command == "read":
                assert t is not None
                conn.send(("ok", _read(t, *args)))
            elif command == "refresh":
                assert t is not None
                t.refresh(args[0])
                conn.send(("ok", t.segment_bytes, t.num_handles))
            elif command == "try":
                # ("try", "import" | "refresh", desc) -> the error's text, or None on success.
                try:
                    if args[0] == "import":
                        t = ExtensibleTensor.from_shared(args[1])
                    else:
                        assert t is not None
                        t.refresh(args[1])
                    conn.send(("ok", None))
                except Exception as error:
                    conn.send(("ok", f"{type(error).__name__}: {error}"))
            elif command == "denied":
                assert t is not None
                conn.send(("ok", _denied(t)))
            elif command == "hold":
                assert t is not None
                held = [t.segment_view(s) for s in range(t.num_segments)]
                t = None
                gc.collect()
                conn.send(("ok",))
            elif command == "check_held":
                good = _check_held(held, *args)
                _sync(device)
                conn.send(("ok", good))
            elif command == "release":
                held = []
                t = None
                gc.collect()
                _sync(device)
                conn.send(("ok", sorted(open_fds() - fds_before)))
                return
            elif command == "stop":
                conn.send(("ok",))
                return
    except BaseException as error:  # report, so the parent fails with the child's reason
        conn.send(("error", f"{type(error).__name__}: {error}"))


def _device_free(device: str) -> int:
    """Free device memory once this process's CUDA context exists (its own ~0.5 GiB is then
    already taken), 0 on the host."""
    if not device.startswith("cuda"):
        return 0
    torch.zeros(1, device=device)
    # The driver opens device files once per process for what a tensor first uses (a
    # blocking-sync event, the release thread's wait): before a test counts fds, not inside it.
    warm = ExtensibleTensor(4 << 20, device=device)
    warm.resize_(4 << 20)
    warm.release_physical()
    assert warm.wait_released(timeout=30)
    warm.close()
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _write_every_segment(t: ExtensibleTensor, seed: int) -> None:
    # A function, so that no view outlives the call (a view keeps the memory mapped).
    for s in range(t.num_segments):
        view = t.segment_view(s)
        view.copy_(pattern(view.numel(), seed + s).to(view.device))


def _read(t: ExtensibleTensor, segment: int, offset: int, n: int) -> bytes:
    return bytes(t.segment_view(segment)[offset : offset + n].cpu().numpy())


def _denied(t: ExtensibleTensor) -> list[tuple[str, bool]]:
    """What an importer may not do: each refused with UnsupportedError naming the owner."""
    refused = []
    calls = {
        "grow": lambda: t.resize_per_segment_(t.segment_capacity_bytes),
        "shrink": lambda: t.shrink_per_segment_(0),
        "release": t.release_physical,
        "consolidate": t.consolidate,
        "share": t.share,
    }
    for name, call in calls.items():
        try:
            call()
        except UnsupportedError as error:
            refused.append((name, "owns" in str(error)))
    return refused


def _check_held(held: list[torch.Tensor], seed: int, n: int) -> bool:
    good = all(torch.equal(v[:n].cpu(), pattern(n, seed + s)) for s, v in enumerate(held))
    for view in held:
        view[:1].fill_(0)  # still writable
    return good


@pytest.fixture
def child(device: str) -> Iterator[Child]:
    with Child(_child_main, device) as proc:
        yield proc


MakeOwner = Callable[..., ExtensibleTensor]


@pytest.fixture
def make_owner(make_tensor: MakeTensor) -> MakeOwner:
    """`make_owner(capacity, segments, **kw)`: an exportable tensor of `segments` segments of
    `capacity` bytes on the test's backend (closed at teardown, as `make_tensor`'s)."""

    def make(capacity: int, segments: int, **kw: Any) -> ExtensibleTensor:
        return make_tensor(capacity * segments, segments, export_handle_types="posix_fd", **kw)

    return make


# --------------------------------------------------------------------------------------------


def test_two_processes_share_grow_and_outlive_the_owner(
    device: str, g: int, child: Child, make_owner: MakeOwner
) -> None:
    _device_free(device)  # this process's CUDA context (its device files) exists first
    # Earlier tests' garbage goes first: a failed test's tensor, alive in its traceback, was
    # collected by this test's gc.collect(), and its memfd counted as one this test closed.
    gc.collect()
    fds_before = open_fds()
    owner = make_owner(8 * g, 3)
    owner.resize_per_segment_(2 * g + 100)
    description = owner.share()
    assert description.owner_pid == os.getpid()
    assert description.num_bytes == owner.physical_bytes

    sizes, pid, taken = child("import", description)
    assert (tuple(sizes), pid) == (owner.segment_bytes, os.getpid())
    # The child maps the owner's memory: a copy would take all of it, a mapping page tables.
    assert taken < owner.physical_bytes // 2, (taken, owner.physical_bytes)
    child("write", 11)
    for s in range(3):  # what the child wrote, the parent reads
        assert torch.equal(owner.segment_view(s).cpu(), pattern(2 * g + 100, 11 + s)), s

    owner.resize_per_segment_(6 * g)
    owner.segment_view(1)[4 * g : 4 * g + 64].copy_(pattern(64, 99).to(owner.device))
    _sync(device)
    sizes, num_handles = child("refresh", owner.share())
    assert tuple(sizes) == owner.segment_bytes and num_handles == owner.num_handles
    (got,) = child("read", 1, 4 * g, 64)
    assert got == bytes(pattern(64, 99).numpy())
    (zeros,) = child("read", 0, 3 * g, 64)
    assert zeros == bytes(64), "the bytes the owner grew read zero in the importer too"

    (refused,) = child("denied")
    assert [name for name, _ in refused] == ["grow", "shrink", "release", "consolidate", "share"]
    assert all(says_who for _, says_who in refused)

    # The owner shrinks and the importer follows; then the owner goes while the child holds
    # views: they stay valid (and writable) until the child lets go.
    owner.shrink_per_segment_(2 * g + 100, exact=True)
    child("refresh", owner.share())
    child("hold")
    owner.close()
    del owner
    gc.collect()
    (good,) = child("check_held", 11, 2 * g + 100)
    assert good
    (child_fds,) = child("release")
    assert child_fds == [], "the child kept fds open"
    assert open_fds() == fds_before, "the parent kept fds open"


def test_send_and_receive_over_a_unix_socket(device: str, g: int, make_owner: MakeOwner) -> None:
    owner = make_owner(4 * g, 2)
    owner.resize_per_segment_(3 * g)
    owner.full_view()[:16].copy_(pattern(16, 5).to(owner.device))
    _sync(device)
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        send_shared(left, owner.share())
        received = recv_shared(right)
    assert received == owner.share() and received.received_fds is not None
    fds = received.received_fds
    assert len(fds) == owner.num_handles + 1  # the registry first, then one per handle
    imported = ExtensibleTensor.from_shared(received)
    assert received.received_fds == ()  # handed over: the import closed them
    assert all(not os.path.exists(f"/proc/self/fd/{fd}") for fd in fds)
    assert torch.equal(imported.full_view()[:16].cpu(), pattern(16, 5))
    with pytest.raises(ValueError, match="owner process"):
        send_shared(left, SharedTensor("cpu", g, (g,), (0,), os.getpid() + 1, ()))
    imported.close()
    owner.close()


def test_a_description_survives_pickling_without_its_fds(g: int, make_owner: MakeOwner) -> None:
    import pickle

    owner = make_owner(4 * g, 1)
    owner.resize_(g)
    description = owner.share()
    assert pickle.loads(pickle.dumps(description)) == description
    owner.close()


def test_bad_descriptions_are_typed_errors_and_leak_nothing(
    g: int, make_tensor: MakeTensor, make_owner: MakeOwner
) -> None:
    owner = make_owner(4 * g, 2)
    owner.resize_per_segment_(2 * g)
    description = owner.share()
    fds_before = open_fds()
    first = description.handles[0]
    bad: list[tuple[SharedTensor, type[Exception], str]] = [
        (replace(description, segment_bytes=(3 * g, 2 * g)), ValueError, "no handle covers"),
        (replace(description, segment_bytes=(5 * g, 0)), ValueError, "exceeds the capacity"),
        (
            replace(description, handles=(replace(first, fd=4000), *description.handles[1:])),
            ValueError,
            "stale shared description: process .* no longer holds fd 4000",
        ),
        (
            replace(description, handles=(replace(first, pid=2**22 + 7), *description.handles[1:])),
            ValueError,
            r"handles\[0\]\.pid is 4194311, not the owner's",
        ),
        (replace(description, owner_pid=2**22 + 7), ValueError, r"handles\[0\]\.pid"),
        (
            replace(description, handles=description.handles[::-1]),
            ValueError,
            "sorted and disjoint",
        ),
        (replace(description, tensor_id=owner.tensor_id + 1), ValueError, "no longer holds tensor"),
    ]
    for wrong, error, match in bad:
        with pytest.raises(error, match=match):
            ExtensibleTensor.from_shared(wrong)
    assert open_fds() == fds_before
    with pytest.raises(UnsupportedError, match="refresh is for tensors imported"):
        owner.refresh(description)
    plain = make_tensor(4 * g)
    plain.resize_(g)
    with pytest.raises(UnsupportedError, match="not exportable"):
        plain.share()
    plain.close()
    owner.close()


def test_a_failed_import_maps_nothing_and_keeps_no_fd(
    device: str, g: int, make_owner: MakeOwner
) -> None:
    owner = make_owner(8 * g, 2, handle_sizing=HandleSizing(max_bytes=2 * g))
    owner.resize_per_segment_(7 * g)
    description = owner.share()
    assert len(description.handles) >= 4
    fds_before = open_fds()
    injected = 0
    for op in ("reserve", "import", "map", "set_access"):
        for nth in range(1, len(description.handles) + 1):
            for kind in ("driver", "oom"):
                try:
                    imported = ExtensibleTensor._import(
                        description._to_native(),
                        device,
                        granularity=description.granularity,
                        _fault=(op, nth, kind),
                    )
                except (DriverError, OutOfMemoryError):
                    injected += 1
                else:
                    imported.close()
                assert open_fds() == fds_before, (op, nth, kind)
    assert injected >= 10
    owner.close()


def test_close_closes_the_id_registry_too(g: int, make_owner: MakeOwner) -> None:
    """The export registry a `share` made (a memfd named after the tensor's id) goes with
    `close()`, not with the object: a closed tensor its caller still holds keeps no fd."""
    make_owner(g, 1).close()  # the backend's own fds (a CUDA context) are open from here on
    before = len(os.listdir("/proc/self/fd"))
    owner = make_owner(4 * g, 2)
    owner.resize_per_segment_(2 * g)
    registry = f"extensible-kv-ids:{owner.share().tensor_id:032x}"
    assert any(registry in name for name in open_fds())
    owner.close()
    assert not any(registry in name for name in open_fds())
    assert len(os.listdir("/proc/self/fd")) == before
    assert owner.closed  # still referenced here: only `close` let the fds go


# --------------------------------------------------------------------------------------------
# GPU only: importers that start from a raw pointer (LMCache, UCX cuda_ipc)


@pytest.mark.gpu
def test_a_handle_retained_from_a_view_exports_and_imports() -> None:
    from cuda.bindings import driver as cu

    device, g = "cuda:0", 2 << 20

    def ok(result: Any) -> Any:
        status, *values = result
        assert status == cu.CUresult.CUDA_SUCCESS, status
        return values[0] if len(values) == 1 else values

    owner = ExtensibleTensor(4 * g, 1, device=device, export_handle_types="posix_fd")
    owner.resize_(3 * g)
    view = owner.full_view()
    handle = ok(cu.cuMemRetainAllocationHandle(view.data_ptr() + g))
    fd = ok(
        cu.cuMemExportToShareableHandle(
            handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
        )
    )
    imported = ok(
        cu.cuMemImportFromShareableHandle(
            fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
    )
    os.close(fd)
    ok(cu.cuMemRelease(imported))
    ok(cu.cuMemRelease(handle))
    del view
    owner.close()


def test_a_stale_description_is_refused_and_never_reaches_other_memory(
    device: str, g: int, make_owner: MakeOwner, child: Child
) -> None:
    """The review's repro: A shares 2 handles, shrinks (its second handle and fd go), and the
    freed fd number comes to name B's memory of the same size (here by dup2, so it happens on
    every backend and run). The old description must be refused, B never read nor written."""
    a = make_owner(4 * g, 1, handle_sizing=HandleSizing(max_bytes=g))
    a.resize_(2 * g)
    a.full_view()[: 2 * g].copy_(pattern(2 * g, 1).to(a.device))
    old = a.share()
    assert len(old.handles) == 2
    freed = old.handles[1].fd
    assert freed is not None
    a.shrink_(g)
    assert a.wait_released(10)  # the handle and its exported fd are gone
    b = make_owner(4 * g, 1)
    b.resize_(g)
    b.full_view()[:g].copy_(pattern(g, 9).to(b.device))
    _sync(device)
    b_fd = b.share().handles[0].fd
    assert b_fd is not None
    os.dup2(b_fd, freed)  # the freed number now names B's memory, as the kernel would reuse it
    try:
        (error,) = child("try", "import", old)
        assert error is not None and "ValueError: stale shared description" in error, error
        assert f"no handle {old.handles[1].serial} over granules" in error
        (error,) = child("try", "import", a.share())  # the current one maps A's memory
        assert error is None
        assert child("read", 0, 0, 16)[0] == bytes(pattern(16, 1).numpy())
        child("write", 50)
        # Another tensor's description of the same geometry: refused, nothing mapped.
        (error,) = child("try", "refresh", b.share())
        assert error is not None and "description is of another tensor" in error, error
        assert child("read", 0, 0, 16)[0] == bytes(pattern(16, 50).numpy())
    finally:
        os.close(freed)
    assert torch.equal(b.full_view()[:g].cpu(), pattern(g, 9)), "B was written"
    assert torch.equal(a.full_view()[:16].cpu(), pattern(16, 50)), "the import writes A"
    child("release")


def test_fds_from_python_are_borrowed_never_adopted(g: int, make_owner: MakeOwner) -> None:
    """`_refresh(d, fds=[1])` once closed stdout: fds are checked, duplicated, and the
    caller's stay open whatever the outcome."""
    owner = make_owner(4 * g, 1)
    owner.resize_(g)
    description = owner.share()
    imported = ExtensibleTensor.from_shared(description)
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        for fds in ([1], [1, devnull], [devnull, 1], [2**20]):
            with pytest.raises(ValueError) as raised:
                imported._refresh(description._to_native(), fds)
            assert "fd" in str(raised.value)
        os.fstat(1)  # stdout is still open
        os.fstat(devnull)
        with pytest.raises(ValueError, match="not an open file descriptor"):
            imported._refresh(description._to_native(), [2**20, 2**20])
    finally:
        os.close(devnull)
    imported.close()


def test_received_fds_are_closed_when_a_description_is_refused(
    g: int, make_owner: MakeOwner
) -> None:
    owner = make_owner(4 * g, 2)
    owner.resize_per_segment_(2 * g)
    owner.share()  # the owner's exported fds live as long as its handles
    before = open_fds()
    for wrong in (
        {"segment_bytes": "lots"},
        {"handles": ((1, 2, 3),)},
        {"granularity": -1},
        {"tensor_id": 0},
    ):
        left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with left, right:
            send_shared(left, owner.share())
            received = recv_shared(right)
        assert received.received_fds
        with pytest.raises((TypeError, ValueError)):
            ExtensibleTensor.from_shared(replace(received, **wrong))
        assert open_fds() == before, wrong
    owner.close()


def test_send_shared_refuses_a_stale_description(g: int, make_owner: MakeOwner) -> None:
    owner = make_owner(4 * g, 1, handle_sizing=HandleSizing(max_bytes=g))
    owner.resize_(2 * g)
    old = owner.share()
    owner.shrink_(g)
    assert owner.wait_released(10)
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right, pytest.raises(ValueError, match="stale shared description"):
        send_shared(left, old)
    owner.close()


def test_recv_shared_refuses_fds_from_another_process_than_the_owner(
    g: int, make_owner: MakeOwner
) -> None:
    """A peer that forges a description naming another owner is caught by the kernel-checked
    credentials of the fds' message, and the fds are closed; nothing is unpickled."""
    import array
    import struct

    from extensible_kv.ipc import _to_wire

    owner = make_owner(4 * g, 1)
    owner.resize_(g)
    description = owner.share()
    payload = _to_wire(replace(description, owner_pid=os.getppid()))  # a forged owner
    before = open_fds()
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        left.sendall(struct.pack("!Q", len(payload)) + payload)
        fds = [description.registry_fd, description.handles[0].fd]
        creds = struct.pack("3i", os.getpid(), os.getuid(), os.getgid())
        left.sendmsg(
            [b"F"],
            [
                (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes()),
                (socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds),
            ],
        )
        with pytest.raises(ValueError, match=f"came from process {os.getpid()}, not"):
            recv_shared(right)
        left.sendall(struct.pack("!Q", 7) + b"\x80junk!!")  # a pickle opcode: never loaded
        with pytest.raises(ValueError, match="malformed shared description"):
            recv_shared(right)
    assert open_fds() == before
    owner.close()


@pytest.mark.parametrize(
    "types",
    [[np.int64(1)], (torch.tensor(1), "fabric"), np.int64(9)],
    ids=["numpy-in-a-list", "torch-in-a-tuple", "numpy"],
)
def test_export_handle_types_take_integers_as_the_core_does(types: object) -> None:
    """Entries of a list are ints as `operator.index` takes them, as a bare value is (a numpy
    int in a list was a TypeError)."""
    from extensible_kv.ipc import export_handle_types_bits

    assert export_handle_types_bits(types) in (1, 9)  # type: ignore[arg-type]
    with ExtensibleTensor(4096, device="cpu", export_handle_types=types) as t:  # type: ignore[arg-type]
        assert t.export_handle_types == 1  # the host backend has no fabric: fds only
    with pytest.raises(TypeError, match="export_handle_types entries"):
        ExtensibleTensor(4096, device="cpu", export_handle_types=[np.float32(1)])  # type: ignore[list-item]


# --------------------------------------------------------------------------------------------
# is a process alive: one parser, the core's (`ipc::process_start_time`), through `_native`

STAT_LINES = Path(__file__).parent / "support" / "proc_stat_lines.txt"


def _stat_cases() -> list[tuple[bytes, int | None]]:
    """The /proc/PID/stat lines src/ipc.rs's tests read too, with the start time each gives."""
    cases = []
    for line in STAT_LINES.read_bytes().split(b"\n"):
        if line and not line.startswith(b"#"):
            want, stat = line.split(b"\t", 1)
            cases.append((stat, None if want == b"-" else int(want)))
    return cases


@pytest.mark.parametrize(("line", "start"), _stat_cases())
def test_a_stat_line_is_read_by_the_one_parser(line: bytes, start: int | None) -> None:
    """State `Z` or `X` dead, every other alive; field 22 a u64 after the last `)`; a command
    name of any bytes (not UTF-8 either) read. The pool's `_proc` asks the same function."""
    from extensible_kv import _native
    from extensible_kv.pool import _proc

    assert _native.parse_start_time(line) == start
    assert _proc.parse_start_time(line) == start


def test_a_live_process_whose_name_is_not_utf8_is_alive() -> None:
    """A command name cut at 15 bytes inside a character: the core read the line as text and
    told such a process dead, so a lender's reclaim could take back memory it maps."""
    from extensible_kv import _native

    name = "a日本語の名前".encode()  # 19 bytes: the kernel keeps 15, mid-character
    code = (
        f"import sys; open('/proc/self/comm', 'wb').write({name!r}); "
        "print('ready', flush=True); sys.stdin.read()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as child:
        _check_alive(child, name)
    assert _native.process_start_time(child.pid) is None  # reaped: gone
    assert _native.process_start_time(-1) is None and _native.process_start_time(2**40) is None


def _check_alive(child: subprocess.Popen[bytes], name: bytes) -> None:
    from extensible_kv import _native
    from extensible_kv.pool import _proc

    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        with open(f"/proc/{child.pid}/stat", "rb") as stat:
            line = stat.read()
        assert name[:15] in line
        with pytest.raises(UnicodeDecodeError):
            line.decode()
        started = _native.process_start_time(child.pid)
        assert started is not None and started == _proc.start_time(child.pid)
        assert _proc.alive(child.pid, started)
    finally:
        assert child.stdin is not None
        child.stdin.close()  # its read ends: it exits, and leaving `with` reaps it
