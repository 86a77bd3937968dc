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
hashes the pool's file, the engine and the process (pid and start time), so that a later
process given the same pid, or an engine of another pool, is never asked.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
from collections.abc import Iterator

from extensible_kv.ipc import Loan, _recv_exactly, recv_loan

# How long the lender waits for a request's 8 bytes once it accepted the connection (a
# borrower sends them right after connecting, before the lender accepts), and how many
# requests one `serve` answers: a local process that connects and sends nothing, again and
# again, delays the lender's loop by at most their product.
REQUEST_TIMEOUT_S = 0.02
REQUESTS_PER_SERVE = 8


def address(pool_path: str, engine: str, pid: int, start_time: int) -> bytes:
    """The abstract socket address of engine `engine` of the pool at `pool_path`, run by
    process `pid` started at `start_time` (`/proc/PID/stat`'s ticks)."""
    key = f"{pool_path}\0{engine}\0{pid}\0{start_time}".encode()
    return b"\0extensible-kv-pool:" + hashlib.sha256(key).hexdigest()[:40].encode()


class FdServer:
    """The lender's side: a listening socket its `serve` polls, never blocking on it."""

    def __init__(self, name: bytes) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(name)
            sock.listen(16)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def requests(self) -> Iterator[tuple[socket.socket, int, int]]:
        """Every request waiting now: `(connection, the asking process's pid, loan id)`. The
        caller answers on the connection and closes it; a request that does not come whole
        within `REQUEST_TIMEOUT_S` is dropped; past `REQUESTS_PER_SERVE`, the rest wait for
        the next call."""
        for _ in range(REQUESTS_PER_SERVE):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            try:
                conn.settimeout(REQUEST_TIMEOUT_S)
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                pid = struct.unpack("3i", creds)[0]
                (loan_id,) = struct.unpack("!Q", _recv_exactly(conn, 8))
            except (OSError, ConnectionError, struct.error):
                conn.close()
                continue
            yield conn, pid, loan_id

    def close(self) -> None:
        self.sock.close()


def fetch(name: bytes, loan_id: int, count: int, timeout_s: float) -> list[Loan]:
    """Asks the lender listening at `name` for loan `loan_id`'s `count` loans (one per
    buffer), each carrying its received fds; waits up to `timeout_s` for each step (the
    lender answers at its next `serve`). On any failure the fds received so far are closed."""
    loans: list[Loan] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(name)
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
        for fd in loan._take_fds() or ():
            os.close(fd)
