"""The host backend refuses a commit that does not fit the memory available, before touching it.

A memfd's `fallocate` is not bounded by overcommit: asked for more than the machine has, it
takes page after page until the kernel's OOM killer ends some process. So the refusal must come
first, from what Linux says is available (`MemAvailable`, and a memory cgroup's headroom).

Every commit here runs in a child process watched by the parent: if the child's memfds ever
hold more than `WATCHDOG_BYTES`, the parent kills it and the test fails. That keeps the machine
safe whatever the library does (it is how these tests were run against the unfixed backend).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
from extensible_kv import _native

WATCHDOG_BYTES = 512 << 20
TAG = "memfd:extensible-kv"


def _memfd_bytes(pid: int) -> int:
    """Bytes allocated to the extensible-kv memfds that process `pid` holds open."""
    total = 0
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for name in names:
        path = f"/proc/{pid}/fd/{name}"
        try:
            if TAG in os.readlink(path):
                total += os.stat(path).st_blocks * 512
        except OSError:  # closed in the meantime
            continue
    return total


def run_watched(body: str, timeout_s: float = 60) -> dict[str, object]:
    """Runs `body` (Python, which must set `result` to a JSON-able dict) in a child process;
    kills the child if its memfds hold more than `WATCHDOG_BYTES`. Returns `result`."""
    code = (
        textwrap.dedent(
            """
        import json, sys
        from extensible_kv import ExtensibleTensor, OutOfMemoryError, _native
        """
        )
        + textwrap.dedent(body)
        + "\nprint(json.dumps(result))\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + timeout_s
    peak = 0
    while child.poll() is None:
        peak = max(peak, _memfd_bytes(child.pid))
        if peak > WATCHDOG_BYTES or time.monotonic() > deadline:
            child.kill()
            child.wait()
            pytest.fail(
                f"the child committed {peak} bytes (watchdog at {WATCHDOG_BYTES}) or ran past "
                f"{timeout_s} s instead of refusing: killed"
            )
        time.sleep(0.002)
    out, err = child.communicate()
    assert child.returncode == 0, (child.returncode, err[-2000:])
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    result["peak_memfd_bytes"] = peak
    return result


REFUSE = """
t = ExtensibleTensor(CAPACITY, device="cpu")
t.resize_(BEFORE)
try:
    t.resize_(REQUEST)
except OutOfMemoryError as e:
    result = dict(type=type(e).__name__, op=e.op, code=e.code, requested=e.requested_bytes,
                  free=e.free_bytes, message=str(e))
else:
    result = dict(type="none")
result.update(after=[t.physical_bytes, list(t.segment_bytes), t.num_handles])
t.close()
"""


def _refused(capacity: int, before: int, request: int) -> dict[str, object]:
    body = (
        REFUSE.replace("CAPACITY", str(capacity))
        .replace("BEFORE", str(before))
        .replace("REQUEST", str(request))
    )
    return run_watched(body)


def _check_refusal(result: dict[str, object], requested: int, committed: int) -> None:
    assert result["type"] == "OutOfMemoryError", result
    assert (result["op"], result["code"]) == ("create", "ENOMEM"), result
    free = result["free"]
    assert isinstance(free, int) and 0 <= free < requested, result
    message = str(result["message"])
    assert str(requested) in message and f"{free} bytes free" in message, message
    # Unchanged: what was committed before, and nothing more was ever allocated.
    assert result["after"] == [committed, [committed], int(committed > 0)], result
    assert isinstance(result["peak_memfd_bytes"], int)
    assert result["peak_memfd_bytes"] <= committed, result


def test_the_issues_commit_of_32_tib_is_refused_not_killed() -> None:
    """The new user's command: `ExtensibleTensor(1 << 45, device="cpu").resize_(1 << 45)`."""
    result = _refused(1 << 45, 0, 1 << 45)
    _check_refusal(result, requested=1 << 45, committed=0)


def test_a_grow_just_past_mem_available_is_refused_and_keeps_what_was_committed() -> None:
    available, _ = _native.host_mem_info()
    granule = 2 << 20
    # More than MemAvailable by 1 GiB: the first 1 GiB handles would fit one by one.
    request = (available + (1 << 30)) // granule * granule + granule
    result = _refused(2 * request, granule, granule + request)
    _check_refusal(result, requested=request, committed=granule)


def test_commits_that_fit_still_succeed() -> None:
    body = """
    t = ExtensibleTensor(1 << 30, device="cpu")
    t.resize_(64 << 20)
    result = dict(physical=t.physical_bytes)
    t.close()
    """
    assert run_watched(body)["physical"] == 64 << 20
