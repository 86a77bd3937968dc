"""What the benchmark scripts share: units, the stderr log, timing around a device synchronize,
settling the allocator between runs, free memory, medians and the environment record.

The scripts run as `python3 benchmarks/X.py`, which puts this folder first on `sys.path`: they
import this module as `common`. torch is imported on first use, not here: `--help` needs none.
"""

from __future__ import annotations

import functools
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


def log(*args: object) -> None:
    """Progress on stderr, so that stdout holds only the report."""
    print(*args, file=sys.stderr, flush=True)


def _waiter(device: Any) -> Callable[[], object]:
    """What waits for the device's queued work: all of CUDA's when `device` is None, the CUDA
    device's, or nothing for a host device."""
    import torch

    if device is None:
        return torch.cuda.synchronize
    if device.type == "cuda":
        return functools.partial(torch.cuda.synchronize, device)
    return lambda: None


def sync(device: Any = None) -> None:
    """Waits for queued work (see `_waiter`)."""
    _waiter(device)()


def timed(fn: Callable[[], object], device: Any = None) -> float:
    """Seconds for `fn()` and a device synchronize, from a synchronized start."""
    wait = _waiter(device)  # resolved before the clock starts
    wait()
    start = time.perf_counter()
    fn()
    wait()
    return time.perf_counter() - start


def timed_ms(fn: Callable[[], Any], device: Any = None) -> tuple[float, Any]:
    """Milliseconds for `fn()` and a device synchronize, from a synchronized start, and what
    `fn` returned."""
    wait = _waiter(device)
    wait()
    start = time.perf_counter()
    result = fn()
    wait()
    return (time.perf_counter() - start) * 1e3, result


def settle(pause_s: float = 0.0, device: Any = None) -> None:
    """Frees what the last run left (garbage, torch's cached blocks) and waits `pause_s`
    seconds: the driver scrubs freed memory in the background, which a timed step that follows
    at once would pay for."""
    import torch

    gc.collect()
    sync(device)
    if device is None or device.type == "cuda":
        torch.cuda.empty_cache()
    if pause_s:
        time.sleep(pause_s)


def free_bytes(device: Any) -> int | None:
    """The CUDA device's free bytes (`cudaMemGetInfo`), None for a host device."""
    if device.type != "cuda":
        return None
    import torch

    return int(torch.cuda.mem_get_info(device)[0])


def driver_profile(tensor: Any, reset: bool = True) -> dict[str, list[float]]:
    """A `_profile=True` tensor's profile since its last reset, `{op: [calls, host ms]}`
    (`_profile_report`, which counts nanoseconds); with `reset`, counting starts again."""
    return {op: [n, ns / 1e6] for op, (n, ns) in tensor._profile_report(reset=reset).items()}


def driver_memset(ptr: int, num_bytes: int, stream: int = 0) -> None:
    """`cuMemsetD8Async(ptr, 0, num_bytes, stream)`: what ours zeroes with, and faster than
    torch's `zero_()` kernel on the H200 (4.5 against 3.4 TB/s), so the zeroing floor. Needs
    cuda-python (`cuda.bindings`, installed with torch's CUDA wheels); ImportError without."""
    from cuda.bindings import driver as cu

    (err,) = cu.cuMemsetD8Async(ptr, 0, num_bytes, stream)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemsetD8Async: {err.name}")


def child_json(command: list[str], what: str) -> dict[str, Any]:
    """Runs a bench's child process (a fresh process per repetition) and returns the JSON
    object on the last line of its stdout; `RuntimeError("<what> failed: <stderr tail>")` when
    it exits non-zero."""
    import subprocess

    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def median(values: Iterable[float]) -> float:
    """The median, NaN for no values (a contender that failed every repetition)."""
    values = list(values)
    return statistics.median(values) if values else float("nan")


def environment(device: Any = None, **extra: Any) -> dict[str, Any]:
    """What a result depends on: torch, Python, which extensible_kv ran, `extra`, and the CUDA
    device's name and memory (`device`, or device 0 when None)."""
    import extensible_kv
    import torch

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "extensible_kv": extensible_kv.__file__,
        **extra,
    }
    if device is None or device.type == "cuda":
        props = torch.cuda.get_device_properties(0 if device is None else device)
        env.update(device=props.name, total_memory_gib=props.total_memory / GIB)
    return env
