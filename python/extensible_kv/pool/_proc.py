"""Is a process still the one that joined? A pid alone cannot say: the kernel hands a dead
process's pid to the next one it starts. Its start time (field 22 of `/proc/<pid>/stat`, in
clock ticks after boot) tells the two apart.

One parser answers that for the whole package: the core's (`ipc::process_start_time` and
`ipc::parse_start_time` in `src/ipc.rs`, through `_native`), which a lender's reclaim asks
of a loan's borrower too, so that the pool and the core never disagree on which processes
are dead. A zombie (`Z`) or a dead task (`X`) has lost its memory and fds already: it counts
as dead; every other state is a live process. The line is read as bytes: a command name
that is not UTF-8 (a name cut at 15 bytes in the middle of a character) is read, never
taken for a dead process.
"""

from __future__ import annotations

import os

from extensible_kv import _native

__all__ = ["alive", "mapped_host_bytes", "own_start_time", "parse_start_time", "start_time"]

# How the host backend names its memfds (`src/driver/host/mod.rs`: `extensible-kv:<pid>:<n>`), as
# `/proc/<pid>/maps` shows a mapping of one.
HOST_MEMFD = "/memfd:extensible-kv:"


def parse_start_time(stat: bytes) -> int | None:
    """The start time a `/proc/<pid>/stat` line `stat` gives, or None where it names a dead
    process (state `Z` or `X`) or is not such a line (`_native.parse_start_time`)."""
    return _native.parse_start_time(stat)


def start_time(pid: int) -> int | None:
    """The start time of process `pid`, or None if there is no such live process."""
    return _native.process_start_time(pid)


def alive(pid: int, started: int) -> bool:
    """Whether process `pid` lives and is the one that started at `started`."""
    return start_time(pid) == started


def own_start_time() -> int:
    started = start_time(os.getpid())
    assert started is not None, "this process reads its own /proc/self/stat"
    return started


def mapped_host_bytes(pid: int) -> int:
    """The bytes of host-backend memory process `pid` maps now (`/proc/<pid>/maps`: its
    mappings of this library's memfds, its own and those it borrowed): what the pool's
    ledger says it holds, seen from outside the process."""
    total = 0
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(HOST_MEMFD):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                total += end - start
    return total
