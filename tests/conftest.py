"""Fixtures shared by the Python API tests.

Every test body runs once per backend through the `backend` fixture: `"cpu"` (the host
backend: mmap + memfd, always available) and `"cuda"` (CUDA VMM, skipped with the library's
own reason where unavailable). Sizes are written in units of the tensor's granularity `g`
(4096 bytes on cpu to keep tests small, the driver's default, 2 MiB on H100/H200, on cuda).
"""

from __future__ import annotations

import gc
import os
import sys
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import Any

import extensible_kv
import pytest
import stack_env
import vllm_env
from extensible_kv import ExtensibleTensor

CPU_GRANULARITY = 4096
MEMFD_TAG = "memfd:extensible-kv"
# The examples (`examples/decoder`) are the top-level packages their tests import.
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Skips fold by reason alone in the `-r s` summary: without a GPU every CUDA param skips
    for the same reason, and one line per test location (over 60) buried everything else."""
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
        report.longrepr = (str(Path(__file__).parent), None, reason)
    return report


def _cuda_skip_reason() -> str | None:
    return extensible_kv.vmm_unavailable_reason("cuda:0")


_CUDA_REASON = _cuda_skip_reason()

BACKENDS = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(_CUDA_REASON is not None, reason=_CUDA_REASON or ""),
        ],
    ),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """`"cpu"` or `"cuda"`."""
    return str(request.param)


@pytest.fixture
def device(backend: str) -> str:
    """The device string to construct tensors on: `cpu` or `cuda:0`."""
    return "cpu" if backend == "cpu" else "cuda:0"


def device_kwargs(backend: str) -> dict[str, Any]:
    """Constructor kwargs that pick the backend (and the small granularity on cpu)."""
    if backend == "cpu":
        return {"device": "cpu", "granularity": CPU_GRANULARITY}
    return {"device": "cuda:0"}


MakeTensor = Callable[..., ExtensibleTensor]


@pytest.fixture
def make_tensor(backend: str) -> Iterator[MakeTensor]:
    """`make_tensor(max_bytes, num_segments=1, **kw)` on the fixture's backend.

    The factory keeps only weak references, so a test may `del` a tensor to check that views
    outlive it; every tensor still alive at teardown is closed (a BufferError from a test
    that deliberately keeps views is ignored).
    """
    made: list[weakref.ref[ExtensibleTensor]] = []

    def make(max_bytes: int, num_segments: int | None = 1, **kw: Any) -> ExtensibleTensor:
        if kw.get("segment_capacities") is not None and num_segments == 1:
            num_segments = None  # the count comes from the capacities
        kwargs = {**device_kwargs(backend), **kw}
        t = ExtensibleTensor(max_bytes, num_segments, **kwargs)
        made.append(weakref.ref(t))
        return t

    yield make
    for ref in made:
        t = ref()
        if t is None:
            continue
        try:
            t.close()
        except BufferError:
            pass


@pytest.fixture
def g(make_tensor: MakeTensor) -> int:
    """The granularity tensors of this backend get from `make_tensor`."""
    probe = make_tensor(1)
    granularity = probe.granularity
    probe.close()
    return granularity


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


@pytest.fixture
def leak_check() -> Callable[[], tuple[int, int]]:
    """`memfd_counts`, for tests that compare before and after; collects garbage once first,
    so that views left in cycles by earlier tests do not die in the middle of this one."""
    gc.collect()
    return memfd_counts


@pytest.fixture(scope="session")
def vllm() -> Any:
    """vLLM 0.34.0, installed or vendored (`vllm_env`); skips with the reason where absent,
    fails instead where EKV_REQUIRE_VLLM is set (CI)."""
    stack_env.skip_or_fail(vllm_env.load(), "EKV_REQUIRE_VLLM")
    import vllm

    return vllm


@pytest.fixture(scope="session")
def vllm_plugin(vllm: Any) -> Any:
    """vLLM's own plugin loader has run, the way every vLLM process runs it: through our
    `vllm.general_plugins` entry point, vLLM's extensible KV cache now builds our tensor."""
    from extensible_kv.vllm import ExtensibleTensor as DropIn
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import vllm.v1.worker.extensible_kv_cache as module

    assert module.ExtensibleTensor is DropIn, (
        "the vllm.general_plugins entry point did not install extensible_kv.vllm "
        f"(VLLM_PLUGINS={os.environ.get('VLLM_PLUGINS')!r}; vLLM from {vllm_env.source()})"
    )
    return module


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
