"""Is a process still the one that joined? A pid alone cannot say: the kernel hands a dead
process's pid to the next one it starts. Its start time (field 22 of `/proc/<pid>/stat`, in
clock ticks after boot) tells the two apart.

The core asks the same question of a loan's borrower (`ipc::process_start_time` in
`src/ipc.rs`: a lender's reclaim takes its memory back once the borrower is gone), so the two
must agree on which processes are dead: `parse_start_time` follows the core's rules exactly.
A zombie (`Z`) or a dead task (`X`) has lost its memory and fds already: it counts as dead;
every other state is a live process. The fields follow the last `)` (the command name
between the parentheses may hold anything), split on whitespace; field 22 is an unsigned
64-bit decimal (an optional `+`, then digits), and a line without one names no process. One
difference is deliberate: the line is read as bytes, so that a command name that is not
UTF-8 (a name cut at 15 bytes in the middle of a character) is read, where the core's
`read_to_string` fails and tells a live process dead.
"""

from __future__ import annotations

import os
import re

__all__ = ["alive", "own_start_time", "parse_start_time", "start_time"]

# The process states the core counts as dead (`ipc::process_start_time`).
DEAD_STATES = (b"Z", b"X")
_U64 = re.compile(rb"\+?[0-9]+")


def parse_start_time(stat: bytes) -> int | None:
    """The start time a `/proc/<pid>/stat` line `stat` gives, or None where it names a dead
    process (state `Z` or `X`) or is not such a line."""
    close = stat.rfind(b")")
    if close < 0:
        return None
    fields = stat[close + 1 :].split()
    if not fields or fields[0] in DEAD_STATES:  # field 3, the state
        return None
    if len(fields) < 20 or not _U64.fullmatch(fields[19]):  # field 22
        return None
    value = int(fields[19])
    return value if value < 2**64 else None


def start_time(pid: int) -> int | None:
    """The start time of process `pid`, or None if there is no such live process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            line = stat.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return parse_start_time(line)


def alive(pid: int, started: int) -> bool:
    """Whether process `pid` lives and is the one that started at `started`."""
    return start_time(pid) == started


def own_start_time() -> int:
    started = start_time(os.getpid())
    assert started is not None, "this process reads its own /proc/self/stat"
    return started
