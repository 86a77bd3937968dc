"""CUDA-only behaviour: what the backend-parametrised tests (test_tensor.py) cannot observe.

Free device memory as the driver reports it, CUDA graphs captured before the memory they
touch is committed, stream-ordered zeroing, views outliving their owner, low-precision dtypes.
Every test is marked `gpu` and skipped, with the library's own reason, where CUDA's VMM API
is unavailable. Sizes stay at a few hundred MiB, except the 1 GiB of the memory check.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from extensible_kv import ExtensibleTensor

MIB = 1 << 20
GIB = 1 << 30
DEVICE = "cuda:0"
# Free memory moves by a few MiB for reasons of the driver's own (page tables, lazily loaded
# kernels); the commits checked here are hundreds of MiB and more.
TOLERANCE = 16 * MIB
# torch.cuda._sleep spins this many GPU cycles: ~50 ms at the H200's ~2 GHz, ages for a host
# that maps a few granules meanwhile.
SLEEP_CYCLES = 100_000_000


pytestmark = pytest.mark.gpu

MakeTensor = Callable[..., ExtensibleTensor]


@pytest.fixture
def make() -> Iterator[MakeTensor]:
    """`make(max_bytes, num_segments=1, **kw)` on cuda:0; closes what is left at teardown."""
    made: list[weakref.ref[ExtensibleTensor]] = []

    def factory(max_bytes: int, num_segments: int = 1, **kw: Any) -> ExtensibleTensor:
        t = ExtensibleTensor(max_bytes, num_segments, device=DEVICE, **kw)
        made.append(weakref.ref(t))
        return t

    yield factory
    gc.collect()
    torch.cuda.synchronize()
    for ref in made:
        t = ref()
        if t is not None:
            try:
                t.close()
            except BufferError:  # a failed test may still hold views in its traceback
                pass
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def g() -> int:
    """The driver's granularity on cuda:0 (2 MiB on Hopper)."""
    probe = ExtensibleTensor(1, 1, device=DEVICE)
    granularity = probe.granularity
    probe.close()
    return granularity


def pattern(n: int, seed: int) -> torch.Tensor:
    """`n` deterministic non-zero bytes on the device, different for different seeds."""
    values = (torch.arange(n, dtype=torch.int64) * 31 + seed * 7) % 251 + 1
    return values.to(torch.uint8).to(DEVICE)


def free_bytes() -> int:
    """Free device memory per torch (cudaMemGetInfo), after a garbage collection (so that
    tensors earlier tests left in cycles do not die mid-measurement) and with torch's cache
    emptied."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info(0)[0])


def cu_free_bytes() -> int | None:
    """Free device memory per the driver API (cuda-bindings), or None without cuda-bindings."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    err, free, _total = cu.cuMemGetInfo()
    assert err == cu.CUresult.CUDA_SUCCESS, f"cuMemGetInfo failed: {err}"
    return int(free)


def settle(target: int, read: Callable[[], int | None], timeout_s: float = 10.0) -> int | None:
    """`read()` once it is within TOLERANCE of `target`, or its last value after `timeout_s`:
    the driver scrubs released memory in the background before it counts as free again."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if value is None or abs(value - target) <= TOLERANCE or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def warm_up_kernels() -> None:
    """Loads the kernels the memory checks use, so lazy module loading does not move free
    memory in the middle of a measurement."""
    for dtype in (torch.uint8, torch.int32):
        x = torch.ones(1 << 20, dtype=dtype, device=DEVICE)
        x.fill_(3)
        assert int(x.sum()) == 3 << 20
        assert bool((x == 3).all())
    del x
    torch.cuda.synchronize()


def assert_close_to(actual: int | None, expected: int, what: str) -> None:
    if actual is None:
        return
    assert abs(actual - expected) <= TOLERANCE, (
        f"{what}: {actual / MIB:.1f} MiB, expected {expected / MIB:.1f} MiB "
        f"(± {TOLERANCE // MIB} MiB)"
    )


# --------------------------------------------------------------------------------------------
# physical memory, as the driver reports it


def test_free_memory_follows_commit_release_and_close(make: MakeTensor, g: int) -> None:
    warm_up_kernels()
    f0, c0 = free_bytes(), cu_free_bytes()
    t = make(2 * GIB, 2)
    assert_close_to(f0 - free_bytes(), 0, "memory used by a bare reservation")

    # Half a segment and one byte: the last granule of each segment is partly committed.
    t.resize_per_segment_(GIB // 2 + 1)
    expected = 2 * (GIB // 2 + g)
    assert t.physical_bytes == expected
    f1, c1 = free_bytes(), cu_free_bytes()
    assert_close_to(f0 - f1, expected, "memory used after the commit (torch)")
    if c0 is not None and c1 is not None:
        assert_close_to(c0 - c1, expected, "memory used after the commit (cuMemGetInfo)")

    t.release_physical()
    # Stream-ordered: counted until the release thread gave it back, once the stream passed.
    assert t.physical_bytes + t.pending_release_bytes >= expected or t.physical_bytes == 0
    assert t.wait_released(timeout=30)
    assert (t.physical_bytes, t.pending_release_bytes) == (0, 0)
    assert_close_to(settle(f0, free_bytes), f0, "free memory after release_physical (torch)")
    if c0 is not None:
        assert_close_to(settle(c0, cu_free_bytes), c0, "after release_physical (cuMemGetInfo)")

    t.resize_per_segment_(GIB)  # the whole capacity, again
    assert t.physical_bytes == 2 * GIB
    assert_close_to(f0 - free_bytes(), 2 * GIB, "memory used after the second commit")

    t.close()
    assert_close_to(settle(f0, free_bytes), f0, "free memory after close (torch)")
    if c0 is not None:
        assert_close_to(settle(c0, cu_free_bytes), c0, "free memory after close (cuMemGetInfo)")


# --------------------------------------------------------------------------------------------
# CUDA graphs


def test_graph_captured_before_commit_replays_into_new_memory(make: MakeTensor, g: int) -> None:
    cap = 8 * g  # bytes per segment
    t = make(2 * cap, 2)
    assert t.segment_offsets == (0, cap)
    block = 4096  # the first commit, per segment: far less than a granule
    t.resize_per_segment_(block)

    n, row = cap // 4, 64  # float32 elements per segment; floats per row of the row views
    # Views over the whole capacity, made while one block is committed: the graph captures
    # their addresses, which never move.
    kv = t.view(torch.float32, (2, n))
    k = t.view(torch.float32, (n // row, row), offset=t.segment_offsets[0])
    v = t.view(torch.float32, (n // row, row), (row, 1), t.segment_offsets[1])
    # The same computation on plain torch memory, aliased the same way.
    ref = torch.zeros(2 * n, dtype=torch.float32, device=DEVICE)
    ref_kv, ref_k, ref_v = ref.view(2, n), ref[:n].view(n // row, row), ref[n:].view(-1, row)

    gen = torch.Generator().manual_seed(0)

    def distinct(lo: int, hi: int, count: int) -> torch.Tensor:
        return (torch.randperm(hi - lo, generator=gen)[:count] + lo).to(DEVICE)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE)

    # Static inputs of the graph: in the committed block while capturing.
    m, mr = 256, 8
    idx, idx2 = distinct(0, block // 4, m), distinct(0, block // 4, m)
    ridx, ridx2 = distinct(0, block // 4 // row, mr), distinct(0, block // 4 // row, mr)
    src, rsrc = randn(2, m), randn(2, mr, row)
    out, rout = torch.empty(2, m, device=DEVICE), torch.empty(mr, row, device=DEVICE)
    ref_out, ref_rout = torch.empty_like(out), torch.empty_like(rout)

    def step(
        kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, rout: torch.Tensor
    ) -> None:
        kv.index_copy_(1, idx, src)  # scattered elements of both segments
        k.index_copy_(0, ridx, rsrc[0])  # whole rows, per segment
        v.index_copy_(0, ridx, rsrc[1])
        out.copy_(kv.index_select(1, idx2) * 2)
        rout.copy_(k.index_select(0, ridx2) + v.index_select(0, ridx2))

    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch's recipe asks
        for _ in range(3):
            step(kv, k, v, out, rout)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        step(ref_kv, ref_k, ref_v, ref_out, ref_rout)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(kv, k, v, out, rout)
    torch.cuda.synchronize()
    assert torch.equal(kv[:, : block // 4], ref_kv[:, : block // 4])
    pointers = (kv.data_ptr(), k.data_ptr(), v.data_ptr())

    t.resize_per_segment_(cap)  # after capture, outside it: commit the whole capacity
    assert t.segment_bytes == (cap, cap)
    assert (kv.data_ptr(), k.data_ptr(), v.data_ptr()) == pointers

    first_new = g // 4  # the first element of the second granule: memory mapped after capture
    for lo in (first_new, 0):  # only new memory, then anywhere in the capacity
        fresh = distinct(lo, n, m)
        idx.copy_(fresh)
        idx2.copy_(torch.cat([fresh[: m // 2], distinct(lo, n, m - m // 2)]))
        rfresh = distinct(lo // row, n // row, mr)
        ridx.copy_(rfresh)
        ridx2.copy_(torch.cat([rfresh[: mr // 2], distinct(lo // row, n // row, mr - mr // 2)]))
        src.copy_(randn(2, m))
        rsrc.copy_(randn(2, mr, row))
        graph.replay()
        step(ref_kv, ref_k, ref_v, ref_out, ref_rout)
        torch.cuda.synchronize()
        assert torch.equal(out, ref_out)
        assert torch.equal(rout, ref_rout)
        assert torch.equal(kv, ref_kv)
        assert bool(kv[:, idx].ne(0).all())  # the writes did land in the new memory
    del graph


# --------------------------------------------------------------------------------------------
# zeroing, ordered on a stream


@pytest.mark.parametrize("how", ["explicit", "current"])
def test_zero_new_is_ordered_on_the_stream(make: MakeTensor, g: int, how: str) -> None:
    cap = 8 * g
    t = make(2 * cap, 2)
    old, new = g + g // 2 + 12, 5 * g + 100
    t.resize_per_segment_(old)
    full = t.full_view()
    patterns = [pattern(old, i) for i in range(2)]
    junk = torch.full((2 * g - old,), 0xCD, dtype=torch.uint8, device=DEVICE)
    torch.cuda.synchronize()

    s = torch.cuda.Stream()  # torch's streams do not wait for the legacy default stream
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)  # keeps s busy while the host queues the rest
        for i, base in enumerate(t.segment_offsets):
            full[base : base + old].copy_(patterns[i])
            # Mapped but not committed: exactly what the grow's memset must clear, which it
            # does only if it runs after these writes, i.e. on s.
            full[base + old : base + 2 * g].copy_(junk)
        if how == "current":
            t.resize_per_segment_(new, zero_new=True)  # stream=None: torch's current stream, s
    if how == "explicit":
        t.resize_per_segment_(new, zero_new=True, stream=s.cuda_stream)  # current: default
    torch.cuda.synchronize()

    assert t.segment_bytes == (new, new)
    for i, base in enumerate(t.segment_offsets):
        assert torch.equal(full[base : base + old], patterns[i]), "committed bytes changed"
        assert int(full[base + old : base + new].count_nonzero()) == 0, "new bytes not zero"


@pytest.mark.parametrize("zero_new", [True, False])
def test_in_granule_grow_zeroes_exactly_the_new_bytes(
    make: MakeTensor, g: int, zero_new: bool
) -> None:
    t = make(2 * 4 * g, 2)
    old, new = 1000, g // 2 + 3
    t.resize_per_segment_(old)
    before = (t.physical_bytes, t.num_handles, t.handle_runs())
    full = t.full_view()
    for i, base in enumerate(t.segment_offsets):
        full[base : base + old].copy_(pattern(old, i))
        full[base + old : base + g].fill_(0xEE)  # past the committed prefix, same granule
    t.resize_per_segment_(new, zero_new=zero_new)
    torch.cuda.synchronize()
    assert (t.physical_bytes, t.num_handles, t.handle_runs()) == before  # nothing mapped
    for i, base in enumerate(t.segment_offsets):
        assert torch.equal(full[base : base + old], pattern(old, i))
        grown = full[base + old : base + new]
        if zero_new:
            assert int(grown.count_nonzero()) == 0
        else:
            assert bool((grown == 0xEE).all())
        assert bool((full[base + new : base + g] == 0xEE).all()), "bytes past new were touched"


# --------------------------------------------------------------------------------------------
# lifetimes


def test_views_outlive_the_tensor(g: int) -> None:
    size = 256 * MIB
    warm_up_kernels()
    f0 = free_bytes()
    t = ExtensibleTensor(2 * size, 2, device=DEVICE)
    t.resize_per_segment_(size)
    v = t.segment_view(0)
    w = t.segment_view(1, torch.int32)
    owner = weakref.ref(t)
    del t
    gc.collect()
    assert owner() is None  # the Python object is gone; the memory is not

    v.fill_(3)
    w.fill_(-1)
    torch.cuda.synchronize()
    assert int(v.sum()) == 3 * size
    assert int(w.sum()) == -(size // 4)
    assert_close_to(f0 - free_bytes(), 2 * size, "memory held by the views")

    del v
    gc.collect()
    torch.cuda.synchronize()
    assert bool((w == -1).all())  # the last view keeps the reservation alive
    del w
    gc.collect()
    assert_close_to(settle(f0, free_bytes), f0, "free memory after the last view died")


# --------------------------------------------------------------------------------------------
# low-precision dtypes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_low_precision_views_round_trip(make: MakeTensor, g: int, dtype: torch.dtype) -> None:
    cap = 4 * g
    t = make(2 * cap, 2)
    committed = g + 256
    t.resize_per_segment_(committed)
    item = torch.empty((), dtype=dtype).element_size()
    n = committed // item
    capacity_view = t.view(dtype, (2, cap // item))
    gen = torch.Generator().manual_seed(1)
    sources = []
    for i in range(2):
        src = (torch.randn(n, generator=gen) * 4).to(DEVICE).to(dtype)
        sources.append(src)
        seg = t.segment_view(i, dtype)
        assert (seg.dtype, tuple(seg.shape), seg.device) == (dtype, (n,), torch.device(DEVICE))
        seg.copy_(src)
        torch.cuda.synchronize()
        assert torch.equal(seg.view(torch.uint8), src.view(torch.uint8))
        assert torch.equal(capacity_view[i, :n].view(torch.uint8), src.view(torch.uint8))
        assert torch.equal(seg.float(), src.float())  # kernels read the dtype's values
        assert seg.data_ptr() == capacity_view[i].data_ptr()

    # A strided view: the first 32 of every 64 elements of segment 1.
    rows = n // 64
    strided = t.view(dtype, (rows, 32), (64, 1), t.segment_offsets[1])
    expect = sources[1][: rows * 64].view(rows, 64)
    expect_rest = expect[:, 32:]
    assert torch.equal(strided.float(), expect[:, :32].float())
    strided.copy_(torch.ones(rows, 32, device=DEVICE).to(dtype))
    torch.cuda.synchronize()

    t.resize_per_segment_(2 * committed)  # zeroing grow: new elements read 0 in the dtype
    torch.cuda.synchronize()
    for i in range(2):
        seg = t.segment_view(i, dtype)
        assert tuple(seg.shape) == (2 * n,)
        assert int(seg[n:].float().count_nonzero()) == 0
    # Old elements are untouched by the grow: segment 0 as written, segment 1 as rewritten.
    assert torch.equal(t.segment_view(0, dtype)[:n].view(torch.uint8), sources[0].view(torch.uint8))
    rewritten = t.segment_view(1, dtype)[: rows * 64].view(rows, 64)
    assert torch.equal(rewritten[:, :32].float(), torch.ones(rows, 32, device=DEVICE))
    assert torch.equal(rewritten[:, 32:].float(), expect_rest.float())
