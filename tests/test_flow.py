"""The flow (docs/design.md §5): reserve with one block → (warm up, capture) → extend_to_fit.

On the host backend the budget is given (or a faked `host_free_bytes()`); on a GPU it is
the driver's free memory, and the commit must show up there. Nothing may map while a stream is
capturing a CUDA graph.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import extensible_kv
import pytest
import torch
from extensible_kv import sizing
from extensible_kv.flow import ExtendReport, KVCacheFlow
from extensible_kv.kv_cache import AttentionLayerSpec, KVCacheTensorSpec
from extensible_kv.sizing import CacheFootprint, blocks_within
from support.devices import CPU_GRANULARITY
from support.memory import settled_free

GIB = 1 << 30
MIB = 1 << 20
BF16 = torch.bfloat16
N, H, D = 16, 2, 32
PAGE = 2 * N * H * D * 2  # 4 KiB: K and V of one bf16 block
README = Path(__file__).resolve().parent.parent / "README.md"


def _spec(num_layers: int = 2, backend: str = "FLASH_ATTN") -> list[KVCacheTensorSpec]:
    layer = AttentionLayerSpec(backend, N, H, D, BF16)
    return [KVCacheTensorSpec(PAGE, {f"layers.{i}": layer}) for i in range(num_layers)]


@pytest.fixture
def flow() -> Iterator[KVCacheFlow]:
    with KVCacheFlow.reserve(_spec(), 1000, "cpu", granularity=CPU_GRANULARITY) as flow:
        yield flow


# ---------------------------------------------------------------------------------------------
# host backend


@pytest.mark.parametrize("legacy", [False, True], ids=["extensible", "legacy"])
@pytest.mark.parametrize("device", ["cuda:99", "cuda"])
def test_reserve_on_an_unusable_gpu_is_unsupported_with_the_reason(
    device: str, legacy: bool
) -> None:
    """Our `UnsupportedError` with the probe's reason, not whatever torch raises."""
    usable = extensible_kv.vmm_unavailable_reason("cuda:0") is None and torch.cuda.is_available()
    if device == "cuda" and usable:
        pytest.skip("device 0 is usable here")
    index = device.partition(":")[2] or "0"
    reason = extensible_kv.vmm_unavailable_reason(f"cuda:{index}")
    assert reason is not None
    with pytest.raises(extensible_kv.UnsupportedError) as info:
        KVCacheFlow.reserve(_spec(), 64, device, legacy=legacy)
    if legacy:  # needs torch's CUDA, not the VMM API
        assert f"sees no CUDA device {index}" in str(info.value) or reason in str(info.value)
    else:
        assert str(info.value) == f"unsupported: {reason}"


def test_reserve_commits_one_block(flow: KVCacheFlow) -> None:
    cache = flow.cache
    assert (cache.capacity_blocks, cache.committed_blocks) == (1000, 1)
    # One 2 KiB block per segment: one 4 KiB granule per segment, 2 segments, 2 buffers.
    assert cache.physical_bytes == 4 * CPU_GRANULARITY


def test_extend_to_fit_commits_the_budget_and_logs(
    flow: KVCacheFlow, caplog: pytest.LogCaptureFixture
) -> None:
    budget = 100_000 + 4 * CPU_GRANULARITY  # in all: what reserve committed counts
    expected = blocks_within(100_000, CacheFootprint.of(flow.cache))
    kv = flow.cache.views["layers.0"]
    assert isinstance(kv, torch.Tensor)
    kv[:, 0].fill_(3)  # block 0 of K and V, written before the extension
    pointer = kv.data_ptr()
    with caplog.at_level(logging.INFO, logger="extensible_kv"):
        report = flow.extend_to_fit(budget_bytes=budget)
    # 2 KiB per block and segment, 4 segments, 4 KiB granules: 24 more granules fit (98,304
    # bytes), 6 per segment, 7 with the one mapped: 14 blocks.
    assert report.blocks_after == expected == flow.cache.committed_blocks == 14
    assert report.committed_bytes == flow.cache.physical_bytes - 4 * CPU_GRANULARITY <= 100_000
    gib = flow.cache.physical_bytes / GIB
    assert caplog.messages == [f"Extended KV cache to 14 blocks ({gib:.2f} GiB)"]
    assert caplog.records[0].name == "extensible_kv"
    assert (report.blocks_before, report.capacity_blocks, report.fit_blocks) == (1, 1000, 14)
    assert (report.bytes_before, report.bytes_after) == (4 * CPU_GRANULARITY, 28 * 4096)
    assert report.handles_before == 4 and report.handles_after >= 4
    assert (report.budget_bytes, report.margin_bytes, report.free_bytes) == (100_000, 0, None)
    assert (report.budget_source, report.legacy, report.non_kv_used_bytes) == ("given", False, None)
    assert 0 <= report.commit_ms <= report.total_ms
    # Addresses stayed, block 0 kept its data, the new blocks read zero and take writes.
    assert kv.data_ptr() == pointer and bool(kv[:, 0].eq(3).all())
    assert not kv[:, 1:14].any()
    kv[:, 13].fill_(1)


def test_extend_to_fit_caps_never_shrinks_and_stops_at_capacity(flow: KVCacheFlow) -> None:
    assert flow.extend_to_fit(budget_bytes=GIB, max_blocks=10).blocks_after == 10
    report = flow.extend_to_fit(budget_bytes=0)
    assert (report.blocks_before, report.blocks_after, report.committed_bytes) == (10, 10, 0)
    assert flow.extend_to_fit(budget_bytes=1, max_blocks=3).blocks_after == 10
    assert flow.extend_to_fit(budget_bytes=GIB).blocks_after == 1000


def test_shrink_to_gives_memory_back_and_keeps_the_blocks_below(
    flow: KVCacheFlow, caplog: pytest.LogCaptureFixture
) -> None:
    flow.extend_to_fit(budget_bytes=GIB, max_blocks=40)
    kv = flow.cache.views["layers.0"]
    assert isinstance(kv, torch.Tensor)
    kv[:, :10].fill_(5)
    before = flow.cache.physical_bytes
    with caplog.at_level(logging.INFO, logger="extensible_kv"):
        flow.shrink_to(10, exact=True)
    gib = flow.cache.physical_bytes / GIB
    assert caplog.messages == [f"Shrank KV cache to 10 blocks ({gib:.2f} GiB)"]
    # 2 KiB per block and segment: 10 blocks are 5 granules a segment, 4 segments.
    assert flow.cache.physical_bytes == 4 * 5 * CPU_GRANULARITY < before
    assert bool(kv[:, :10].eq(5).all())
    report = flow.extend_to_fit(budget_bytes=GIB, max_blocks=40)
    assert report.blocks_after == 40 and not kv[:, 10:40].any()


def test_host_backend_needs_a_budget(flow: KVCacheFlow) -> None:
    with pytest.raises(ValueError, match=r"pass budget_bytes .* or host_free=True"):
        flow.extend_to_fit()
    assert flow.cache.committed_blocks == 1


def test_host_free_keeps_the_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    available = iter([GIB + 5 * MIB, GIB + 64 * 1024])  # at reserve, then after "warm-up"
    monkeypatch.setattr(sizing, "host_free_bytes", lambda: next(available))
    spec = _spec()
    with KVCacheFlow.reserve(spec, 1000, "cpu", granularity=CPU_GRANULARITY) as flow:
        report = flow.extend_to_fit(host_free=True)
        assert report.budget_source == "host_free_bytes"
        assert (report.free_bytes, report.margin_bytes) == (GIB + 64 * 1024, GIB)
        assert report.budget_bytes == 64 * 1024
        committed_at_reserve = 4 * CPU_GRANULARITY
        assert report.non_kv_used_bytes == 5 * MIB - 64 * 1024 - committed_at_reserve
        assert report.committed_bytes <= 64 * 1024
        assert report.blocks_after == 10  # 16 more granules: 5 per segment, of 2 blocks each


def test_margin_can_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizing, "host_free_bytes", lambda: 10 * MIB)
    with KVCacheFlow.reserve(_spec(), 10_000, "cpu", granularity=CPU_GRANULARITY) as flow:
        report = flow.extend_to_fit(host_free=True, margin_bytes=9 * MIB)
        assert (report.margin_bytes, report.budget_bytes) == (9 * MIB, MIB)
        assert report.committed_bytes <= MIB


def test_legacy_flow_has_the_same_api(caplog: pytest.LogCaptureFixture) -> None:
    with KVCacheFlow.reserve(_spec(), 50, "cpu", legacy=True) as flow:
        assert flow.cache.legacy and flow.cache.physical_bytes == 2 * 50 * PAGE
        assert flow.cache.committed_blocks == 1
        with caplog.at_level(logging.INFO, logger="extensible_kv"):
            report = flow.extend_to_fit(budget_bytes=0, max_blocks=40)
        assert (report.blocks_before, report.blocks_after, report.fit_blocks) == (1, 40, 50)
        assert report.bytes_before == report.bytes_after == 2 * 50 * PAGE
        assert (report.handles_after, report.legacy) == (2, True)
        assert re.fullmatch(
            r"Extended KV cache to 40 blocks \(0\.00 GiB\) \(legacy.*\)", caplog.messages[0]
        )


def test_leaving_with_on_an_exception_never_hides_it() -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom) as info:
        with KVCacheFlow.reserve(_spec(), 1000, "cpu", granularity=CPU_GRANULARITY) as flow:
            kv = flow.cache.views["layers.0"]
            raise Boom
    assert any("BufferError" in note for note in info.value.__notes__)
    del kv, info
    flow.close()
    assert flow.cache.closed


def test_reserve_closes_what_it_built_when_the_first_commit_fails() -> None:
    with pytest.raises(ValueError, match="cannot commit 2 blocks: capacity is 1 blocks"):
        KVCacheFlow.reserve(_spec(), 1, "cpu", initial_blocks=2)


def test_report_is_frozen(flow: KVCacheFlow) -> None:
    report = flow.extend_to_fit(budget_bytes=0)
    assert isinstance(report, ExtendReport)
    with pytest.raises(AttributeError):
        report.blocks_after = 5  # type: ignore[misc]


def test_readme_flow_example_runs() -> None:
    section = README.read_text().split("\n## The flow\n", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```py\n(.*?)```", section, flags=re.S)
    namespace: dict[str, object] = {}
    exec(compile(example, "README.md", "exec"), namespace)
    report = namespace["report"]
    assert isinstance(report, ExtendReport) and report.blocks_after > report.blocks_before == 1


# ---------------------------------------------------------------------------------------------
# CUDA


TOLERANCE = 64 * MIB  # free memory moves by a few MiB of the driver's own (page tables)


@pytest.mark.gpu
def test_extend_to_fit_commits_device_memory() -> None:
    spec = _spec(num_layers=4)
    granularity = sizing.device_granularity("cuda:0")
    capacity = sizing.capacity_blocks_for(settled_free(reset_peaks=True), spec, granularity)
    with KVCacheFlow.reserve(spec, capacity, "cuda:0") as flow:
        assert flow.free_at_init_bytes is not None
        target = (2 * GIB) // (4 * PAGE)  # about 2 GiB of blocks, capped below the fit
        free_before = settled_free(reset_peaks=True)
        report = flow.extend_to_fit(max_blocks=target)
        dropped = free_before - settled_free(reset_peaks=True)
        assert report.blocks_after == target and report.fit_blocks > target
        assert report.budget_source == "cuda mem_get_info" and report.free_bytes is not None
        assert report.margin_bytes >= GIB and report.non_kv_used_bytes is not None
        assert abs(dropped - report.committed_bytes) <= TOLERANCE
        kv = flow.cache.views["layers.3"]
        assert isinstance(kv, torch.Tensor)
        kv[:, target - 1].fill_(1)  # the last block is real memory
        assert bool(kv[:, target - 1].eq(1).all())
        del kv


@pytest.mark.gpu
def test_extend_to_fit_leaves_only_the_margin() -> None:
    spec = _spec(num_layers=4)
    granularity = sizing.device_granularity("cuda:0")
    capacity = sizing.capacity_blocks_for(settled_free(reset_peaks=True), spec, granularity)
    margin = 2 * GIB
    with KVCacheFlow.reserve(spec, capacity, "cuda:0") as flow:
        # What earlier tests released counts as free before the measurement.
        settled_free(reset_peaks=True)
        report = flow.extend_to_fit(margin_bytes=margin)
        free_after = settled_free(reset_peaks=True)
        # One more block would cost at most a granule per segment (4 buffers x 2 segments).
        assert margin - TOLERANCE <= free_after <= margin + 8 * granularity + TOLERANCE
        assert report.blocks_after == report.fit_blocks < capacity
        assert report.committed_bytes > 10 * GIB  # an H200 has over 100 GiB free


@pytest.mark.gpu
def test_nothing_maps_while_a_stream_captures() -> None:
    with KVCacheFlow.reserve(_spec(), 64, "cuda:0") as flow:
        x = torch.zeros(16, device="cuda:0")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x.add_(1)
            with pytest.raises(RuntimeError, match=r"extend_to_fit .* capturing a CUDA graph"):
                flow.extend_to_fit(budget_bytes=GIB)
            with pytest.raises(RuntimeError, match=r"reserve .* capturing a CUDA graph"):
                KVCacheFlow.reserve(_spec(), 64, "cuda:0")
        graph.replay()
        torch.cuda.synchronize()
        assert flow.cache.committed_blocks == 1 and int(x[0]) == 1
        assert flow.extend_to_fit(budget_bytes=GIB).blocks_after == 64
