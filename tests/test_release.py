"""Memory given back waits for its stream, not for the caller (`src/tensor/release.rs`).

A shrink or `release_physical` records an event on the stream and returns; the tensor's
release thread unmaps once the stream's earlier work has run. On the host backend a test
holds the events (its stand-in for a busy stream); on CUDA a kernel that spins keeps the
stream busy for real. One test body per backend.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from conftest import MakeTensor
from extensible_kv import ExtensibleTensor, HandleSizing, UnsupportedError

# ~100 ms of torch.cuda._sleep at the H200's ~2 GHz.
SLEEP_CYCLES = 200_000_000


@contextmanager
def busy_stream(t: ExtensibleTensor) -> Iterator[int | None]:
    """A stream that stays busy inside the block: on CUDA a side stream running a long spin
    kernel (the block's calls queue behind it); on the host, events held until the block
    ends. Yields the stream to give the tensor's calls."""
    if t.backend == "host":
        t._hold_events(True)
        try:
            yield None
        finally:
            t._hold_events(False)
        return
    stream = torch.cuda.Stream(torch.device(t.device))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    yield int(stream.cuda_stream)


def _filled(make_tensor: MakeTensor, g: int, granules: int) -> ExtensibleTensor:
    t = make_tensor(8 * g, handle_sizing=HandleSizing("cap_aligned", g))
    t.resize_(granules * g)
    for i in range(granules):
        t.full_view()[i * g : (i + 1) * g].fill_(i + 1)
    return t


def _wait(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.mark.parametrize("how", ["shrink", "release_physical"])
def test_memory_given_back_waits_for_its_stream_then_goes(
    make_tensor: MakeTensor, g: int, how: str
) -> None:
    t = _filled(make_tensor, g, 6)
    with busy_stream(t) as stream:
        start = time.perf_counter()
        if how == "shrink":
            t.shrink_(2 * g, stream=stream)
        else:
            t.release_physical(stream=stream)
        took = time.perf_counter() - start
        kept = 2 * g if how == "shrink" else 0
        assert t.segment_bytes == (kept,)
        assert t.pending_release_bytes == 6 * g - kept, "still mapped while the stream is busy"
        assert t.physical_bytes == 6 * g and t.num_handles == 6
        assert not t.wait_released(0.01)
        if t.backend == "cuda":
            assert took < 0.05, f"the call waited for the stream: {took * 1e3:.1f} ms"
    assert t.wait_released(10)
    assert t.pending_release_bytes == 0
    assert (t.physical_bytes, t.num_handles) == (kept, kept // g)
    if kept:
        assert torch.equal(t.full_view()[g : 2 * g].cpu(), torch.full((g,), 2, dtype=torch.uint8))
    assert t.take_deferred_errors() == []
    t._check_invariants()


def test_a_grow_takes_back_what_is_still_pending(make_tensor: MakeTensor, g: int) -> None:
    t = _filled(make_tensor, g, 6)
    with busy_stream(t) as stream:
        t.shrink_(2 * g, stream=stream)
        t.resize_(4 * g, stream=stream)
        assert t.pending_release_bytes == 2 * g, "granules 2 and 3 were mapped again"
        t._check_invariants()
    assert t.wait_released(10)
    assert t.physical_bytes == 4 * g
    got = t.full_view()[: 4 * g].cpu()
    want = torch.cat([torch.full((g,), i, dtype=torch.uint8) for i in (1, 2, 0, 0)])
    assert torch.equal(got, want), "kept below, zeroed above"


def test_the_host_backend_alone_can_hold_its_events(make_tensor: MakeTensor) -> None:
    t = make_tensor(4096)
    if t.backend == "host":
        t._hold_events(True)
        t._hold_events(False)
    else:
        with pytest.raises(UnsupportedError, match="only the host backend"):
            t._hold_events(True)


@pytest.mark.parametrize("ending", ["exit", "close"])
def test_a_process_that_ends_with_releases_pending_leaks_nothing(
    make_tensor: MakeTensor, g: int, ending: str
) -> None:
    """A child shrinks while its stream is busy and then ends: by interpreter exit (the tensor
    still alive: its teardown waits for the device, then releases) or by `close()` first,
    after which its own memfds and mappings are counted. It must end promptly and cleanly."""
    device = make_tensor(1).device  # "cpu" or "cuda:N"
    child = textwrap.dedent(
        f"""
        import os, torch
        from extensible_kv import ExtensibleTensor, HandleSizing
        g = {g}
        t = ExtensibleTensor(8 * g, device={str(device)!r}, granularity=g,
                             handle_sizing=HandleSizing("cap_aligned", g))
        t.resize_(6 * g)
        stream = torch.cuda.Stream(torch.device(t.device)) if t.backend == "cuda" else None
        if t.backend == "host":
            t._hold_events(True)
        else:
            with torch.cuda.stream(stream):
                torch.cuda._sleep({SLEEP_CYCLES})
        t.shrink_(g, stream=None if stream is None else int(stream.cuda_stream))
        assert t.pending_release_bytes == 5 * g, t.pending_release_bytes
        if {ending!r} == "close":
            t.close()
            name = "extensible-kv:%d:" % os.getpid()
            fds = []
            for f in os.listdir("/proc/self/fd"):
                try:
                    fds.append(os.readlink(f"/proc/self/fd/{{f}}"))
                except FileNotFoundError:  # the directory's own fd, closed since
                    pass
            fds = [f for f in fds if name in f]
            maps = [l for l in open("/proc/self/maps") if name in l]
            print("left", len(fds), len(maps), t.pending_release_bytes)
        """
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "panicked" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    if ending == "close":
        assert "left 0 0 0" in done.stdout, done.stdout


def test_a_driver_rate_paces_the_memory_back_one_handle_at_a_time(
    make_tensor: MakeTensor, g: int
) -> None:
    """Under a live decode loop the driver's work for memory created and released slows the
    steps; a `driver_rate` spreads it: a shrink still returns at once, and the handles go back
    one at a time, the ones not reached yet pending (a grow takes them back); a grow creates
    one handle at a time at the rate."""
    t = _filled(make_tensor, g, 6)
    assert t.driver_rate is None
    gap_s = 0.06
    t.driver_rate = int(g / gap_s)  # a handle per `gap_s`
    with busy_stream(t) as stream:
        t.shrink_(2 * g, stream=stream)
        assert t.pending_release_bytes == 4 * g
    start = time.perf_counter()
    seen = [t.pending_release_bytes]
    while not t.wait_released(0.001):
        if t.pending_release_bytes != seen[-1]:
            seen.append(t.pending_release_bytes)
    took = time.perf_counter() - start
    seen.append(t.pending_release_bytes)
    # The first may have gone before the first look (its event completes as the block ends).
    distinct = [b for i, b in enumerate(seen) if i == 0 or b != seen[i - 1]]
    assert distinct[0] >= 3 * g and distinct[-1] == 0, distinct
    assert all(a - b == g for a, b in itertools.pairwise(distinct)), "one handle at a time"
    assert took >= 2 * gap_s * 0.9, f"4 handles at one per {gap_s} s went in {took:.3f} s"
    assert (t.physical_bytes, t.num_handles) == (2 * g, 2)
    assert torch.equal(t.full_view()[g : 2 * g].cpu(), torch.full((g,), 2, dtype=torch.uint8))
    start = time.perf_counter()
    t.resize_(6 * g)  # 4 handles created, one per `gap_s`
    took = time.perf_counter() - start
    assert took >= 3 * gap_s * 0.9, f"4 handles at one per {gap_s} s grew in {took:.3f} s"
    # Slower than any test: the grow takes back the three the thread has not reached (top
    # down: granules 2-4), with no create, which would wait its turn at this rate.
    t.driver_rate = max(1, g // 10)
    with busy_stream(t) as stream:
        t.shrink_(2 * g, stream=stream)
    assert _wait(lambda: t.pending_release_bytes == 3 * g), "the first goes when it may"
    t.resize_(5 * g)
    assert t.pending_release_bytes == 0
    assert torch.equal(t.full_view()[2 * g : 5 * g].cpu(), torch.zeros(3 * g, dtype=torch.uint8))
    t.driver_rate = None
    assert t.take_deferred_errors() == []
    t._check_invariants()


@pytest.mark.parametrize(
    ("rate", "error", "match"),
    [(0, ValueError, "positive"), (-1, ValueError, "non-negative"), (1.5, TypeError, "an int")],
)
def test_a_wrong_driver_rate_is_refused_and_changes_nothing(
    make_tensor: MakeTensor, rate: object, error: type[Exception], match: str
) -> None:
    t = make_tensor(4096)
    t.driver_rate = 1 << 30
    with pytest.raises(error, match=match):
        t.driver_rate = rate
    assert t.driver_rate == 1 << 30
