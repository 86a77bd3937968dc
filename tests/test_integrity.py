"""Issue 24's defects, each with a test that failed before the fix: errors deferred by one
operation are never raised by an unrelated later one, `close()` always ends closed, and no
getter or view waits for the tensor's lock while holding the GIL (measured: a pure-Python
thread keeps running while another thread grows the tensor)."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time

import pytest
from extensible_kv import ClosedError, DriverError, ExtensibleTensor, HandleSizing
from support.memory import MakeTensor


def _release_fails(g: int, nth: int) -> ExtensibleTensor:
    """A host tensor of one-granule handles whose `nth` handle release fails (a driver error)."""
    return ExtensibleTensor(
        8 * g,
        device="cpu",
        granularity=g,
        handle_sizing=HandleSizing(max_bytes=g),
        _fault=("release", nth, "driver"),
    )


def _deferring(g: int) -> ExtensibleTensor:
    """A tensor whose first release fails (a destructor defers it): a shrink triggers it."""
    t = _release_fails(g, 1)
    t.resize_(4 * g)
    return t


def test_an_earlier_deferred_error_is_logged_not_raised_by_later_calls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    g = 4096
    t = _deferring(g)
    with caplog.at_level(logging.WARNING, logger="extensible_kv"):
        t.shrink_(2 * g)  # succeeds; its release of a handle fails in a destructor
        t.wait_released(10)  # (on the tensor's thread where the release is deferred)
    assert any("take_deferred_errors" in r.getMessage() for r in caplog.records), caplog.text
    t.release_physical()  # unrelated: must not raise the shrink's error
    t.resize_(g)
    t.close()  # nor must close
    assert t.closed
    deferred = t.take_deferred_errors()
    assert len(deferred) == 1 and "INJECTED" in deferred[0], deferred


def test_close_always_ends_closed_and_reports_its_own_error_after() -> None:
    g = 4096
    t = _release_fails(g, 2)
    t.resize_(3 * g)
    with pytest.raises(DriverError, match="the tensor is closed regardless"):
        t.close()
    assert t.closed and t.physical_bytes == 0
    with pytest.raises(ClosedError):
        t.resize_(g)
    t.close()  # idempotent, and the error was not left behind to be raised again
    assert t.take_deferred_errors() == []


@pytest.mark.parametrize("when", ["at once", "deferred"])
def test_release_physical_says_what_it_released_when_a_release_fails(when: str) -> None:
    """Released at once (the host's events complete when recorded), the caller meets the
    failure; deferred (its event pending, as on CUDA), the tensor's thread meets it and
    reports it later. The event is held rather than delayed: a caller descheduled past a
    delay (a loaded CI machine) would meet the thread's error as its own."""
    g = 4096
    t = _release_fails(g, 1)
    t.resize_(2 * g)
    if when == "deferred":
        t._hold_events(True)
        t.release_physical()
        t._hold_events(False)
        assert t.wait_released(10)
        (error,) = t.take_deferred_errors()
        assert "INJECTED" in str(error)
    elif os.environ.get("EXTENSIBLE_KV_HOST_EVENT_DELAY_US"):
        pytest.skip("the host's events complete late in this run: no release is at once")
    else:
        with pytest.raises(DriverError, match="the release went on: every segment holds 0 bytes"):
            t.release_physical()
    assert t.segment_bytes == (0,) and t.physical_bytes == 0 and t.num_handles == 0
    t.resize_(2 * g)  # and the tensor works on
    t.full_view()[: 2 * g].fill_(3)
    t.close()


def test_a_failed_fence_releases_nothing() -> None:
    g = 4096
    # The fence of a release is the event recorded on its stream (never a synchronize).
    fault = ("record_event", 1, "driver")
    t = ExtensibleTensor(8 * g, device="cpu", granularity=g, _fault=fault)
    t.resize_(2 * g)
    with pytest.raises(DriverError):
        t.release_physical()
    assert t.segment_bytes == (2 * g,) and t.physical_bytes == 2 * g
    t.close()


def _grow_while_reading(t: ExtensibleTensor, num_bytes: int) -> dict[str, float]:
    """Grows `t` to `num_bytes` on a thread while this one reads getters and makes views and a
    pure-Python thread counts: the longest getter call, the longest pause of the counter, and
    the grow's own time, in seconds."""
    ticks: list[float] = []
    done = threading.Event()
    started = threading.Event()

    failed: list[BaseException] = []

    def grow() -> None:
        started.set()
        start = time.perf_counter()
        try:
            t.resize_(num_bytes, zero_new=False)
        except BaseException as error:  # the readers below loop until `done`: never hang
            failed.append(error)
        finally:
            ticks_grow.append(time.perf_counter() - start)
            done.set()

    def count() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())

    ticks_grow: list[float] = []
    warm = (t.full_view(), repr(t))  # the first view imports torch's DLPack module
    del warm
    counter = threading.Thread(target=count)
    grower = threading.Thread(target=grow)
    counter.start()
    grower.start()
    started.wait()
    longest_getter = 0.0
    while not done.is_set():
        start = time.perf_counter()
        _ = (t.physical_bytes, t.segment_bytes, t.num_handles, repr(t), t.closed)
        view = t.full_view()
        longest_getter = max(longest_getter, time.perf_counter() - start)
        del view
    grower.join()
    counter.join()
    if failed:
        raise failed[0]
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    return {"getter": longest_getter, "stall": max(gaps), "grow": ticks_grow[0]}


def test_no_getter_or_view_waits_for_a_grow_holding_the_gil(
    device: str, make_tensor: MakeTensor
) -> None:
    """Before: `physical_bytes` blocked 0.52 s during a 2 GiB host grow (as long as the grow),
    and every Python thread with it. Targets, on a quiet machine: a getter < 10 ms, a
    pure-Python thread never stalls > 50 ms (measured: 0.27 ms and 7 ms). Asserted relative to
    the grow's own time, which a loaded 2-core CI machine stretches (5 s seen) along with every
    pause: blocking would make both as long as the grow."""
    if device == "cpu":
        num_bytes = 2 << 30
    else:  # 100 GiB where it fits (an H200), else most of what is free (an H100's 80 GiB)
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        num_bytes = min(100 << 30, (free - (4 << 30)) // (2 << 20) * (2 << 20))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)  # the GIL's own hand-offs, not the test's subject: keep short
    tries = []
    try:
        # On the CPU, up to three grows: a loaded CI machine once descheduled the counter for
        # 230 ms of a 672 ms grow. A grow that holds the GIL stalls every one of them.
        for _ in range(1 if device != "cpu" else 3):
            with make_tensor(num_bytes) as t:
                times = _grow_while_reading(t, num_bytes)
                assert t.physical_bytes == num_bytes
            print(
                f"\n{device}: grow {times['grow'] * 1e3:.1f} ms, longest getter "
                f"{times['getter'] * 1e3:.2f} ms, longest stall {times['stall'] * 1e3:.2f} ms"
            )
            tries.append(times)
            if times["getter"] < times["grow"] / 4 and times["stall"] < times["grow"] / 4:
                break
    finally:
        sys.setswitchinterval(interval)
    if device != "cpu":  # 15 ms for 100 GiB on the H200: the targets themselves, on 16 cores
        assert times["getter"] < 0.01 and times["stall"] < 0.05, times
        return
    assert all(t["grow"] > 0.02 for t in tries), "too short a grow to tell waiting from not"
    assert times["getter"] < times["grow"] / 4 and times["stall"] < times["grow"] / 4, tries
