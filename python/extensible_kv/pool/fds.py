"""A loan's fds over a Unix socket, for a borrower that may not take them by pid.

A borrow takes the lender's fds with `pidfd_getfd`, which needs ptrace access to the lender:
the same user, and Yama's `ptrace_scope` allowing it (Ubuntu's default, 1, allows only a
process's descendants) or `CAP_SYS_PTRACE`. Where that is refused, the borrower asks the
lender on the lender's socket; the lender, at its next `serve`, sends the loan's fds
(`extensible_kv.ipc.send_shared`) once it has checked that the asking process is the
loan's borrower (its pid, as the kernel vouches for it, against the ledger's) and that the
loan is still on offer. The borrower checks that the fds come from the lender (the kernel's
credentials on each message) and that the loans received are the ledger's; the borrow then
checks that every fd names the memory its handle says.

The socket is in the abstract namespace, so a `kill -9` leaves no file behind, and its name
hashes the pool's directory, the engine and the process (pid and start time), so that a later
process given the same pid, or an engine of another pool, is never asked.

Every local process, of any user, can connect to it (an abstract socket has no permissions,
and its name is listed in `/proc/net/unix`), so the lender never waits on a connection: it
identifies the peer first (`SO_PEERCRED`, which the kernel vouches for) and closes it at once
unless it is the borrower of a loan the lender has on offer; it reads a request without
blocking, and one that has not come whole waits for a later `serve` (a few, for a short
while). Likewise the borrower checks that the process listening under the lender's name is
the lender before it waits for an answer: another process could have taken the name first.
"""

from __future__ import annotations

import hashlib
import socket
import struct
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

from extensible_kv.ipc import Loan, recv_loan

# How many requests one `serve` answers at most, how many connections that have not sent their
# request whole (8 bytes) wait for a later `serve`, and for how long: a borrower sends its
# request as it connects, so only a stranger's connection is ever incomplete, and it costs the
# lender's loop no wait, only one of these places for a while.
REQUESTS_PER_SERVE = 8
PENDING_MAX = 8
PENDING_AGE_S = 1.0
# The most connections one `serve` accepts (those refused are closed at once).
ACCEPTS_PER_SERVE = 32
# How long the lender may take to send an answer (its loans' fds: a few small messages, which
# fit the socket's buffer at once).
ANSWER_TIMEOUT_S = 0.5

_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def address(pool_path: str, engine: str, pid: int, start_time: int) -> bytes:
    """The abstract socket address of engine `engine` of the pool at `pool_path`, run by
    process `pid` started at `start_time` (`/proc/PID/stat`'s ticks)."""
    key = f"{pool_path}\0{engine}\0{pid}\0{start_time}".encode()
    return b"\0extensible-kv-pool:" + hashlib.sha256(key).hexdigest()[:40].encode()


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of the connected Unix socket `sock`, as the
    kernel recorded it when the connection was made."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    pid: int = _CREDENTIALS.unpack(creds)[0]
    return pid


@dataclass
class _Pending:
    conn: socket.socket
    pid: int
    since: float
    data: bytes = field(default=b"")


class FdServer:
    """The lender's side: a listening socket its `serve` polls, never waiting on it."""

    def __init__(self, name: bytes, clock: Callable[[], float] = time.monotonic) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(name)
            sock.listen(16)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.clock = clock
        self._pending: list[_Pending] = []

    def requests(
        self,
        peers: Callable[[], Collection[int]],
        refused: Callable[[int], None] = lambda pid: None,
    ) -> Iterator[tuple[socket.socket, int, int]]:
        """Every request whole now: `(connection, the asking process's pid, loan id)`; the
        caller answers on the connection and closes it. Never waits. `peers()` (asked once,
        and only if a connection is there) are the pids that may ask: any other peer's
        connection is closed at once, and `refused(pid)` called. A request not whole yet waits
        for a later call, up to `PENDING_AGE_S` (at most `PENDING_MAX` of them); past
        `REQUESTS_PER_SERVE` answers, the rest wait for the next call."""
        allowed: Collection[int] | None = None

        def may_ask(pid: int) -> bool:
            nonlocal allowed
            if allowed is None:
                allowed = peers()
            return pid in allowed

        self._accept(may_ask, refused)
        now = self.clock()
        answered = 0
        for pending in list(self._pending):
            if answered >= REQUESTS_PER_SERVE:
                return
            loan_id = self._read(pending, now, may_ask)
            if loan_id is None:
                continue
            self._pending.remove(pending)
            pending.conn.settimeout(ANSWER_TIMEOUT_S)
            answered += 1
            yield pending.conn, pending.pid, loan_id

    def _accept(self, may_ask: Callable[[int], bool], refused: Callable[[int], None]) -> None:
        for _ in range(ACCEPTS_PER_SERVE):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            try:
                conn.setblocking(False)
                pid = peer_pid(conn)
            except OSError:  # gone meanwhile
                conn.close()
                continue
            try:
                allowed = may_ask(pid)
            except BaseException:  # the ledger out of reach: asked again at the next call
                conn.close()
                raise
            if not allowed:
                conn.close()
                refused(pid)
                continue
            if len(self._pending) >= PENDING_MAX:  # the oldest goes: it had the most time
                self._drop(self._pending[0])
            self._pending.append(_Pending(conn, pid, self.clock()))

    def _read(self, pending: _Pending, now: float, may_ask: Callable[[int], bool]) -> int | None:
        """Request `pending`'s loan id once its 8 bytes are in; None while they are not (the
        connection dropped if its peer closed it, took too long or may no longer ask)."""
        try:
            chunk = pending.conn.recv(8 - len(pending.data))
        except (BlockingIOError, InterruptedError):
            chunk = None
        except OSError:
            self._drop(pending)
            return None
        if chunk == b"" or not may_ask(pending.pid):
            self._drop(pending)
            return None
        if chunk:
            pending.data += chunk
        if len(pending.data) == 8:
            (loan_id,) = struct.unpack("!Q", pending.data)
            return int(loan_id)
        if now - pending.since > PENDING_AGE_S:
            self._drop(pending)
        return None

    def _drop(self, pending: _Pending) -> None:
        pending.conn.close()
        self._pending.remove(pending)

    def close(self) -> None:
        for pending in list(self._pending):
            self._drop(pending)
        self.sock.close()


def fetch(
    name: bytes, loan_id: int, count: int, timeout_s: float, *, lender_pid: int | None = None
) -> list[Loan]:
    """Asks the lender listening at `name` for loan `loan_id`'s `count` loans (one per
    buffer), each carrying its received fds; waits up to `timeout_s` for each step (the lender
    answers at its next `serve`). With `lender_pid`, a listener that is another process (one
    that took the name first) is a `ConnectionError` before any wait. On any failure the fds
    received so far are closed."""
    loans: list[Loan] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(name)
            listener = peer_pid(sock)
            if lender_pid is not None and listener != lender_pid:
                raise ConnectionError(
                    f"the lender's socket is held by process {listener}, not the lender "
                    f"(process {lender_pid})"
                )
            sock.sendall(struct.pack("!Q", loan_id))
            for _ in range(count):
                loans.append(recv_loan(sock))
        except BaseException:
            close_received(loans)
            raise
    return loans


def close_received(loans: list[Loan]) -> None:
    """Closes the fds `loans` still carry (those a borrow did not take)."""
    for loan in loans:
        loan.close_received_fds()
