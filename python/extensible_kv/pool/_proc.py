"""Is a process still the one that joined? A pid alone cannot say: the kernel hands a dead
process's pid to the next one it starts. Its start time (field 22 of `/proc/<pid>/stat`, in
clock ticks after boot) tells the two apart."""

from __future__ import annotations

import os


def start_time(pid: int) -> int | None:
    """The start time of process `pid`, or None if there is no such live process (a zombie, a
    process killed but not yet reaped by its parent, has lost its memory and fds already: it
    counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            line = stat.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name is between the first '(' and the last ')', and may hold anything.
    rest = line[line.rfind(b")") + 2 :].split()
    if len(rest) < 20 or rest[0] in (b"Z", b"X", b"x"):
        return None
    return int(rest[19])


def alive(pid: int, started: int) -> bool:
    """Whether process `pid` lives and is the one that started at `started`."""
    return start_time(pid) == started


def own_start_time() -> int:
    started = start_time(os.getpid())
    assert started is not None, "this process reads its own /proc/self/stat"
    return started
