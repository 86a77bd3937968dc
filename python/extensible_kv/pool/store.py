"""Where the ledger lives, and how it changes: files in shared memory, in a directory of the
pool's own, under a lock that a dead holder cannot keep, the ledger replaced whole on every
change.

- **The directory** is `<base>/extensible_kv-pool-<name>` (`Pool.pool_directory`); the base is
  `$EXTENSIBLE_KV_POOL_DIR`, else `/dev/shm`, else `$XDG_RUNTIME_DIR`, else the temporary
  directory. Both are memory: the ledger does not outlive a reboot, and nothing in it should.
  The pool's directory holds the ledger (`ledger`, `Pool.path`), its lock (`lock`) and the
  temporary files of writes. It is created mode 0700: another user can neither read nor plant
  anything in it.
- **Other users.** The base is shared (`/dev/shm` is writable by every user), so a name in it
  can be squatted: the pool's directory's own name is the one predictable name, and finding it
  taken by a file, a FIFO, a symlink or another user's directory is a `PoolPermissionError`
  that names the path, its owner and the fix, never a hang. Every open uses `O_NOFOLLOW` and
  `O_NONBLOCK` (a FIFO in a file's place must not block the opener, who holds the lock),
  temporary files are created with `O_EXCL` under random names, and each opened file is
  checked with `fstat`: a regular file (a directory), owned by this user (the pool's group's,
  when shared), writable by no other. A base writable by others must be sticky (as `/dev/shm`
  and `/tmp` are), so that no one else can rename the pool's directory away.
- **A pool of several users is opt-in**: `Pool(name, group="kv")` (or
  `$EXTENSIBLE_KV_POOL_GROUP`, or the command line's `--group`) makes the directory the
  group's, mode 2770 (what is created in it is the group's), and its files readable by the
  group. Every engine of such a pool gives the same group and is a member of it. Without one,
  a pool whose directory is another user's is a `PoolPermissionError` that says whose it is
  and how to opt in.
- **The lock** is an exclusive `flock` on `lock`. The kernel drops a flock when its holder's
  last descriptor closes, so a `kill -9` can never leave it held. It is taken with a timeout
  (`PoolLockTimeout`), never waited on for ever, and a Ctrl-C ends the wait. It is a file of
  its own because the ledger file is replaced by a rename, and a lock on the old inode would
  not exclude a process that opened the new one.
- **A write** goes to a new temporary file renamed over `ledger`: a holder killed mid-write
  leaves the old ledger whole (and its temporary file, which the next writer removes: under
  the lock, any temporary file is a dead writer's). Before it writes, the writer decodes what
  it is about to write with the readers' own checks (`ledger.refusal`), and refuses a ledger
  they would refuse (a `ValueError`): one bad value would otherwise stop every engine of the
  pool until `pool reset`.
- **Every transaction** reads and checks the ledger (`ledger.decode`), runs the recovery step
  (`rules.reap`: dead engines leave, their loans follow the rules, late requests expire; then
  the caller's own `repair`, a member's reconciliation of what it moved), lets the caller
  change it, and writes it back if anything changed, with the generation bumped.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import os
import pwd
import secrets
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator

from extensible_kv import _args
from extensible_kv.pool import _proc, rules
from extensible_kv.pool.ledger import (
    MAX_LEDGER_BYTES,
    Ledger,
    LedgerCorruptError,
    check_name,
    decode,
    encode,
    refusal,
)

__all__ = ["GROUP_ENV", "Pool", "PoolLockTimeout", "PoolPermissionError", "default_directory"]

PREFIX = "extensible_kv-pool-"
LEDGER = "ledger"
LOCK = "lock"
TEMPORARY = "ledger.tmp-"  # and a random suffix: a write's new ledger before its rename
GROUP_ENV = "EXTENSIBLE_KV_POOL_GROUP"

_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class PoolLockTimeout(TimeoutError):
    """The pool's lock was held by another live process for longer than the timeout."""


class PoolPermissionError(PermissionError):
    """The pool's files may not be used as they are: another user's pool (a pool of several
    users is opt-in, with a group), or a path that is not what this library creates (a
    symlink, a FIFO, a file of another owner, a directory others may write to). The message
    names the path, its owner and the fix."""


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


def _write_all(fd: int, data: bytes) -> None:
    """Writes `data` to `fd` (a function of its own: the tests fail it, as a full /dev/shm)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Pool:
    """A node-local pool's ledger (`path`), by `name` (1 to 64 letters, digits, `.`, `_`,
    `-`), in the pool's own directory (`pool_directory`) under `directory` (see the module's
    docstring for the default).

    `group` (a group name or id; default `$EXTENSIBLE_KV_POOL_GROUP`, else none) shares the
    pool with the other members of that group: its directory and files become the group's,
    and every engine of it must give the same group. Without one the pool is this user's
    alone, and another user's is refused (`PoolPermissionError`).

    `transaction()` is the one way to read or change it. `clock` and `alive` (whether a pid
    with a start time is still that process) are the defaults' (`time.monotonic`, `/proc`)
    except in tests."""

    def __init__(
        self,
        name: str = "default",
        *,
        directory: str | os.PathLike[str] | None = None,
        group: str | int | None = None,
        lock_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        alive: Callable[[int, int], bool] = _proc.alive,
    ) -> None:
        self.name = check_name(name, "pool name")
        if directory is not None and not isinstance(directory, str | os.PathLike):
            raise TypeError(f"directory must be a path, not {type(directory).__name__}")
        self.directory = os.fspath(directory) if directory is not None else default_directory()
        self.pool_directory = os.path.join(self.directory, PREFIX + name)
        self.path = os.path.join(self.pool_directory, LEDGER)  # the ledger
        self.lock_timeout_s = _args.duration(lock_timeout_s, "lock_timeout_s")
        if group is None:
            group = os.environ.get(GROUP_ENV) or None
        self.group = _group_id(group)
        self.clock = clock
        self.alive = alive
        self._thread_lock = threading.Lock()  # a flock is per open file, not per thread

    def __repr__(self) -> str:
        shared = "" if self.group is None else f", group={_group_name(self.group)!r}"
        return f"Pool({self.name!r}, directory={self.directory!r}{shared})"

    @property
    def lock_path(self) -> str:
        return os.path.join(self.pool_directory, LOCK)

    @contextlib.contextmanager
    def transaction(
        self,
        repair: Callable[[Ledger], None] | None = None,
        seen: Callable[[bytes], None] | None = None,
    ) -> Iterator[Ledger]:
        """The ledger, locked, recovered (`rules.reap`, then `repair(ledger)` if given) and
        checked; what the body changes is written back atomically when it leaves without an
        exception (an exception writes nothing of the body's changes, but the recovery's are
        kept). `seen`, if given, is told the file's bytes as the transaction leaves them (what
        `peek` reads until another transaction writes)."""
        with self._locked() as directory:
            raw = self._read(directory)
            ledger = decode(raw, self.path) if raw else Ledger()
            rules.reap(ledger, self.clock(), self.alive)
            if repair is not None:
                repair(ledger)
            recovered = encode(ledger)
            try:
                yield ledger
            except BaseException:
                if recovered != raw:
                    self._write(directory, decode(recovered, self.path))
                raise
            if encode(ledger) != raw:
                raw = self._write(directory, ledger)
        if seen is not None:
            seen(raw)

    def peek(self) -> bytes:
        """The ledger file's bytes now, read without the lock (a write replaces the file whole,
        so a read sees one ledger or the next), unchecked beyond the file's own checks: a hint
        of whether anything changed, never a ledger to act on. b"" without one."""
        directory = self._open_directory()
        try:
            return self._read(directory)
        finally:
            os.close(directory)

    def snapshot(self) -> Ledger:
        """The ledger now (recovered first, as every transaction)."""
        with self.transaction() as ledger:
            return ledger

    def set_limits(
        self,
        engine: str,
        *,
        min_blocks: int | None = None,
        max_blocks: int | None = None,
        min_bytes: int | None = None,
        max_bytes: int | None = None,
    ) -> None:
        """Changes engine `engine`'s limits while it runs, in its own blocks or in bytes (a
        minimum in bytes: the fewest of its blocks that hold it; a maximum: the most that fit
        in it); its member acts on them at its next `serve` (giving back what lies past a
        lowered maximum, once free)."""
        check_name(engine, "engine")
        limits = {"min_blocks": min_blocks, "max_blocks": max_blocks}
        limits |= {"min_bytes": min_bytes, "max_bytes": max_bytes}
        for what, value in limits.items():
            _args.optional_size(value, what, maximum=rules.MAX_BLOCKS)
        with self.transaction() as ledger:
            rules.set_limits(
                ledger,
                engine,
                self.clock(),
                min_blocks,
                max_blocks,
                min_bytes=min_bytes,
                max_bytes=max_bytes,
            )

    def set_cap(self, device: str, num_bytes: int | None) -> None:
        """Caps the bytes the pool's engines may hold on `device` (`cpu`, `cuda:N`) in all
        (None: no cap)."""
        rules.check_cap(device, num_bytes)
        with self.transaction() as ledger:
            rules.set_cap(ledger, device, num_bytes, self.clock())

    def set_share(self, device: str, num_bytes: int | None) -> None:
        """Deprecated: `set_cap`."""
        warnings.warn("Pool.set_share is deprecated: use Pool.set_cap", DeprecationWarning, 2)
        self.set_cap(device, num_bytes)

    def reset(self) -> None:
        """Removes the ledger (a corrupt one too, or whatever else is in its place): the next
        transaction starts an empty one. Engines still running keep their memory but are no
        longer in the pool."""
        with self._locked() as directory, contextlib.suppress(FileNotFoundError):
            os.unlink(LEDGER, dir_fd=directory)

    def destroy(self) -> None:
        """Removes the pool's directory with its ledger, lock and temporary files."""
        try:
            with self._locked() as directory:
                for entry in os.listdir(directory):
                    if entry in (LEDGER, LOCK) or entry.startswith(TEMPORARY):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry, dir_fd=directory)
        except FileNotFoundError:
            return
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(self.pool_directory)

    # -------------------------------------------------------------------------------------
    # the lock

    @contextlib.contextmanager
    def _locked(self) -> Iterator[int]:
        """The pool's directory, opened and checked, with the pool's lock held."""
        deadline = time.monotonic() + self.lock_timeout_s
        # Interrupted by a Ctrl-C on POSIX, as is the sleep between the flock's tries.
        if not self._thread_lock.acquire(timeout=self.lock_timeout_s):
            raise PoolLockTimeout(f"another thread held {self.lock_path} too long")
        try:
            directory = self._open_directory()
            try:
                # Opened per transaction: a descriptor inherited across fork would share it.
                # Read-only is enough for a flock, and the group needs no more.
                fd = self._open_file(directory, LOCK, os.O_RDONLY | os.O_CREAT)
                try:
                    self._flock(fd, deadline)
                    yield directory
                finally:
                    os.close(fd)  # drops the lock
            finally:
                os.close(directory)
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
                    f"{self.lock_path} was held for more than {self.lock_timeout_s} s by a "
                    "live process (a dead one cannot hold it)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    # -------------------------------------------------------------------------------------
    # the ledger's file

    def _read(self, directory: int) -> bytes:
        try:
            fd = self._open_file(directory, LEDGER, os.O_RDONLY)
        except FileNotFoundError:
            return b""
        try:
            chunks, left = [], MAX_LEDGER_BYTES + 1
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if not data:
            raise LedgerCorruptError(f"{self.path} is empty")
        return data

    def _write(self, directory: int, ledger: Ledger) -> bytes:
        """Writes `ledger` (its generation the next) in place of the file; returns its bytes."""
        ledger.generation += 1
        data = encode(ledger)
        why = refusal(data)
        if why is not None:
            raise ValueError(f"the ledger was not written: its readers would refuse it ({why})")
        for entry in os.listdir(directory):  # a dead writer's: this one holds the lock
            if entry.startswith(TEMPORARY):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry, dir_fd=directory)
        mode = 0o600 if self.group is None else 0o640
        while True:
            temporary = TEMPORARY + secrets.token_hex(8)
            try:
                fd = os.open(
                    temporary,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN,
                    mode,
                    dir_fd=directory,
                )
                break
            except FileExistsError:  # a name taken (a symlink or a FIFO is never opened)
                continue
        try:
            try:
                os.fchmod(fd, mode)  # the umask may have taken the group's read
                _write_all(fd, data)
            finally:
                os.close(fd)
            os.replace(temporary, LEDGER, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=directory)
            raise
        return data

    # -------------------------------------------------------------------------------------
    # opening safely

    def _open_directory(self) -> int:
        """The pool's directory, created if missing, opened without following a link and
        checked: a directory of this user's (of the pool's group's, when shared) that no one
        else may write to."""
        self._check_base()
        flags = os.O_RDONLY | os.O_DIRECTORY | _OPEN
        try:
            fd = os.open(self.pool_directory, flags)
        except FileNotFoundError:
            self._make_directory()
            fd = self._open_existing_directory(flags)
        except OSError as error:
            raise self._refusal(self.pool_directory, error, "directory") from None
        try:
            self._check(os.fstat(fd), self.pool_directory, "directory")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_existing_directory(self, flags: int) -> int:
        try:
            return os.open(self.pool_directory, flags)
        except OSError as error:
            raise self._refusal(self.pool_directory, error, "directory") from None

    def _make_directory(self) -> None:
        mode = 0o700 if self.group is None else 0o2770
        try:
            os.mkdir(self.pool_directory, mode)
        except FileExistsError:  # made meanwhile, by another engine or not: checked on open
            return
        except OSError as error:
            raise self._refusal(self.pool_directory, error, "directory") from None
        fd = os.open(self.pool_directory, os.O_RDONLY | os.O_DIRECTORY | _OPEN)
        try:
            if os.fstat(fd).st_uid == os.geteuid():
                if self.group is not None:
                    os.fchown(fd, -1, self.group)
                os.fchmod(fd, mode)  # the umask may have taken the group's bits
        finally:
            os.close(fd)

    def _open_file(self, directory: int, name: str, flags: int) -> int:
        """File `name` of the pool's directory, opened without following a link or blocking
        on a FIFO, and checked (else a `PoolPermissionError`); `FileNotFoundError` if it is
        missing and `flags` do not create it."""
        path = os.path.join(self.pool_directory, name)
        mode = 0o600 if self.group is None else 0o640
        try:
            fd = os.open(name, flags | _OPEN, mode, dir_fd=directory)
        except FileNotFoundError:
            raise
        except OSError as error:
            raise self._refusal(path, error, "file") from None
        try:
            self._check(os.fstat(fd), path, "file")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_base(self) -> None:
        """The directory the pool's directory lies in: a directory that no user but this one
        (or root) can rename the pool's directory in, unless it is sticky."""
        base = self.directory
        try:
            st = os.stat(base)  # a link is fine here (/dev/shm -> /run/shm): its target counts
        except OSError as error:
            raise PoolPermissionError(
                f"{base}, the directory of pool {self.name!r}, cannot be used: {error}; set "
                "$EXTENSIBLE_KV_POOL_DIR (or directory=) to a directory of yours"
            ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise PoolPermissionError(
                f"{base} is not a directory: set $EXTENSIBLE_KV_POOL_DIR (or directory=) to one"
            )
        trusted = st.st_uid in (0, os.geteuid()) or (
            self.group is not None and st.st_gid == self.group and not st.st_mode & stat.S_IWOTH
        )
        if not trusted:
            raise PoolPermissionError(
                f"{base} belongs to {_user_name(st.st_uid)}: that user could replace pool "
                f"{self.name!r}'s directory in it; set $EXTENSIBLE_KV_POOL_DIR (or "
                "directory=) to a directory of yours or root's"
            )
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise PoolPermissionError(
                f"{base} is writable by every user and not sticky: any of them could rename or "
                f"replace pool {self.name!r}'s directory in it; make it sticky (chmod +t "
                f"{base}, as /dev/shm and /tmp are) or set $EXTENSIBLE_KV_POOL_DIR (or "
                "directory=) to a directory of yours"
            )

    def _check(self, st: os.stat_result, path: str, kind: str) -> None:
        """An opened directory or file of the pool: the right kind, owner and mode."""
        is_kind = stat.S_ISDIR if kind == "directory" else stat.S_ISREG
        if not is_kind(st.st_mode):
            raise PoolPermissionError(
                f"{path} is {_kind_of(st.st_mode)} of {_user_name(st.st_uid)}, not a {kind} "
                f"this library made: remove it (rm {path}) if no engine of pool {self.name!r} "
                "runs"
            )
        if self.group is None:
            self._check_own(st, path, kind)
        else:
            self._check_group(st, path, kind)

    def _check_own(self, st: os.stat_result, path: str, kind: str) -> None:
        if st.st_uid != os.geteuid():
            raise PoolPermissionError(
                f"{path} belongs to {_user_name(st.st_uid)}, not to this user "
                f"({_user_name(os.geteuid())}): pool {self.name!r} is another user's. A pool "
                f"shared by several users is opt-in: every engine of it, its owner's too, "
                f"gives the same group (Pool(name, group=...), ${GROUP_ENV}, or the command "
                "line's --group); or use another pool name"
            )
        if kind == "directory" and st.st_mode & 0o070 and not st.st_mode & 0o007:
            raise PoolPermissionError(
                f"{path} is shared with group {_group_name(st.st_gid)} (mode "
                f"{stat.S_IMODE(st.st_mode):o}): give group={_group_name(st.st_gid)!r} (or "
                f"${GROUP_ENV}, or --group) to join it"
            )
        if st.st_mode & (0o077 if kind == "directory" else 0o022):
            raise PoolPermissionError(
                f"{path} (of {_user_name(st.st_uid)}) is open to other users (mode "
                f"{stat.S_IMODE(st.st_mode):o}): remove it (rm -r {path}) if no engine of pool "
                f"{self.name!r} runs, or chmod go-rwx {path}"
            )

    def _check_group(self, st: os.stat_result, path: str, kind: str) -> None:
        assert self.group is not None
        group = _group_name(self.group)
        if st.st_gid != self.group:
            if st.st_uid == os.geteuid() and kind == "directory" and not st.st_mode & 0o077:
                fix = f"this user's own pool: join it without a group, or rm -r {path}"
            else:
                fix = "every engine of it must give the same group; or use another pool name"
            raise PoolPermissionError(
                f"{path} (of {_user_name(st.st_uid)}) belongs to group "
                f"{_group_name(st.st_gid)}, not to {group}: {fix}"
            )
        if st.st_mode & stat.S_IWOTH or (
            kind == "directory" and (st.st_mode & 0o007 or st.st_mode & 0o070 != 0o070)
        ):
            want = "2770" if kind == "directory" else "640"
            raise PoolPermissionError(
                f"{path} (of {_user_name(st.st_uid)}, group {group}) has mode "
                f"{stat.S_IMODE(st.st_mode):o}, not {want}: chmod {want} {path}"
            )

    def _refusal(self, path: str, error: OSError, kind: str) -> PoolPermissionError | OSError:
        """What an open of the pool's `path` that failed with `error` means for the user."""
        try:
            st = os.lstat(path)
        except OSError:
            return error
        if error.errno == errno.ELOOP or stat.S_ISLNK(st.st_mode):
            target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else "?"
            return PoolPermissionError(
                f"{path} is a symbolic link (to {target}) of {_user_name(st.st_uid)}, not the "
                f"{kind} this library made: remove it (rm {path}) if no engine of pool "
                f"{self.name!r} runs"
            )
        if error.errno in (errno.ENOTDIR, errno.ENXIO, errno.EISDIR):
            return PoolPermissionError(
                f"{path} is {_kind_of(st.st_mode)} of {_user_name(st.st_uid)}, not the {kind} "
                f"this library made: remove it (rm {path}) if no engine of pool {self.name!r} "
                "runs"
            )
        if error.errno in (errno.EACCES, errno.EPERM):
            try:
                self._check(st, path, kind)  # says whose it is, and how to opt in
            except PoolPermissionError as refused:
                return refused
            return PoolPermissionError(
                f"{path} (of {_user_name(st.st_uid)}, group {_group_name(st.st_gid)}, mode "
                f"{stat.S_IMODE(st.st_mode):o}) may not be opened by this user: {error.strerror}"
            )
        return error


def _group_id(group: str | int | None) -> int | None:
    """The id of `group` (a name or an id), which this user must be a member of (or root)."""
    if group is None:
        return None
    if isinstance(group, bool) or not isinstance(group, str | int):
        raise TypeError(f"group must be a group's name or id, not {type(group).__name__}")
    if isinstance(group, int) or group.isdigit():
        gid = int(group)
        if not 0 <= gid < 2**32:
            raise ValueError(f"group id {gid} is out of range")
    else:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise ValueError(f"there is no group named {group!r} on this node") from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise PoolPermissionError(
            f"this user ({_user_name(os.geteuid())}) is not a member of group "
            f"{_group_name(gid)}, so cannot share a pool through it: add the user to it "
            "(usermod -aG GROUP USER, then log in again) or give a group it is in"
        )
    return gid


def _user_name(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _kind_of(mode: int) -> str:
    kinds = [
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a file"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ]
    return next((name for test, name in kinds if test(mode)), "something")
