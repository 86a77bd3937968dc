"""The pool on a node with other users (issue 51, items 6 and 7): the ledger's directory and
files, and the engines' fd sockets.

`/dev/shm` is writable by every user and an abstract socket has no permissions, so:

- every name the store opens, squatted by a FIFO, a symlink, a file of another user or a
  directory others may write to, is refused with a message naming the path, its owner and the
  fix, never a hang (each operation runs on a thread with a bound);
- another user's pool is a `PoolPermissionError` that says how to opt in, and a pool given a
  group is shared by the group's members (run as another uid: a subprocess that drops root's
  privileges once it has imported the library);
- a silent connection to a lender's socket, from a stranger or from an engine, costs its
  `serve()` no wait (timed against a baseline of the same serves, in the same test), and a
  borrower does not wait on a socket whose listener is not its lender.

The tests that act as another user need root (to become uid 65534), and are skipped otherwise.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import socket
import stat
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from extensible_kv.pool import Pool, PoolPermissionError, fds
from extensible_kv.pool import store as store_module
from support.pool_members import cache, member

NOBODY = 65534
ROOT = os.geteuid() == 0
as_root = pytest.mark.skipif(not ROOT, reason="acting as another user needs root")
BOUND_S = 20  # a refusal comes at once; a hang is anything past this


def bounded(call: Callable[[], Any]) -> Any:
    """`call()` on a thread: its result, or what it raised; fails the test if it hangs (a
    FIFO opened for writing blocks until a reader comes, for ever)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(("ok", call()))
        except BaseException as error:  # reported to the test's thread
            outcome.append(("raised", error))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive(), "the pool's store hangs"
    kind, value = outcome[0]
    if kind == "raised":
        raise value
    return value


@pytest.fixture
def shared_base() -> Iterator[Path]:
    """A base directory as /dev/shm is: world-writable and sticky."""
    base = Path(tempfile.mkdtemp(prefix="ekv-shared-", dir="/dev/shm"))
    base.chmod(0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def other_user(
    base: Path, code: str, groups: tuple[int, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """Runs `code` as uid `NOBODY` (with supplementary `groups`), `pool_dir` bound to `base`:
    the library is imported while still root (the interpreter's files are root's alone)."""
    prelude = (
        "import json, os, sys, traceback\n"
        "import extensible_kv.pool\n"
        "from extensible_kv.pool import Pool, PoolPermissionError, rules\n"
        f"os.setgroups(json.loads(sys.argv[1])); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
        "pool_dir = sys.argv[2]\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + code, json.dumps(list(groups)), str(base)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )


# ---------------------------------------------------------------------------------------------
# names squatted in the shared base: the pool's directory's own name


def test_the_pool_is_a_private_directory_of_its_own(shared_base: Path) -> None:
    pool = Pool("p", directory=shared_base)
    pool.set_cap("cpu", 1 << 20)
    st = os.lstat(pool.pool_directory)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.geteuid()
    assert sorted(os.listdir(pool.pool_directory)) == ["ledger", "lock"]
    for name in ("ledger", "lock"):
        mode = stat.S_IMODE(os.lstat(os.path.join(pool.pool_directory, name)).st_mode)
        assert mode & 0o077 == 0, (name, oct(mode))
    assert pool.path == os.path.join(pool.pool_directory, "ledger")
    pool.destroy()
    assert not os.path.exists(pool.pool_directory)


def squat_fifo(path: str) -> None:
    os.mkfifo(path, 0o666)


def squat_symlink(path: str) -> None:
    target = tempfile.mkdtemp(prefix="ekv-elsewhere-")
    os.symlink(target, path)


def squat_file(path: str) -> None:
    Path(path).write_bytes(b"")


def squat_open_directory(path: str) -> None:
    os.mkdir(path)
    os.chmod(path, 0o777)


@pytest.mark.parametrize(
    ("squat", "said"),
    [
        (squat_fifo, "is a FIFO"),
        (squat_symlink, "is a symbolic link"),
        (squat_file, "is a file"),
        (squat_open_directory, "is open to other users"),
    ],
)
def test_the_pools_name_squatted_is_a_clear_refusal_not_a_hang(
    shared_base: Path, squat: Callable[[str], None], said: str
) -> None:
    """Another user put something at the pool's name first (the one name in the shared
    directory that anyone can predict): every operation is refused at once, saying what is
    there, whose it is and what to do. Before, a FIFO at the ledger's name blocked the first
    engine that read it, and a FIFO at its temporary file's name the first that wrote, for ever
    and holding the pool's lock."""
    pool = Pool("p", directory=shared_base)
    here = pool.pool_directory
    for path in (here, here + ".lock", here + ".tmp"):  # the old names too
        if not os.path.lexists(path):
            squat(path)
    for operation in (pool.snapshot, lambda: pool.set_cap("cpu", 1), pool.reset):
        with pytest.raises(PoolPermissionError) as refused:
            bounded(operation)
        message = str(refused.value)
        assert pool.pool_directory in message and said in message, message
        assert "uid" in message and ("rm " in message or "chmod" in message), message


def test_a_base_writable_by_all_and_not_sticky_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "open"
    base.mkdir()
    base.chmod(0o777)
    with pytest.raises(PoolPermissionError, match="writable by every user and not sticky") as e:
        bounded(Pool("p", directory=base).snapshot)
    assert str(base) in str(e.value) and "chmod +t" in str(e.value)
    base.chmod(0o1777)  # sticky: no one else can rename the pool's directory away
    assert bounded(Pool("p", directory=base).snapshot).engines == {}


@as_root
def test_a_base_of_another_user_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "theirs"
    base.mkdir()
    os.chown(base, NOBODY, NOBODY)
    with pytest.raises(PoolPermissionError, match=f"belongs to .*uid {NOBODY}.*EXTENSIBLE_KV"):
        bounded(Pool("p", directory=base).snapshot)


# ---------------------------------------------------------------------------------------------
# names inside the pool's directory (only its owner, or its group, could put anything there)


@pytest.fixture
def pool(shared_base: Path) -> Pool:
    p = Pool("p", directory=shared_base)
    p.set_cap("cpu", 1 << 20)
    return p


def replace_with(path: str, squat: Callable[[str], None]) -> None:
    if os.path.lexists(path):
        os.unlink(path)
    squat(path)


def squat_file_of_another_user(path: str) -> None:
    Path(path).write_bytes(b"")
    os.chown(path, NOBODY, NOBODY)


def squat_symlink_to_a_file(path: str) -> None:
    os.symlink("/etc/hostname", path)


@pytest.mark.parametrize("name", ["ledger", "lock"])
@pytest.mark.parametrize(
    ("squat", "said"),
    [
        (squat_fifo, "is a FIFO"),
        (squat_symlink_to_a_file, "is a symbolic link"),
        pytest.param(squat_file_of_another_user, f"uid {NOBODY}", marks=as_root),
    ],
)
def test_a_file_of_the_pool_that_is_not_the_pools_is_refused(
    pool: Pool, name: str, squat: Callable[[str], None], said: str
) -> None:
    path = os.path.join(pool.pool_directory, name)
    replace_with(path, squat)
    with pytest.raises(PoolPermissionError) as refused:
        bounded(pool.snapshot)
    assert path in str(refused.value) and said in str(refused.value), refused.value
    if name == "ledger":  # `pool reset` removes whatever is at the ledger's name
        bounded(pool.reset)
        assert bounded(pool.snapshot).caps == {}


@pytest.mark.parametrize("squat", [squat_fifo, squat_symlink_to_a_file])
def test_a_temporary_files_name_taken_is_never_opened(
    pool: Pool, squat: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write creates its temporary file with O_EXCL under a random name: a name taken (here
    the name the write draws, squatted as it is drawn) is skipped, whatever is there, and the
    write lands on another."""
    names = iter(["squatted", "fresh"])
    taken = os.path.join(pool.pool_directory, store_module.TEMPORARY + "squatted")

    def token_hex(num_bytes: int) -> str:
        drawn = next(names)
        if drawn == "squatted":
            squat(taken)
        return drawn

    monkeypatch.setattr(store_module.secrets, "token_hex", token_hex)
    bounded(lambda: pool.set_cap("cpu", 2 << 20))
    monkeypatch.undo()
    assert bounded(pool.snapshot).caps == {"cpu": 2 << 20}
    assert os.path.lexists(taken)  # never followed or opened: the next writer removes it
    assert Path("/etc/hostname").exists()


def test_a_pool_directory_open_to_others_is_refused(pool: Pool) -> None:
    os.chmod(pool.pool_directory, 0o777)
    with pytest.raises(PoolPermissionError, match=r"open to other users.*chmod go-rwx"):
        bounded(pool.snapshot)


def test_a_ledger_writable_by_others_is_refused(pool: Pool) -> None:
    os.chmod(pool.path, 0o666)
    with pytest.raises(PoolPermissionError, match="open to other users"):
        bounded(pool.snapshot)


# ---------------------------------------------------------------------------------------------
# another user


@as_root
def test_another_users_pool_is_a_typed_error_that_says_how_to_opt_in(pool: Pool) -> None:
    """The pool is root's (mode 0700): uid 65534 gets a `PoolPermissionError` naming the owner
    and the opt-in, not a bare PermissionError."""
    done = other_user(
        Path(pool.directory),
        "try:\n"
        "    Pool('p', directory=pool_dir).snapshot()\n"
        "except PoolPermissionError as e:\n"
        "    print(type(e).__name__, e)\n",
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("PoolPermissionError"), out
    assert "belongs to user root (uid 0)" in out and "another user's" in out, out
    assert "group" in out and "EXTENSIBLE_KV_POOL_GROUP" in out, out


@as_root
def test_another_user_squatting_the_pools_name_is_a_clear_refusal(shared_base: Path) -> None:
    """uid 65534 makes the pool's directory first, its own (0700), and a FIFO at an old name:
    root's engines are refused at once, with the owner named."""
    done = other_user(
        shared_base,
        "os.mkdir(os.path.join(pool_dir, 'extensible_kv-pool-p'), 0o700)\n"
        "os.mkfifo(os.path.join(pool_dir, 'extensible_kv-pool-q'))\n",
    )
    assert done.returncode == 0, done.stderr
    with pytest.raises(PoolPermissionError, match=f"uid {NOBODY}.*another user's"):
        bounded(Pool("p", directory=shared_base).snapshot)
    with pytest.raises(PoolPermissionError, match=f"is a FIFO of .*uid {NOBODY}"):
        bounded(Pool("q", directory=shared_base).snapshot)


def a_group() -> int:
    try:
        return grp.getgrnam("users").gr_gid
    except KeyError:
        return 100


@as_root
def test_a_pool_with_a_group_is_shared_by_its_members(shared_base: Path) -> None:
    """Opt-in: root makes the pool with group `users`; uid 65534, a member, reads and changes
    it giving the same group; without the group, or not a member, it is refused, saying so."""
    gid = a_group()
    pool = Pool("g", directory=shared_base, group=gid)
    pool.set_cap("cpu", 1 << 20)
    st = os.lstat(pool.pool_directory)
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (gid, 0o2770)
    for name in ("ledger", "lock"):
        st = os.lstat(os.path.join(pool.pool_directory, name))
        assert st.st_gid == gid and st.st_mode & 0o040 and not st.st_mode & 0o002, name
    done = other_user(
        shared_base,
        f"pool = Pool('g', directory=pool_dir, group={gid})\n"
        "assert pool.snapshot().caps == {'cpu': 1 << 20}\n"
        "pool.set_cap('cuda:0', 3 << 20)\n"
        "try:\n"
        "    Pool('g', directory=pool_dir).snapshot()\n"
        "except PoolPermissionError as e:\n"
        "    print(e)\n",
        groups=(gid,),
    )
    assert done.returncode == 0, done.stderr
    assert "another user's" in done.stdout and "same group" in done.stdout, done.stdout
    assert pool.snapshot().caps == {"cpu": 1 << 20, "cuda:0": 3 << 20}
    for name in ("ledger", "lock"):  # what the other user wrote stays the group's
        assert os.lstat(os.path.join(pool.pool_directory, name)).st_gid == gid
    done = other_user(  # not a member of the group
        shared_base,
        "try:\n"
        f"    Pool('g', directory=pool_dir, group={gid})\n"
        "except PoolPermissionError as e:\n"
        "    print(e)\n",
    )
    assert "is not a member of group" in done.stdout, (done.stdout, done.stderr)
    # Root's own engines without the group are told to give it.
    with pytest.raises(PoolPermissionError, match=r"shared with group .*give group="):
        Pool("g", directory=shared_base).snapshot()


def test_the_group_comes_from_the_environment(
    shared_base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXTENSIBLE_KV_POOL_GROUP", str(os.getegid()))
    pool = Pool("e", directory=shared_base)
    assert pool.group == os.getegid()
    pool.snapshot()
    assert stat.S_IMODE(os.lstat(pool.pool_directory).st_mode) == 0o2770
    monkeypatch.setenv("EXTENSIBLE_KV_POOL_GROUP", "no-such-group-here")
    with pytest.raises(ValueError, match="no group named 'no-such-group-here'"):
        Pool("e", directory=shared_base)


# ---------------------------------------------------------------------------------------------
# the lender's socket


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def connect(name: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(name)
    return sock


def test_the_server_refuses_a_stranger_before_reading_and_keeps_a_slow_request() -> None:
    """`FdServer.requests` never waits: a peer not among `peers()` is closed as it is
    accepted; an allowed one that has sent half its request is kept for the next call, and
    answered once the rest comes; one that says nothing is dropped after `PENDING_AGE_S`, or
    as soon as it may no longer ask."""
    clock = FakeClock()
    name = b"\0ekv-test-fds-%d" % os.getpid()
    server = fds.FdServer(name, clock=clock)
    allowed = {os.getpid()}
    refused: list[int] = []
    try:
        stranger = connect(name)
        assert list(server.requests(lambda: set(), refused.append)) == []
        assert refused == [os.getpid()] and stranger.recv(1) == b""  # closed, unread
        slow, silent = connect(name), connect(name)
        slow.sendall(struct.pack("!Q", 42)[:3])
        assert list(server.requests(lambda: allowed)) == []
        slow.sendall(struct.pack("!Q", 42)[3:])
        ((conn, pid, loan_id),) = list(server.requests(lambda: allowed))
        assert (pid, loan_id) == (os.getpid(), 42)
        conn.close()
        clock.now += fds.PENDING_AGE_S + 0.1
        assert list(server.requests(lambda: allowed)) == []
        assert silent.recv(1) == b""  # dropped: too old
        quiet = connect(name)
        assert list(server.requests(lambda: allowed)) == []
        assert list(server.requests(lambda: set())) == []
        assert quiet.recv(1) == b""  # dropped: may no longer ask
        many = [connect(name) for _ in range(fds.PENDING_MAX + 3)]
        assert list(server.requests(lambda: allowed)) == []
        assert len(server._pending) == fds.PENDING_MAX
        for sock in (stranger, slow, silent, quiet, *many):
            sock.close()
    finally:
        server.close()


SILENT = """
import socket, sys, time
socks = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(bytes.fromhex(sys.argv[1]))
    socks.append(s)
print("connected", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("peer", ["a stranger", "the borrower"])
def test_silent_connections_cost_a_lenders_serve_no_wait(tmp_path: Path, peer: str) -> None:
    """A lender with a loan on offer serves with 8 silent connections made to its socket
    before each serve, from a process that is no engine (a stranger: closed as accepted) or
    from the borrower's own process (kept, unread, for a later serve): each serve takes about
    what it takes with none. Before, each such connection cost 20 ms of waiting (8 of them,
    ~165 ms a serve). Timed against the same serves without them, in this test."""
    pool = Pool("test", directory=tmp_path)
    pool.set_cap("cpu", 48 * 2 * 4096)
    used = {"a": 0, "b": 0}
    with cache() as ca, cache() as cb:
        a, b = member(pool, "a", ca, used), member(pool, "b", cb, used)
        a.join()
        b.join()
        assert a.grow(32) == 32
        used["a"] = 10
        assert ("ask", "a") in [(d.action, d.peer) for d in b.request(40)]
        a.serve()
        (offer,) = pool.snapshot().loans.values()
        assert offer.state == "offered"
        with pool.transaction() as ledger:
            lender = ledger.engines["a"]
        name = fds.address(pool.path, "a", lender.pid, lender.start_time)

        def silent_connections() -> Any:
            if peer == "the borrower":
                return [connect(name) for _ in range(8)]
            process = subprocess.Popen(
                [sys.executable, "-c", SILENT, name.hex(), "8"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert process.stdout is not None and process.stdout.readline() == "connected\n"
            return process

        def timed_serve(with_silent: bool) -> float:
            held = silent_connections() if with_silent else None
            started = time.perf_counter()
            a.serve()
            took = time.perf_counter() - started
            if isinstance(held, list):
                for sock in held:
                    sock.close()
            elif held is not None:
                held.communicate("\n", timeout=30)
            return took

        base = statistics.median(timed_serve(False) for _ in range(7))
        silent = statistics.median(timed_serve(True) for _ in range(7))
        # A quiet serve without them reads the ledger only (~0.1 ms); with them it asks the
        # ledger who may connect (a transaction, ~1 ms): well under the 20 ms of one wait.
        assert silent < base + 0.01, f"a serve took {silent * 1e3:.1f} ms, {base * 1e3:.1f} without"
        assert pool.snapshot().loans[offer.loan_id].state == "offered"  # still served, on offer
        b.serve()  # and borrowed as ever
        assert pool.snapshot().loans[offer.loan_id].state == "borrowed"
        assert [d.action for d in a.request(8)] == ["recall"]
        b.serve()
        a.serve()
        b.leave()
        a.leave()


def test_a_borrower_never_waits_on_a_socket_its_lender_does_not_hold() -> None:
    """The lender's socket name can be computed by anyone who knows its pid: a process that
    binds it first is found out as the borrower connects (`SO_PEERCRED`), before any wait."""
    name = b"\0ekv-test-squatted-%d" % os.getpid()
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(name)
    squatter.listen(1)
    try:
        started = time.monotonic()
        with pytest.raises(ConnectionError, match=r"held by process .* not the lender"):
            fds.fetch(name, 1, 1, timeout_s=60.0, lender_pid=os.getpid() + 1)
        assert time.monotonic() - started < 30  # not the 60 s of the timeout
    finally:
        squatter.close()
