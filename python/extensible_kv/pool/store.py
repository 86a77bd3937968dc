"""Where the ledger lives, and how it changes: a file in shared memory, under a lock that a dead
holder cannot keep, replaced whole on every change.

- **The file** is `<directory>/extensible_kv-pool-<name>`; the directory is
  `$EXTENSIBLE_KV_POOL_DIR`, else `/dev/shm`, else `$XDG_RUNTIME_DIR`, else the temporary
  directory. Both are memory: the ledger does not outlive a reboot, and nothing in it should.
- **The lock** is an exclusive `flock` on a separate file, `<file>.lock`. The kernel drops a
  flock when its holder's last descriptor closes, so a `kill -9` can never leave it held. It
  is taken with a timeout (`PoolLockTimeout`), never waited on for ever. It is a lock file of
  its own because the ledger file is replaced by a rename, and a lock on the old inode would
  not exclude a process that opened the new one.
- **A write** goes to `<file>.tmp` and is renamed over the file: a holder killed mid-write
  leaves the old ledger whole (and a stray temporary file, overwritten by the next writer).
- **Every transaction** reads and checks the ledger (`ledger.decode`), runs the recovery step
  (`rules.reap`: dead engines leave, their loans follow the rules, late requests expire), lets
  the caller change it, and writes it back if anything changed, with the generation bumped.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

from extensible_kv.pool import _proc, rules
from extensible_kv.pool.ledger import (
    ENGINE_NAME,
    MAX_LEDGER_BYTES,
    Ledger,
    LedgerCorruptError,
    decode,
    encode,
)

__all__ = ["Pool", "PoolLockTimeout", "default_directory"]

PREFIX = "extensible_kv-pool-"


class PoolLockTimeout(TimeoutError):
    """The pool's lock was held by another live process for longer than the timeout."""


def default_directory() -> str:
    configured = os.environ.get("EXTENSIBLE_KV_POOL_DIR")
    if configured:
        return configured
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return runtime
    return tempfile.gettempdir()


class Pool:
    """A node-local pool's ledger, by `name` (1 to 64 letters, digits, `.`, `_`, `-`).

    `transaction()` is the one way to read or change it. `clock` and `alive` (whether a pid
    with a start time is still that process) are the defaults' (`time.monotonic`, `/proc`)
    except in tests."""

    def __init__(
        self,
        name: str = "default",
        *,
        directory: str | os.PathLike[str] | None = None,
        lock_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        alive: Callable[[int, int], bool] = _proc.alive,
    ) -> None:
        if not isinstance(name, str) or not ENGINE_NAME.match(name):
            raise ValueError(
                f"pool name {name!r}: 1 to 64 letters, digits, '.', '_' or '-', starting with "
                "a letter or digit"
            )
        if not lock_timeout_s > 0:
            raise ValueError(f"lock_timeout_s must be positive, got {lock_timeout_s}")
        self.name = name
        self.directory = os.fspath(directory) if directory is not None else default_directory()
        self.path = os.path.join(self.directory, PREFIX + name)
        self.lock_timeout_s = lock_timeout_s
        self.clock = clock
        self.alive = alive
        self._thread_lock = threading.Lock()  # a flock is per open file, not per thread

    def __repr__(self) -> str:
        return f"Pool({self.name!r}, directory={self.directory!r})"

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Ledger]:
        """The ledger, locked, recovered (`rules.reap`) and checked; what the body changes is
        written back atomically when it leaves without an exception (an exception writes
        nothing of the body's changes, but the recovery's are kept)."""
        with self._locked():
            raw = self._read()
            ledger = decode(raw, self.path) if raw else Ledger()
            rules.reap(ledger, self.clock(), self.alive)
            recovered = encode(ledger)
            try:
                yield ledger
            except BaseException:
                if recovered != raw:
                    self._write(decode(recovered, self.path))
                raise
            if encode(ledger) != raw:
                self._write(ledger)

    def snapshot(self) -> Ledger:
        """The ledger now (recovered first, as every transaction)."""
        with self.transaction() as ledger:
            return ledger

    def set_limits(self, engine: str, *, min_blocks: int | None, max_blocks: int | None) -> None:
        """Changes engine `engine`'s limits while it runs; its member acts on them at its next
        `serve` (giving back what lies past a lowered maximum, once free)."""
        with self.transaction() as ledger:
            rules.set_limits(ledger, engine, self.clock(), min_blocks, max_blocks)

    def set_share(self, device: str, num_bytes: int | None) -> None:
        """Caps the bytes the pool's engines may hold on `device` in all (None: no cap)."""
        if num_bytes is not None and (isinstance(num_bytes, bool) or num_bytes < 0):
            raise ValueError(f"a share is a number of bytes >= 0, got {num_bytes!r}")
        with self.transaction() as ledger:
            rules.set_share(ledger, device, num_bytes, self.clock())

    def reset(self) -> None:
        """Removes the ledger (a corrupt one too): the next transaction starts an empty one.
        Engines still running keep their memory but are no longer in the pool."""
        with self._locked(), contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def destroy(self) -> None:
        """Removes the ledger and its lock file."""
        self.reset()
        for path in (self.path + ".lock", self.path + ".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        deadline = time.monotonic() + self.lock_timeout_s
        if not self._thread_lock.acquire(timeout=self.lock_timeout_s):
            raise PoolLockTimeout(f"another thread held {self.path}'s lock too long")
        try:
            # Opened per transaction: a descriptor inherited across fork would share the lock.
            fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                self._flock(fd, deadline)
                yield
            finally:
                os.close(fd)  # drops the lock
        finally:
            self._thread_lock.release()

    def _flock(self, fd: int, deadline: float) -> None:
        delay = 0.0002
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as error:
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            if time.monotonic() >= deadline:
                raise PoolLockTimeout(
                    f"{self.path}'s lock was held for more than {self.lock_timeout_s} s by a "
                    "live process (a dead one cannot hold it)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def _read(self) -> bytes:
        try:
            with open(self.path, "rb") as file:
                data = file.read(MAX_LEDGER_BYTES + 1)
        except FileNotFoundError:
            return b""
        if not data:
            raise LedgerCorruptError(f"{self.path} is empty")
        return data

    def _write(self, ledger: Ledger) -> None:
        ledger.generation += 1
        data = encode(ledger)
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
