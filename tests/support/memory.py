"""What the tests read of memory: the granules a tensor needs and maps, this process's memfds
and mappings (`/proc/self`), and the device's free memory once it settles."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterable

from extensible_kv import ExtensibleTensor

MEMFD_TAG = "memfd:extensible-kv"

MakeTensor = Callable[..., ExtensibleTensor]


def granules_of(offsets: Iterable[int], sizes: Iterable[int], g: int) -> set[int]:
    """The granules of size `g` that hold a byte of some prefix `[offset, offset + size)`."""
    granules: set[int] = set()
    for offset, num_bytes in zip(offsets, sizes, strict=True):
        if num_bytes:
            granules.update(range(offset // g, -(-(offset + num_bytes) // g)))
    return granules


def needed_granules(t: ExtensibleTensor) -> set[int]:
    """The granules that hold a committed byte of some segment."""
    return granules_of(t.segment_offsets, t.segment_bytes, t.granularity)


def mapped_granules(t: ExtensibleTensor) -> list[int]:
    """The granules of every mapped handle, in address order (a repeat is a double map)."""
    return [first + i for first, n in t.handle_runs() for i in range(n)]


def memfd_counts() -> tuple[int, int]:
    """`(open fds, mappings)` of this process that belong to extensible-kv memfds.

    The host backend names its memfds `extensible-kv:<pid>:<id>`; they show up as
    `/memfd:extensible-kv:... (deleted)` in `/proc/self/fd` and `/proc/self/maps`. No
    garbage collection here (it costs ~0.1 s with torch loaded): drop views before counting.
    """
    fds = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the fd listing the directory itself is gone by now
            continue
        if MEMFD_TAG in target:
            fds += 1
    with open("/proc/self/maps") as maps:
        mappings = sum(MEMFD_TAG in line for line in maps)
    return fds, mappings


def containing_mapping(address: int) -> str | None:
    """The permissions of this process's mapping that holds `address`, if any."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            bounds, perms = line.split()[:2]
            start, end = (int(x, 16) for x in bounds.split("-"))
            if start <= address < end:
                return perms
    return None


def settled_free(timeout_s: float = 10.0, *, reset_peaks: bool = False) -> int:
    """Free device memory once it stops moving: the driver scrubs released memory in the
    background before it counts as free again (docs/design.md §2). `reset_peaks` also resets
    torch's peak statistics (earlier tests' peaks are no transient of the caller's)."""
    import time

    import torch

    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    if reset_peaks:
        torch.cuda.reset_peak_memory_stats(0)
    deadline = time.monotonic() + timeout_s
    last = int(torch.cuda.mem_get_info(0)[0])
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = int(torch.cuda.mem_get_info(0)[0])
        if abs(now - last) <= 4 << 20:
            return now
        last = now
    return last
