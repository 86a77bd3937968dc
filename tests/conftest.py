"""Fixtures shared by the Python API tests, and the `gpu` marker's skip.

Every test body that takes the `device` fixture runs once per device of `support.devices`:
`"cpu"` (the host backend: mmap + memfd, always available) and `"cuda:0"` (CUDA VMM). A test
marked `gpu` (that param, or a GPU-only test) is skipped with the reason where CUDA is
unusable. Sizes are written in units of the tensor's granularity `g` (4096 bytes on cpu to
keep tests small, the driver's default, 2 MiB on H100/H200, on cuda). Helper modules live in
`tests/support/`.
"""

from __future__ import annotations

import gc
import os
import sys
import weakref
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
from extensible_kv import ExtensibleTensor
from support import stack_env, vllm_env
from support.devices import DEVICES, cuda_reason, device_kwargs
from support.kv_helpers import MakeCache, cache_factory
from support.memory import MakeTensor, memfd_counts

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


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """`EKV_INSTAFAIL=1` prints a failure's traceback when it happens: on the device a step's
    time limit may kill the run before pytest's summary."""
    if report.failed and os.environ.get("EKV_INSTAFAIL"):
        print(f"\n=== {report.nodeid} ({report.when})\n{report.longreprtext}", flush=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The one CUDA skip: a test marked `gpu` (`gpu(devices=N)`: N devices) is skipped with the
    reason where CUDA cannot run it, so no test module restates the check."""
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        reason = cuda_reason(int(marker.kwargs.get("devices", 1)))
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The device a backend-parametrised test runs on: `"cpu"` (the host backend) or
    `"cuda:0"` (the CUDA backend, marked `gpu`)."""
    return str(request.param)


@pytest.fixture
def make_tensor(device: str) -> Iterator[MakeTensor]:
    """`make_tensor(max_bytes, num_segments=1, **kw)` on the fixture's device.

    The factory keeps only weak references, so a test may `del` a tensor to check that views
    outlive it; every tensor still alive at teardown is closed (a BufferError from a test
    that deliberately keeps views is ignored).
    """
    made: list[weakref.ref[ExtensibleTensor]] = []

    def make(max_bytes: int, num_segments: int | None = 1, **kw: Any) -> ExtensibleTensor:
        if kw.get("segment_capacities") is not None and num_segments == 1:
            num_segments = None  # the count comes from the capacities
        kwargs = {**device_kwargs(device), **kw}
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
    """The granularity tensors on this device get from `make_tensor`."""
    probe = make_tensor(1)
    granularity = probe.granularity
    probe.close()
    return granularity


@pytest.fixture
def make_cache(device: str) -> Iterator[MakeCache]:
    """`make_cache(spec, capacity_blocks, **kw)`: an `ExtensibleKVCache` on the fixture's
    device (`support.kv_helpers.cache_factory`), closed at teardown. A module whose caches
    live on the host backend alone overrides `device`."""
    yield from cache_factory(device)


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
