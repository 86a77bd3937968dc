"""Sizing (docs/design.md §5): the budget from a measurement, blocks within a budget granule-aware,
granule-aligned capacities. Footprints are checked against a brute force that lists every
granule a segment prefix touches, and against what real caches map on the host backend."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from extensible_kv.kv_cache import (
    AttentionLayerSpec,
    ExtensibleKVCache,
    KVCacheTensorSpec,
    MambaLayerSpec,
    StandardLayerSpec,
    segment_layout,
)
from extensible_kv.mamba import MambaStateSpec
from extensible_kv.sizing import (
    MIN_MARGIN_BYTES,
    BufferFootprint,
    CacheFootprint,
    blocks_within,
    capacity_blocks_for,
    default_margin_bytes,
    device_granularity,
    host_available_bytes,
    measure_budget,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from support.devices import CPU_GRANULARITY
from support.kv_helpers import MakeCache
from support.memory import settled_free

GIB = 1 << 30
BF16 = torch.bfloat16


@pytest.fixture
def device() -> str:
    """The real caches here (conftest's `make_cache`) live on the host backend."""
    return "cpu"


# ---------------------------------------------------------------------------------------------
# the budget


def test_margin_is_a_gib_or_three_quarters_of_the_transient_peak() -> None:
    assert default_margin_bytes(0) == MIN_MARGIN_BYTES == GIB
    assert default_margin_bytes(GIB) == GIB
    assert default_margin_bytes(4 * GIB) == 3 * GIB
    assert default_margin_bytes(4 * GIB + 1) == 3 * GIB + 1  # rounded up


def test_budget_keeps_the_margin_and_reports_non_kv_use() -> None:
    budget = measure_budget(
        40 * GIB,
        free_at_init_bytes=100 * GIB,
        kv_committed_bytes=2 * GIB,
        transient_peak_bytes=4 * GIB,
    )
    assert (budget.margin_bytes, budget.budget_bytes) == (3 * GIB, 37 * GIB)
    assert budget.non_kv_used_bytes == 100 * GIB - 40 * GIB - 2 * GIB
    given_margin = measure_budget(40 * GIB, margin_bytes=0)
    assert (given_margin.budget_bytes, given_margin.non_kv_used_bytes) == (40 * GIB, None)
    assert measure_budget(GIB // 2).budget_bytes == 0  # less free than the margin: nothing
    with pytest.raises(ValueError, match="margin_bytes -1"):
        measure_budget(GIB, margin_bytes=-1)


def test_host_available_bytes_reads_memavailable(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  100 kB\nMemFree: 10 kB\nMemAvailable:   42 kB\n")
    assert host_available_bytes(str(meminfo)) == 42 * 1024
    assert host_available_bytes() > 0


# ---------------------------------------------------------------------------------------------
# footprints and blocks within a budget: properties against a brute force


def brute_footprint(buffer: BufferFootprint, num_blocks: int) -> int:
    """Every granule any byte of any segment prefix lies in, as a set."""
    g, prefix = buffer.granularity, num_blocks * buffer.segment_block_bytes
    granules: set[int] = set()
    for offset in buffer.segment_offsets:
        if prefix:
            granules.update(range(offset // g, (offset + prefix - 1) // g + 1))
    return len(granules) * g


def brute_blocks_within(budget: int, cache: CacheFootprint) -> int:
    def extra(n: int) -> int:
        base = sum(brute_footprint(b, cache.committed_blocks) for b in cache.buffers)
        return sum(brute_footprint(b, n) for b in cache.buffers) - base

    counts = range(cache.committed_blocks, cache.capacity_blocks + 1)
    return max((n for n in counts if extra(n) <= budget), default=cache.committed_blocks)


@st.composite
def footprints(draw: st.DrawFn) -> CacheFootprint:
    """Buffers laid out as ExtensibleKVCache lays them out: equal segments of `capacity`
    blocks back to back, block sizes that are rarely granule multiples."""
    granularity = draw(st.sampled_from([64, 512, 4096]))
    capacity = draw(st.integers(1, 64))
    buffers = []
    for _ in range(draw(st.integers(1, 3))):
        block_bytes = draw(st.one_of(st.integers(1, 3000), st.sampled_from([granularity, 2048])))
        num_segments = draw(st.integers(1, 4))
        offsets = tuple(s * capacity * block_bytes for s in range(num_segments))
        buffers.append(BufferFootprint(offsets, block_bytes, granularity))
    committed = draw(st.integers(0, capacity))
    return CacheFootprint(tuple(buffers), capacity, committed)


@given(footprints(), st.data())
@settings(max_examples=300, deadline=None)
def test_footprint_matches_brute_force(cache: CacheFootprint, data: st.DataObject) -> None:
    n = data.draw(st.integers(0, cache.capacity_blocks))
    for buffer in cache.buffers:
        assert buffer.footprint_bytes(n) == brute_footprint(buffer, n)


@given(footprints(), st.integers(-100, 300_000))
@settings(max_examples=300, deadline=None)
def test_blocks_within_is_the_most_that_fit(cache: CacheFootprint, budget: int) -> None:
    n = blocks_within(budget, cache)
    assert n == brute_blocks_within(budget, cache)
    assert cache.committed_blocks <= n <= cache.capacity_blocks
    if n > cache.committed_blocks:
        assert cache.extra_bytes(n) <= budget
    if n < cache.capacity_blocks:
        assert cache.extra_bytes(n + 1) > budget


def test_shared_granules_count_once() -> None:
    # Two segments of 3 blocks x 100 bytes: the second starts at byte 300, inside granule 0.
    buffer = BufferFootprint((0, 300), 100, 512)
    assert buffer.footprint_bytes(1) == 512  # bytes [0, 100) and [300, 400): one granule
    assert buffer.footprint_bytes(3) == 1024  # [0, 300) and [300, 600): granules 0 and 1
    cache = CacheFootprint((buffer,), 3, 1)
    assert blocks_within(0, cache) == 2  # block 2 ends at byte 500: still granule 0
    assert blocks_within(511, cache) == 2
    assert blocks_within(512, cache) == 3


def test_a_footprint_past_64_bits_is_refused_not_wrapped() -> None:
    from extensible_kv import _native

    # 2^63 granules of 2 bytes are 2^64 bytes: an unchecked multiply made that 0.
    with pytest.raises(ValueError, match="18446744073709551615 bytes"):
        _native.footprint_bytes([0], 2**64 - 1, 2)
    with pytest.raises(ValueError, match="overflow 64 bits"):
        _native.footprint_bytes([1], 2**64 - 1, 1)
    assert _native.footprint_bytes([0], 2**64 - 1, 1) == 2**64 - 1
    assert _native.footprint_bytes([0, 2**62], 2**62, 2**63) == 2**63


# ---------------------------------------------------------------------------------------------
# against real caches


def _odd_spec() -> list[KVCacheTensorSpec]:
    """Segments that end mid-granule: K and V slices of 30 bytes a block, and an LHBNC
    buffer of 2 layers x 3 heads (6 segments of 30 bytes a block)."""
    tiny = AttentionLayerSpec("FLASH_ATTN", 3, 1, 5, BF16)
    standard = {f"s{i}": StandardLayerSpec("LHBNC", 2, i, 3, 3, 5, BF16) for i in range(2)}
    return [
        KVCacheTensorSpec(60, {"kv": tiny}),
        KVCacheTensorSpec(2 * 3 * 3 * 10 * 2, standard),
    ]


def _mamba_spec() -> list[KVCacheTensorSpec]:
    state = MambaStateSpec((((7,), torch.uint8),))
    return [KVCacheTensorSpec(7, {"m": MambaLayerSpec(state)})]


@pytest.mark.parametrize("spec", [_odd_spec, _mamba_spec])
@given(capacity=st.integers(1, 400), steps=st.lists(st.integers(0, 400), max_size=4))
@settings(max_examples=25, deadline=None)
def test_footprint_is_what_the_cache_maps(
    spec: Callable[[], list[KVCacheTensorSpec]], capacity: int, steps: list[int]
) -> None:
    with ExtensibleKVCache(spec(), capacity, "cpu", granularity=CPU_GRANULARITY) as cache:
        for n in sorted(min(s, capacity) for s in steps):
            footprint = CacheFootprint.of(cache)
            expected_extra = footprint.extra_bytes(n)
            before = cache.physical_bytes
            cache.commit(n)
            assert CacheFootprint.of(cache).footprint_bytes(n) == cache.physical_bytes
            assert cache.physical_bytes - before == expected_extra


def test_blocks_within_commits_at_most_the_budget_on_a_real_cache(make_cache: MakeCache) -> None:
    cache = make_cache(_odd_spec(), 500)
    cache.commit(1)
    for budget in (0, 4096, 3 * 4096 + 17, 40_000, 10**9):
        footprint = CacheFootprint.of(cache)
        n = blocks_within(budget, cache)
        before = cache.physical_bytes
        cache.commit(n)
        assert cache.physical_bytes - before == footprint.extra_bytes(n) <= budget
        assert n == cache.capacity_blocks or footprint.extra_bytes(n + 1) > budget
    assert cache.committed_blocks == 500


def test_legacy_cache_has_nothing_left_to_commit(make_cache: MakeCache) -> None:
    cache = make_cache(_odd_spec(), 50, legacy=True)
    cache.commit(1)
    assert CacheFootprint.of(cache).buffers == ()
    assert blocks_within(0, cache) == 50


# ---------------------------------------------------------------------------------------------
# capacities


@pytest.mark.parametrize("granularity", [4096, 2 << 20])
@pytest.mark.parametrize("spec", [_odd_spec, _mamba_spec])
def test_capacity_is_granule_aligned(
    granularity: int, spec: Callable[[], list[KVCacheTensorSpec]]
) -> None:
    tensors = spec()
    layout = segment_layout(tensors)
    block_bytes = sum(s * b for s, b in layout)
    for upper in (1, 10**6, 10**9, 80 * GIB):
        capacity = capacity_blocks_for(upper, tensors, granularity)
        assert all(capacity * b % granularity == 0 for _, b in layout)
        step = math.lcm(*(granularity // math.gcd(granularity, b) for _, b in layout))
        estimate = max(1, upper // block_bytes)
        assert estimate <= capacity < estimate + step


def test_capacity_of_a_7b_like_cache() -> None:
    # 32 layers, 8 KV heads x 128, block 16, bf16, FlashAttention: 32 KiB per block and
    # segment, so every 64 blocks end on a 2 MiB granule.
    layer = AttentionLayerSpec("FLASH_ATTN", 16, 8, 128, BF16)
    spec = [KVCacheTensorSpec(2 * 16 * 8 * 128 * 2, {f"l{i}": layer}) for i in range(32)]
    capacity = capacity_blocks_for(100 * GIB, spec, 2 << 20)
    assert capacity % 64 == 0 and capacity == 100 * GIB // (32 * 64 * 1024)
    with pytest.raises(ValueError, match="granularity 0"):
        capacity_blocks_for(GIB, spec, 0)


def test_device_granularity_probes_the_backend() -> None:
    assert device_granularity("cpu", CPU_GRANULARITY) == CPU_GRANULARITY
    assert device_granularity("cpu") == 2 << 20  # the host backend mirrors CUDA's default


@pytest.mark.gpu
def test_cuda_transient_peak_counts_what_was_given_back_not_graph_pools() -> None:
    """The margin's transient peak: a warm-up's eager temporary (given back by empty_cache)
    counts; a captured graph's intermediates (kept reserved in its private pool, so already out
    of free memory) do not, though torch's allocated peak counts them."""
    from extensible_kv.sizing import cuda_transient_peak_bytes

    mib = 1 << 20
    settled_free(reset_peaks=True)
    x = torch.ones(mib, device="cuda:0")  # 4 MiB, kept
    # an eager temporary of 256 MiB, freed
    temp = torch.empty(64 * mib, device="cuda:0")
    del temp
    torch.cuda.empty_cache()
    eager = cuda_transient_peak_bytes("cuda:0")
    assert 256 * mib <= eager < 256 * mib + 64 * mib

    settled_free(reset_peaks=True)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # 256 MiB of intermediates inside the graph: its private pool keeps them reserved
        with torch.cuda.graph(graph, stream=stream):
            y = (x.repeat(64) * 2).sum()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    allocated_peak = torch.cuda.max_memory_allocated("cuda:0") - torch.cuda.memory_allocated(
        "cuda:0"
    )
    assert allocated_peak >= 256 * mib  # what the allocated difference took as transient
    assert cuda_transient_peak_bytes("cuda:0") < 16 * mib
    graph.replay()
    assert float(y) == 2.0 * 64 * mib
    del graph, y, x
