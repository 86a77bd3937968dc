"""vLLM 0.34.0's own `ExtensibleKVCache`, unchanged, on our drop-in installed by the plugin.

The layouts are built by vLLM's planning code (`vllm_cases`); the cache, its commits and its
views are vLLM's; the plugin got in through vLLM's `load_general_plugins()` (the `vllm_plugin`
fixture). Runs on the host backend everywhere and on CUDA where there is a device. Blocks are
only touched below the committed count: on the host backend an uncommitted touch kills the
process, so a passing write proves the bytes were committed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from support.memory import containing_mapping, granules_of
from support.vllm_cases import CASES, Case, kv_cache_config, layout

pytestmark = pytest.mark.vllm

CAPACITY = 700  # blocks: 8 KiB pages make layer segments of 2.7 granules (2 MiB)
SLACK_BYTE = 0x5A


@pytest.fixture
def device(device: str) -> torch.device:
    """conftest's device, as the `torch.device` vLLM's code takes."""
    return torch.device(device)


@pytest.fixture(params=CASES, ids=lambda c: c.name.split(":")[0].replace(" ", "-"))
def case(request: pytest.FixtureRequest) -> Case:
    return request.param  # type: ignore[no-any-return]


class Setup:
    """One vLLM `ExtensibleKVCache` of `case`, allocated the way the model runner does it."""

    def __init__(self, module: Any, case: Case, device: torch.device, capacity: int) -> None:
        from vllm.utils import extensible_tensor
        from vllm.v1.worker.utils import allocate_kv_cache

        self.case, self.device = case, device
        index = device.index if device.type == "cuda" else "cpu"
        self.granule = extensible_tensor.granule_size(index)  # the plugin's, as the worker's
        self.config = kv_cache_config(case, capacity, self.granule)
        self.layout = layout(case)
        self.kv = module.ExtensibleKVCache(self.config, device, self.layout)
        self.views: dict[str, torch.Tensor] = allocate_kv_cache(
            self.config, device, self.layout, allocate=self.kv.allocate
        )

    @property
    def buffer(self) -> Any:
        return self.kv.buffer

    def sizes(self, num_blocks: int) -> list[int]:
        return [num_blocks * stride for stride in self.kv.segment_strides]

    def one_chunk(self, num_blocks: int) -> list[bool]:
        return self.buffer.segments_backed_by_one_chunk(self.sizes(num_blocks))  # type: ignore[no-any-return]

    def distinct_views(self) -> dict[str, torch.Tensor]:
        """One view per distinct region: a hybrid's groups alias each other's layers."""
        seen: dict[int, str] = {}
        for name, view in self.views.items():
            seen.setdefault(view.data_ptr(), name)
        return {name: self.views[name] for name in seen.values()}

    def fill(self, num_blocks: int) -> None:
        """Writes a different value into each region's first `num_blocks` blocks."""
        for i, view in enumerate(self.distinct_views().values()):
            view[:num_blocks].fill_(i + 1)

    def assert_filled(self, num_blocks: int) -> None:
        for i, (name, view) in enumerate(self.distinct_views().items()):
            assert torch.all(view[:num_blocks] == i + 1), name

    def assert_zero(self, start: int, end: int) -> None:
        for name, view in self.distinct_views().items():
            assert int(torch.count_nonzero(view[start:end])) == 0, (name, start, end)

    def dirty_slack(self, num_blocks: int) -> int:
        """Writes SLACK_BYTE into the mapped bytes past each segment's committed prefix (the
        rest of its last granule, up to where the next segment starts): a grow must zero them
        itself, as fresh memory is not what covers them. Returns how many bytes it dirtied."""
        full = self.buffer.full_view()
        offsets = self.kv.segment_offsets
        ends = [*offsets[1:], self.kv.size]
        dirtied = 0
        for offset, stride, end in zip(offsets, self.kv.segment_strides, ends, strict=True):
            start = offset + num_blocks * stride
            stop = min(-(-start // self.granule) * self.granule, end)
            if start < stop:
                full[start:stop].fill_(SLACK_BYTE)
                dirtied += stop - start
        return dirtied

    def expected_physical(self, num_blocks: int) -> int:
        """The granules that hold a committed byte, each once (a shared one too)."""
        granules = granules_of(self.kv.segment_offsets, self.sizes(num_blocks), self.granule)
        return len(granules) * self.granule

    def assert_physical(self, num_blocks: int) -> None:
        physical = self.buffer.physical_bytes
        assert physical == self.kv.physical_bytes == self.expected_physical(num_blocks)
        if self.case.aligned:  # vLLM's own estimate is exact for these
            assert physical == self.kv.physical_bytes_for(num_blocks)


@pytest.fixture
def setup(vllm_plugin: Any, case: Case, device: torch.device) -> Iterator[Setup]:
    made = Setup(vllm_plugin, case, device, CAPACITY)
    yield made
    made.views.clear()
    made.kv.free()


def test_the_plugin_put_our_tensor_under_vllms_cache(setup: Setup) -> None:
    from extensible_kv.vllm import ExtensibleTensor

    assert type(setup.buffer) is ExtensibleTensor
    assert setup.buffer.granularity == setup.granule
    assert setup.buffer.device == setup.device


def test_allocate_commits_the_minimum_and_views_span_the_capacity(setup: Setup) -> None:
    kv = setup.kv
    assert kv.num_committed_blocks == kv.min_committed_blocks
    assert kv.min_committed_blocks == (2 if setup.case.layout.startswith("B") else 1)
    setup.assert_physical(kv.min_committed_blocks)
    base = setup.buffer.base_ptr
    for view in setup.views.values():
        assert view.device == setup.device
        assert view.shape[0] == CAPACITY
        assert base <= view.data_ptr() < base + kv.size
        assert view.untyped_storage().nbytes() == kv.size
    setup.fill(kv.min_committed_blocks)
    setup.assert_filled(kv.min_committed_blocks)


def test_growing_commits_keep_data_and_zero_new_blocks(setup: Setup) -> None:
    kv = setup.kv
    ptrs = {name: view.data_ptr() for name, view in setup.views.items()}
    kv.commit(100)
    setup.fill(100)
    assert setup.dirty_slack(100) > 0
    kv.commit(300)
    assert kv.num_committed_blocks == 300
    setup.assert_filled(100)
    setup.assert_zero(100, 300)
    setup.assert_physical(300)

    setup.fill(300)
    setup.dirty_slack(300)
    kv.commit(CAPACITY + 5)  # clamped to the capacity
    assert kv.num_committed_blocks == CAPACITY
    setup.assert_filled(300)
    setup.assert_zero(300, CAPACITY)
    setup.assert_physical(CAPACITY)
    assert {name: view.data_ptr() for name, view in setup.views.items()} == ptrs


def test_segment_views_span_exactly_the_committed_bytes(setup: Setup) -> None:
    kv, n = setup.kv, 300
    kv.commit(n)
    setup.fill(n)
    for i, stride in enumerate(kv.segment_strides):
        segment = setup.buffer.segment_view(i)
        assert segment.untyped_storage().nbytes() == n * stride
        assert segment.data_ptr() == setup.buffer.base_ptr + kv.segment_offsets[i]
    final = copy.copy(setup.config)
    final.num_blocks = n
    committed = kv.committed_views(final, setup.layout)
    assert committed is not None and committed.keys() == setup.views.keys()
    for name, view in committed.items():
        capacity_view = setup.views[name]
        assert view.shape[0] == n
        assert view.data_ptr() == capacity_view.data_ptr()
        assert torch.equal(view, capacity_view[:n])
        block_stride = view.stride(0) * view.element_size()
        if setup.case.layout.startswith("B"):
            assert view.untyped_storage().nbytes() == n * kv.bytes_per_block
        else:
            assert view.untyped_storage().nbytes() == n * block_stride
    with pytest.raises(IndexError, match="out of range"):
        setup.buffer.segment_view(len(kv.segment_strides))


def test_a_commit_at_or_below_the_count_is_a_noop(setup: Setup) -> None:
    kv = setup.kv
    kv.commit(300)
    setup.fill(300)
    before = (kv.num_committed_blocks, setup.buffer.physical_bytes)
    chunks = setup.buffer.num_physical_chunks
    for n in (300, 299, 1, 0):
        kv.commit(n)
        assert (kv.num_committed_blocks, setup.buffer.physical_bytes) == before
        assert setup.buffer.num_physical_chunks == chunks
    setup.assert_filled(300)


def test_release_physical_and_recommit(setup: Setup) -> None:
    kv = setup.kv
    kv.commit(300)
    setup.fill(300)
    ptrs = {name: view.data_ptr() for name, view in setup.views.items()}
    kv.release_physical()  # sleep
    assert setup.buffer.physical_bytes == 0
    assert setup.buffer.num_physical_chunks == 0
    assert kv.num_committed_blocks == 300
    kv.recommit()  # wake: fresh zeroed pages at the same addresses
    assert kv.num_committed_blocks == 300
    setup.assert_physical(300)
    setup.assert_zero(0, 300)
    assert {name: view.data_ptr() for name, view in setup.views.items()} == ptrs
    if setup.case.aligned:  # connectors re-register after a wake
        assert all(setup.one_chunk(300))


def test_shrinking_commit_remaps_a_smaller_prefix(setup: Setup) -> None:
    kv = setup.kv
    kv.commit(500)
    setup.fill(500)
    kv.commit(200, shrink=True)
    assert kv.num_committed_blocks == 200
    setup.assert_physical(200)
    setup.assert_zero(0, 200)  # the remap discards contents (warmup garbage)
    kv.commit(250)
    assert kv.num_committed_blocks == 250
    setup.assert_zero(0, 250)


def test_defragmenting_commit_ends_with_one_chunk_per_segment(setup: Setup) -> None:
    kv = setup.kv
    for n in (50, 300, 450):  # incremental grows: several handles per segment
        kv.commit(n)
    assert not all(setup.one_chunk(450))
    setup.fill(450)
    kv.commit(450, defragment=True)
    assert kv.num_committed_blocks == 450
    setup.assert_zero(0, 450)
    setup.assert_physical(450)
    if setup.case.aligned:
        assert all(setup.one_chunk(450))
        assert setup.buffer.num_physical_chunks <= len(kv.segment_strides)
        setup.fill(450)
        kv.commit(450, defragment=True)  # already one chunk each: no remap
        setup.assert_filled(450)
    kv.commit(CAPACITY, defragment=True)
    assert kv.num_committed_blocks == CAPACITY
    setup.assert_zero(0, CAPACITY)
    assert all(setup.one_chunk(CAPACITY))


@pytest.fixture
def keep_data(vllm_plugin: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The plugin registered with EXTENSIBLE_KV_VLLM_KEEP_DATA=1, vLLM's commit put back after."""
    from extensible_kv.vllm import plugin

    monkeypatch.setenv(plugin.KEEP_DATA_ENV_VAR, "1")
    assert plugin.register()
    yield vllm_plugin
    plugin.unregister()
    monkeypatch.delenv(plugin.KEEP_DATA_ENV_VAR)
    plugin.register()  # the drop-in stays, vLLM's own commit is back
    assert vllm_plugin.ExtensibleKVCache.commit is not plugin.commit_keeping_data


def test_keep_data_shrinks_and_defragments_without_losing_blocks(
    keep_data: Any, setup: Setup
) -> None:
    kv = setup.kv
    for n in (50, 300, 500):
        kv.commit(n)
    setup.fill(500)
    kv.commit(200, shrink=True)
    assert kv.num_committed_blocks == 200
    setup.assert_physical(200)  # given back down to the granules 200 blocks need
    setup.assert_filled(200)  # vLLM's own commit would have zeroed them
    kv.commit(250)
    setup.assert_filled(200)
    setup.assert_zero(200, 250)
    kv.commit(450, defragment=True)
    assert kv.num_committed_blocks == 450
    setup.assert_filled(200)
    setup.assert_zero(200, 450)
    if setup.case.aligned:
        assert all(setup.one_chunk(450))


@pytest.mark.parametrize(("bad", "error"), [(-1, ValueError), (2.5, TypeError), (True, TypeError)])
def test_keep_data_commit_refuses_a_bad_count_before_anything_changes(
    keep_data: Any, setup: Setup, bad: object, error: type[Exception]
) -> None:
    """A negative count must not reach the segment arithmetic (it was turned into negative
    sizes, failing in the middle of a shrink); a float or bool is not a count."""
    kv = setup.kv
    kv.commit(300)
    setup.fill(300)
    before = (kv.num_committed_blocks, setup.buffer.physical_bytes)
    for shrink in (False, True):
        with pytest.raises(error, match="num_blocks"):
            kv.commit(bad, shrink=shrink)
    assert (kv.num_committed_blocks, setup.buffer.physical_bytes) == before
    setup.assert_filled(300)
    with pytest.raises(TypeError, match="shrink"):
        kv.commit(100, shrink=1)
    kv.commit(np.int64(400))  # any integer `operator.index` takes, as the core
    assert kv.num_committed_blocks == 400


@pytest.fixture
def vllms_commit(vllm_plugin: Any) -> Any:
    """vLLM's own `ExtensibleKVCache.commit`, taken before `keep_data` replaces it."""
    return vllm_plugin.ExtensibleKVCache.commit


START = 500  # blocks committed before the commit under test
# (name, the commits that got there, the last one defragmenting, then asleep): vLLM's
# defragment decides by the chunks; asleep (`release_physical`), nothing is mapped.
STARTS = [
    ("grown in steps", (50, 300, START), False, False),
    ("defragmented", (50, START), True, False),
    ("asleep", (50, 300, START), False, True),
]
# Two below (a defragment remaps or not, by the chunks of the count's blocks), equal, above.
COUNTS = [100, 400, START, 650]


@pytest.mark.parametrize("shrink", [False, True], ids=["keep", "shrink"])
@pytest.mark.parametrize("defragment", [False, True], ids=["plain", "defragment"])
def test_keep_data_commit_ends_where_vllms_does(
    vllms_commit: Any,
    keep_data: Any,
    case: Case,
    device: torch.device,
    defragment: bool,
    shrink: bool,
) -> None:
    # Every (start, count) against vLLM's own commit on a twin cache: the same final count;
    # keep-data keeps the blocks below both counts and zeroes the rest, where vLLM's remap
    # zeroes everything.
    from extensible_kv.vllm import plugin

    assert vllms_commit is not plugin.commit_keeping_data
    assert keep_data.ExtensibleKVCache.commit is plugin.commit_keeping_data
    rows = []
    for start, grows, defragmented, asleep in STARTS:
        for n in COUNTS:
            theirs = Setup(keep_data, case, device, CAPACITY)
            ours = Setup(keep_data, case, device, CAPACITY)
            try:
                for twin in (theirs, ours):
                    for grow in grows:
                        vllms_commit(twin.kv, grow, defragment=defragmented and grow == START)
                    twin.fill(START)
                    if asleep:
                        twin.kv.release_physical()
                vllms_commit(theirs.kv, n, defragment=defragment, shrink=shrink)
                ours.kv.commit(n, defragment=defragment, shrink=shrink)
                final = theirs.kv.num_committed_blocks
                row = (start, n, final)
                assert ours.kv.num_committed_blocks == final, row
                assert ours.buffer.physical_bytes == theirs.buffer.physical_bytes, row
                if asleep and ours.buffer.physical_bytes == 0:
                    rows.append(row)  # still asleep, as vLLM's: nothing to touch
                    continue
                kept = 0 if asleep else min(final, START)
                ours.assert_filled(kept)
                ours.assert_zero(kept, final)
                for twin in (theirs, ours):
                    twin.assert_physical(final)
                    if defragment and case.aligned:
                        assert all(twin.one_chunk(n)), row
                rows.append(row)
            finally:
                for twin in (theirs, ours):
                    twin.views.clear()
                    twin.kv.free()
    # vLLM's table: a count at or above START, or a shrinking one, is where it ends; a plain
    # one below START is a no-op; a defragmenting one below START ends at the count when it
    # remaps (the count's blocks were not one chunk per segment), else at START: both occur
    # where a defragmented start is one chunk per segment.
    below = {(start, n): final for start, n, final in rows if n < START and start != "asleep"}
    for start, n, final in rows:
        if n >= START or shrink:
            assert final == n, (start, n, final)
    if not shrink and not defragment:
        assert set(below.values()) == {START}, below
    if defragment and not shrink and case.aligned:
        assert {final == n for (_, n), final in below.items()} == {True, False}, below


def test_free_with_live_views(
    vllm_plugin: Any, case: Case, device: torch.device, leak_check: Callable[[], tuple[int, int]]
) -> None:
    memfds_before = leak_check()
    setup = Setup(vllm_plugin, case, device, CAPACITY)
    setup.kv.commit(300)
    setup.fill(300)
    buffer, views = setup.buffer, setup.views
    base, size = buffer.base_ptr, setup.kv.size

    setup.kv.free()  # vLLM frees while the model runner still holds views
    assert buffer.physical_bytes == 0
    assert buffer.num_physical_chunks == 0
    assert buffer.base_ptr == 0
    setup.kv.free()  # idempotent
    if device.type == "cpu":
        assert leak_check() == memfds_before  # physical memory returned at once
        assert containing_mapping(base) == "---p"  # the range: reserved, inaccessible
    # While views live, nobody else can be handed these addresses: a stale view faults
    # instead of aliasing (vLLM's class frees the range, and the next reservation tends to
    # land right there).
    from vllm.utils.extensible_tensor import ExtensibleTensor

    others = [ExtensibleTensor(size, device=device) for _ in range(3)]
    for other in others:
        assert not base <= other.base_ptr < base + size
        assert not other.base_ptr <= base < other.base_ptr + size
        other.free()
    assert all(view.data_ptr() != 0 for view in views.values())
    views.clear()
