"""`extensible_kv.vllm.ExtensibleTensor`, the drop-in for vLLM 0.34's class, on its own (no
vLLM needed): vLLM's API, defaults and error wording, and where it is safer (free with live
views, out of memory, the RDMA contract). Sizes are in units of the drop-in's granule (2 MiB
on both backends, as vLLM floors it)."""

from __future__ import annotations

import gc
import resource
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import extensible_kv
import pytest
import torch
from extensible_kv import ClosedError, OutOfMemoryError, UnsupportedError
from extensible_kv.vllm import HANDLES_ENV_VAR, ExtensibleTensor, granule_size
from extensible_kv.vllm import tensor as dropin_module
from support.devices import DEVICES
from support.memory import containing_mapping

MIB = 1 << 20
G = 2 * MIB  # the host backend's granule, for the tests that run there only
# For tests that only mean something on a GPU: the `device` fixture's CUDA param alone.
CUDA_ONLY = pytest.mark.parametrize("device", [DEVICES[1]])


@pytest.fixture
def dev(device: str) -> torch.device:
    return torch.device(device)


@pytest.fixture
def make(dev: torch.device) -> Iterator[Callable[..., ExtensibleTensor]]:
    """`make(max_num_bytes, **kw)` on the test's device; every tensor is freed at teardown."""
    made: list[ExtensibleTensor] = []

    def build(max_num_bytes: int, **kw: Any) -> ExtensibleTensor:
        t = ExtensibleTensor(max_num_bytes, device=dev, **kw)
        made.append(t)
        return t

    yield build
    for t in made:
        t.free()


@pytest.fixture
def g(dev: torch.device) -> int:
    return granule_size(dev)


def state(t: ExtensibleTensor) -> tuple[Any, ...]:
    return (t.num_bytes, t._committed(), t.physical_bytes, t.num_physical_chunks)


# ---- construction


def test_defaults_and_properties(make: Callable[..., ExtensibleTensor], dev: torch.device, g: int):
    t = make(4 * g + 100)
    assert t.num_segments == 1
    assert t.segment_capacities == [4 * g + 100]
    assert t.segment_capacity_bytes == 4 * g + 100
    assert t.segment_offsets == [0]
    assert t.capacity_bytes == 5 * g  # the reservation: whole granules, as vLLM's
    assert (t.num_bytes, t.bytes_per_segment, t.physical_bytes, t.num_physical_chunks) == (
        0,
        0,
        0,
        0,
    )
    assert t.granularity == g == granule_size(dev)
    assert t.device == dev
    assert t.base_ptr != 0 and t.base_ptr % g == 0
    t.segment_capacities.append(1)  # lists are copies
    t.segment_offsets.append(1)
    assert t.segment_capacities == [4 * g + 100] and t.segment_offsets == [0]


def test_segments(make: Callable[..., ExtensibleTensor], g: int) -> None:
    t = make(6 * g, num_segments=3)
    assert t.segment_capacities == [2 * g] * 3
    assert t.segment_offsets == [0, 2 * g, 4 * g]
    u = make(5 * g, segment_capacities=[g, 3 * g, g])
    assert u.num_segments == 3
    assert u.segment_offsets == [0, g, 4 * g]
    with pytest.raises(ValueError, match=r"^Segments differ: \[1, 3, 1\]\.$"):
        _ = ExtensibleTensor._uniform([1, 3, 1])
    with pytest.raises(ValueError, match="Segments differ"):
        _ = u.segment_capacity_bytes
    u.resize_segments_([10, 20, 30])
    assert u.num_bytes == 60
    with pytest.raises(ValueError, match=r"^Segments differ: \[10, 20, 30\]\.$"):
        _ = u.bytes_per_segment


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((-1,), {}, "max_num_bytes must be non-negative."),
        ((10,), {"num_segments": 0}, "num_segments must be positive, got 0."),
        ((10,), {"num_segments": 3}, "max_num_bytes (10) must be divisible by num_segments (3)."),
        ((10,), {"segment_capacities": []}, "segment_capacities must be non-empty and positive."),
        ((10,), {"segment_capacities": [10, 0]}, "segment_capacities must be non-empty and "),
        ((10,), {"segment_capacities": [4, 5]}, "segment_capacities sum to 9, not max_num_bytes"),
        ((0,), {}, "max_num_bytes must be positive: extensible-kv reserves no empty"),
    ],
)
def test_constructor_errors_use_vllms_wording(
    dev: torch.device, args: tuple[int], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        ExtensibleTensor(*args, device=dev, **kwargs)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("handle_types", [1, 9])
def test_export_handle_types_make_the_memory_shareable(
    dev: torch.device, make: Callable[..., ExtensibleTensor], handle_types: int
) -> None:
    t = make(4 << 20, num_segments=2, export_handle_types=handle_types)
    t.resize_per_segment_(1 << 20)
    core = t._open()
    # Both asked: fabric alone where the device has it (as vLLM), fds otherwise.
    assert core.export_handle_types in (1, 8)
    description = core.share()
    assert len(description.handles) == t.num_physical_chunks
    imported = extensible_kv.ExtensibleTensor.from_shared(description)
    assert imported.segment_bytes == core.segment_bytes
    imported.close()
    t.free()
    with pytest.raises(UnsupportedError, match="only POSIX fd"):
        ExtensibleTensor(1 << 20, device=dev, export_handle_types=2)


def test_shrink_and_consolidate_keep_the_contents(
    make: Callable[..., ExtensibleTensor], g: int
) -> None:
    t = make(2 * 8 * g, num_segments=2)
    for n in (1, 3, 7):
        t.resize_per_segment_(n * g, zero_new=True)
    for i in range(2):
        t.segment_view(i).fill_(i + 1)
    assert not all(t.segments_backed_by_one_chunk([7 * g, 7 * g]))
    t.consolidate()
    assert all(t.segments_backed_by_one_chunk([7 * g, 7 * g]))
    t.shrink_segments_([2 * g + 5, 3 * g])
    assert t.physical_bytes == 6 * g
    assert [bool(t.segment_view(i).eq(i + 1).all()) for i in range(2)] == [True, True]
    with pytest.raises(ValueError, match="Expected 2 sizes"):
        t.shrink_segments_([0])
    t.free()


def test_devices() -> None:
    assert ExtensibleTensor(1, device="cpu").device == torch.device("cpu")
    assert ExtensibleTensor(1, device=torch.device("cpu")).device == torch.device("cpu")
    for bad in ("meta", torch.device("meta")):
        with pytest.raises(ValueError, match="requires a cuda device, got meta"):
            ExtensibleTensor(1, device=bad)


def test_device_none_is_the_current_cuda_device() -> None:
    reason = extensible_kv.vmm_unavailable_reason("cuda:0")
    if reason is not None:
        with pytest.raises(UnsupportedError):
            ExtensibleTensor(1)
        return
    for device in (None, "cuda", 0):
        t = ExtensibleTensor(1, device=device)
        assert t.device == torch.device("cuda", torch.cuda.current_device())
        t.free()


def test_granule_size(dev: torch.device) -> None:
    probe = extensible_kv.ExtensibleTensor(1, 1, device=str(dev))
    driver = probe.granularity
    probe.close()
    expected = -(-max(driver, 2 * MIB) // driver) * driver
    assert granule_size(dev) == expected
    assert granule_size(str(dev)) == expected
    if dev.type == "cuda":
        assert granule_size(dev.index) == expected  # vLLM passes the index


# ---- views and grows


def test_views(make: Callable[..., ExtensibleTensor], dev: torch.device, g: int) -> None:
    t = make(3 * g, num_segments=3)
    full = t.full_view()
    assert (full.dtype, full.shape, full.device) == (torch.uint8, (3 * g,), dev)
    assert full.data_ptr() == t.base_ptr
    assert t.segment_view(1).shape == (0,)
    t.resize_per_segment_(1000, zero_new=True)
    for i in range(3):
        view = t.segment_view(i)
        assert view.untyped_storage().nbytes() == 1000
        assert view.data_ptr() == t.base_ptr + i * g
        view.fill_(i + 1)
    assert [int(full[i * g + 999]) for i in range(3)] == [1, 2, 3]
    for bad in (3, -1):
        with pytest.raises(IndexError, match=rf"^Segment {bad} out of range \(3\)\.$"):
            t.segment_view(bad)


def test_bad_resizes_leave_the_tensor_unchanged(make: Callable[..., ExtensibleTensor], g: int):
    t = make(4 * g, num_segments=2)
    t.resize_per_segment_(g + 5)
    before = state(t)
    cases: list[tuple[list[int], str]] = [
        (
            [g, g + 5],
            f"^ExtensibleTensor is grow-only: cannot resize from {g + 5} to {g} bytes per "
            "segment.$",
        ),
        ([g + 5, 2 * g + 1], f"^Requested {2 * g + 1} bytes per segment exceeds the segment "),
        ([g + 5], "^Expected 2 sizes, got 1.$"),
        ([g + 5, -1], "grow-only"),
    ]
    for sizes, message in cases:
        with pytest.raises(ValueError, match=message):
            t.resize_segments_(sizes)
        assert state(t) == before
    with pytest.raises(ValueError, match="grow-only"):
        t.resize_per_segment_(g)
    assert state(t) == before
    assert t.resize_segments_([g + 5, g + 5]) is None  # at the count: a no-op
    assert state(t) == before


def test_zero_new_defaults_to_false(make: Callable[..., ExtensibleTensor], g: int) -> None:
    """vLLM's default: new bytes keep whatever the memory held. The bytes past the committed
    prefix inside an already-mapped granule show it on every backend."""
    t = make(2 * g)
    t.resize_per_segment_(100)
    full = t.full_view()
    full[:300].fill_(7)  # 100..300: mapped (same granule), not committed
    t.resize_per_segment_(200)
    assert int(torch.count_nonzero(full[100:200] == 7)) == 100
    t.resize_per_segment_(300, zero_new=True)
    assert int(torch.count_nonzero(full[200:300])) == 0
    assert int(torch.count_nonzero(full[:200] == 7)) == 200
    t.resize_per_segment_(g + 10, zero_new=True)  # and across fresh granules
    assert int(torch.count_nonzero(full[300 : g + 10])) == 0
    assert int(torch.count_nonzero(full[:200] == 7)) == 200


def test_views_outlive_the_tensor_object(dev: torch.device, g: int) -> None:
    t = ExtensibleTensor(2 * g, device=dev)
    t.resize_per_segment_(g, zero_new=True)
    view = t.segment_view(0)
    view[:10].fill_(3)
    del t
    gc.collect()
    view[10:20].fill_(4)  # vLLM's views would dangle here
    assert view[:20].tolist() == [3] * 10 + [4] * 10


# ---- the RDMA contract


def test_segments_backed_by_one_chunk(make: Callable[..., ExtensibleTensor], g: int) -> None:
    t = make(12 * g, num_segments=4)
    t.resize_per_segment_(1)
    assert t.num_physical_chunks == 4
    assert t.segments_backed_by_one_chunk([1] * 4) == [True] * 4
    assert t.segments_backed_by_one_chunk([g, g + 1, 0, g]) == [True, False, True, True]
    t.resize_per_segment_(3 * g - 1)  # incremental: a second handle per segment
    assert t.num_physical_chunks > 4
    assert not all(t.segments_backed_by_one_chunk([3 * g - 1] * 4))

    t.release_physical()
    assert (t.num_bytes, t.physical_bytes, t.num_physical_chunks) == (0, 0, 0)
    assert t.segments_backed_by_one_chunk([0] * 4) == [False] * 4  # vLLM's: no chunk at all
    t.resize_per_segment_(2 * g)  # from empty: one allocation per run
    assert t.num_physical_chunks == 4
    assert t.segments_backed_by_one_chunk([2 * g] * 4) == [True] * 4
    t.resize_per_segment_(3 * g)  # the third granules: a handle each, after the runs
    assert t.segments_backed_by_one_chunk([2 * g] * 4) == [True] * 4
    assert not all(t.segments_backed_by_one_chunk([3 * g] * 4))
    t.release_physical()
    t.resize_per_segment_(3 * g)  # one run over all four segments: one allocation
    assert t.num_physical_chunks == 1
    assert t.segments_backed_by_one_chunk([3 * g] * 4) == [True] * 4


@pytest.mark.parametrize(
    ("cut", "chunks"),
    [(None, 8), ("cap_aligned", 8), ("whole_runs", 8), ("aligned_powers_of_two", 10)],
)
def test_handle_cut_of_later_grows(
    make: Callable[..., ExtensibleTensor],
    g: int,
    monkeypatch: pytest.MonkeyPatch,
    cut: str | None,
    chunks: int,
) -> None:
    """Four segments of 3 granules, grown to 1 byte (a handle each: from empty), then to all
    but a byte: the second grow's runs (granules 1-2, 4-5, 7-8, 10-11) are cut by the chosen
    cut; aligned powers of two split the runs that start on an odd granule."""
    if cut is None:
        monkeypatch.delenv(HANDLES_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(HANDLES_ENV_VAR, cut)
    t = make(12 * g, num_segments=4)
    t.resize_per_segment_(1)
    t.resize_per_segment_(3 * g - 1, zero_new=True)
    assert t.num_physical_chunks == chunks
    assert int(torch.count_nonzero(t.full_view()[1 : 3 * g - 1])) == 0
    monkeypatch.setenv(HANDLES_ENV_VAR, "huge")
    with pytest.raises(ValueError, match="EXTENSIBLE_KV_VLLM_HANDLES='huge'"):
        make(g)


@CUDA_ONLY
def test_rdma_contract_beyond_the_handle_cap(make: Callable[..., ExtensibleTensor]) -> None:
    """Segments larger than the default cap (`cap_aligned`, 1 GiB): each still one allocation."""
    gib = 1 << 30
    t = make(12 * gib, num_segments=4)
    t.resize_per_segment_(1 << 20)
    t.resize_per_segment_(2 * gib + (6 << 20))
    assert not all(t.segments_backed_by_one_chunk([2 * gib + (6 << 20)] * 4))
    t.release_physical()
    t.resize_per_segment_(2 * gib + (6 << 20), zero_new=True)
    assert t.num_physical_chunks == 4
    assert all(t.segments_backed_by_one_chunk([2 * gib + (6 << 20)] * 4))
    assert int(torch.count_nonzero(t.segment_view(3))) == 0


# ---- free


def test_free(make: Callable[..., ExtensibleTensor], dev: torch.device, g: int) -> None:
    t = make(6 * g, num_segments=2)
    t.resize_per_segment_(g + 1, zero_new=True)
    views = [t.full_view(), t.segment_view(0), t.segment_view(1)]
    base = t.base_ptr
    t.free()
    t.free()  # idempotent
    assert (t.num_bytes, t.bytes_per_segment, t.physical_bytes, t.num_physical_chunks) == (
        0,
        0,
        0,
        0,
    )
    assert t.base_ptr == 0
    assert (t.capacity_bytes, t.segment_capacities, t.granularity) == (6 * g, [3 * g] * 2, g)
    t.release_physical()  # as vLLM's: nothing to release
    assert t.segments_backed_by_one_chunk([1, 1]) == [False, False]
    for call in (t.full_view, lambda: t.segment_view(0), lambda: t.resize_per_segment_(g + 2)):
        with pytest.raises(ClosedError):
            call()
    assert issubclass(ClosedError, ValueError)
    # While views live, the range is nobody else's.
    others = [ExtensibleTensor(6 * g, device=dev) for _ in range(3)]
    for other in others:
        assert not base <= other.base_ptr < base + 6 * g
        other.free()
    assert views[0].data_ptr() == base


def test_free_returns_memory_now_and_the_range_with_the_last_view(
    leak_check: Callable[[], tuple[int, int]],
) -> None:
    g = G
    before = leak_check()
    t = ExtensibleTensor(4 * g, device="cpu")
    t.resize_per_segment_(3 * g)
    view = t.full_view()
    base = t.base_ptr
    assert leak_check() != before
    t.free()
    assert leak_check() == before  # physical memory: returned at once
    assert containing_mapping(base) == "---p"  # the range: reserved, inaccessible
    del view
    gc.collect()
    assert containing_mapping(base) is None  # gone with the last view


def test_a_stale_view_faults_instead_of_aliasing() -> None:
    """On the host backend, touching a view after free() is a SIGSEGV (on CUDA, an illegal
    address), never a write into memory mapped there later."""
    script = textwrap.dedent(
        """
        from extensible_kv.vllm import ExtensibleTensor
        t = ExtensibleTensor(4 << 20, device="cpu")
        t.resize_per_segment_(1 << 20, zero_new=True)
        view = t.full_view()
        view[0] = 1
        t.free()
        print("freed", flush=True)
        view[0] = 2
        print("wrote", flush=True)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.split() == ["freed"], result.stdout + result.stderr
    assert result.returncode == -signal.SIGSEGV


# ---- out of memory


class _FileSizeLimit:
    """Makes every host-backend allocation above `limit` bytes fail with a real OOM: the
    backend `fallocate`s its memfds, which RLIMIT_FSIZE caps (EFBIG; SIGXFSZ ignored)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.saved = resource.getrlimit(resource.RLIMIT_FSIZE)
        self.handler: Any = None

    def __enter__(self) -> _FileSizeLimit:
        self.handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.saved[1]))
        return self

    def lift(self) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, self.saved)

    def __exit__(self, *exc: object) -> None:
        self.lift()
        signal.signal(signal.SIGXFSZ, self.handler)


def test_out_of_memory_retries_once_then_raises_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    g = G
    t = ExtensibleTensor(8 * g, device="cpu", num_segments=2)
    t.resize_per_segment_(g // 2, zero_new=True)
    t.segment_view(0)[:10].fill_(9)
    before = state(t)
    emptied: list[torch.device] = []
    monkeypatch.setattr(dropin_module, "_empty_torch_cache", emptied.append)
    with _FileSizeLimit(g // 2), pytest.raises(OutOfMemoryError) as info:
        t.resize_per_segment_(3 * g, zero_new=True)
    assert isinstance(info.value, MemoryError)
    assert emptied == [torch.device("cpu")]  # one retry, after emptying torch's cache
    assert state(t) == before
    assert t.segment_view(0)[:10].tolist() == [9] * 10
    t.resize_per_segment_(3 * g, zero_new=True)  # memory back: the same grow works
    assert t.bytes_per_segment == 3 * g
    t.free()


def test_out_of_memory_then_the_retry_succeeds(monkeypatch: pytest.MonkeyPatch) -> None:
    g = G
    t = ExtensibleTensor(8 * g, device="cpu")
    with _FileSizeLimit(g // 2) as limit:
        # What torch's cache would do: hand memory back, so that the retry succeeds.
        monkeypatch.setattr(dropin_module, "_empty_torch_cache", lambda device: limit.lift())
        t.resize_per_segment_(3 * g, zero_new=True)
    assert (t.bytes_per_segment, t.physical_bytes) == (3 * g, 3 * g)
    assert int(torch.count_nonzero(t.segment_view(0))) == 0
    t.free()


@CUDA_ONLY
def test_out_of_memory_on_the_device(
    make: Callable[..., ExtensibleTensor], dev: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    total = torch.cuda.mem_get_info(dev)[1]
    t = make(2 * total)
    t.resize_per_segment_(1 << 20)
    before = state(t)
    emptied: list[torch.device] = []
    real = dropin_module._empty_torch_cache
    monkeypatch.setattr(dropin_module, "_empty_torch_cache", lambda d: (emptied.append(d), real(d)))
    with pytest.raises(OutOfMemoryError):
        t.resize_per_segment_(total + (1 << 30))
    assert emptied == [dev]
    assert state(t) == before
