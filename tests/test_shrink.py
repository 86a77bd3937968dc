"""Giving memory back without losing data: `shrink_per_segment_` (plain and exact) and
`consolidate`, every test on every backend (see conftest.py).

Every committed block holds a pattern of its own; after a shrink the kept blocks must read
their pattern, and blocks grown back must read zero.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch
from extensible_kv import ClosedError, DriverError, ExtensibleTensor, HandleSizing, OutOfMemoryError
from support.memory import MakeTensor, mapped_granules, needed_granules

HOST_EVENT_DELAY = "EXTENSIBLE_KV_HOST_EVENT_DELAY_US"
BLOCK = 512  # bytes per block per segment


def fill_blocks(t: ExtensibleTensor, seed: int) -> None:
    """Block `b` of segment `s` holds bytes `(31 * s + 7 * b + seed) % 251 + 1`."""
    for s in range(t.num_segments):
        view = t.segment_view(s)
        blocks = torch.arange(view.numel(), dtype=torch.int64) // BLOCK
        values = (31 * s + 7 * blocks + seed) % 251 + 1
        view.copy_(values.to(torch.uint8).to(view.device))


def expected(t: ExtensibleTensor, s: int, num_bytes: int, seed: int) -> torch.Tensor:
    blocks = torch.arange(num_bytes, dtype=torch.int64) // BLOCK
    return ((31 * s + 7 * blocks + seed) % 251 + 1).to(torch.uint8)


def check(t: ExtensibleTensor, exact: bool) -> None:
    # What a shrink gives back goes on the tensor's thread once the stream has passed it.
    assert t.wait_released(10)
    t._check_invariants()
    mapped = mapped_granules(t)
    assert len(mapped) == len(set(mapped)), "a granule is mapped twice"
    needed = needed_granules(t)
    assert needed <= set(mapped)
    if exact:
        assert set(mapped) == needed
        assert t.physical_bytes == len(needed) * t.granularity
    # Every handle left holds a granule that a committed byte needs.
    for first, n in t.handle_runs():
        assert needed & set(range(first, first + n)), (first, n, sorted(needed))


def contents(t: ExtensibleTensor) -> list[torch.Tensor]:
    return [t.segment_view(i).cpu().clone() for i in range(t.num_segments)]


# Geometries in granules: (capacity per segment, segments); a capacity that is not a whole
# number of granules makes neighbours share a granule.
GEOMETRIES = [(8.0, 1), (6.0, 3), (5.5, 2), (3.25, 4)]


@pytest.mark.parametrize("exact", [False, True], ids=["plain", "exact"])
@pytest.mark.parametrize("granules,segments", GEOMETRIES)
def test_shrink_keeps_the_prefix_and_grows_back_zeroed(
    make_tensor: MakeTensor, g: int, granules: float, segments: int, exact: bool
) -> None:
    rng = random.Random(f"{granules}/{segments}/{exact}")
    capacity = int(granules * g) // BLOCK * BLOCK
    t = make_tensor(capacity * segments, segments, handle_sizing=HandleSizing(max_bytes=2 * g))
    # Grown in uneven steps, so handles straddle segment ends and the new frontier.
    for step in (1, 3, capacity // BLOCK):
        t.resize_per_segment_(min(step * BLOCK, capacity))
    fill_blocks(t, seed=5)
    for _ in range(3):
        new = [rng.randrange(0, t.segment_bytes[s] + 1, BLOCK) for s in range(segments)]
        before = t.physical_bytes
        t.shrink_per_segment_(new, exact=exact)
        assert list(t.segment_bytes) == new
        assert t.physical_bytes <= before
        check(t, exact)
        for s in range(segments):
            assert torch.equal(t.segment_view(s).cpu(), expected(t, s, new[s], 5)), s
    t.resize_per_segment_(capacity)
    check(t, True)
    for s, data in enumerate(contents(t)):
        kept = new[s]
        assert torch.equal(data[:kept], expected(t, s, kept, 5))
        assert not data[kept:].any(), f"segment {s}: grown-back bytes are not zero"


def test_plain_shrink_keeps_the_straddling_handle_exact_trims_it(
    make_tensor: MakeTensor, g: int
) -> None:
    t = make_tensor(16 * g, handle_sizing=HandleSizing(max_bytes=8 * g))
    t.resize_(16 * g)
    assert t.handle_runs() == [(0, 8), (8, 8)]
    t.shrink_(3 * g + 1)
    assert t.handle_runs() == [(0, 8)]  # the dead handle went, the straddler stayed whole
    assert t.wait_released(10) and t.physical_bytes == 8 * g
    t.shrink_(3 * g + 1, exact=True)
    assert t.handle_runs() == [(0, 4)]
    assert t.wait_released(10) and t.physical_bytes == 4 * g
    t.shrink_(0, exact=True)
    assert t.handle_runs() == [] and t.wait_released(10) and t.physical_bytes == 0


def test_a_granule_a_neighbour_still_needs_stays(make_tensor: MakeTensor, g: int) -> None:
    # Two segments of 1.5 granules share granule 1.
    t = make_tensor(3 * g, 2)
    t.resize_per_segment_(3 * g // 2)
    fill_blocks(t, seed=9)
    t.shrink_per_segment_([3 * g // 2, 0], exact=True)
    assert mapped_granules(t) == [0, 1]
    assert torch.equal(t.segment_view(0).cpu(), expected(t, 0, 3 * g // 2, 9))
    t.shrink_per_segment_([g // 2, 0], exact=True)
    assert mapped_granules(t) == [0]


def test_consolidate_keeps_every_byte_and_backs_each_segment_by_one_handle(
    make_tensor: MakeTensor, g: int
) -> None:
    segments, granules = 3, 16
    t = make_tensor(segments * granules * g, segments)
    full = t.full_view()
    ptr = full.data_ptr()
    for step in range(1, 65):  # grown in 64 steps, to 3/4 of the capacity
        t.resize_per_segment_(step * 12 * g // 64)
    assert t.num_handles > 3 * segments
    fill_blocks(t, seed=3)
    before = contents(t)
    t.consolidate()
    assert t.handle_runs() == [(s * granules, 12) for s in range(segments)]
    assert full.data_ptr() == ptr
    check(t, True)
    for s, data in enumerate(contents(t)):
        assert torch.equal(data, before[s]), s
    assert torch.equal(full[: 4 * BLOCK].cpu(), before[0][: 4 * BLOCK])
    t.consolidate()  # nothing left to do
    assert t.num_handles == segments
    # Full segments are one run of granules: one handle for all of it.
    t.resize_per_segment_(granules * g)
    t.consolidate()
    assert t.handle_runs() == [(0, segments * granules)]
    for s, data in enumerate(contents(t)):
        assert torch.equal(data[: 12 * g], before[s]), s
    # Segments that share granules: one handle per maximal run.
    shared = make_tensor(3 * g, 2, handle_sizing=HandleSizing(max_bytes=g))
    shared.resize_per_segment_(3 * g // 2)
    fill_blocks(shared, seed=4)
    shared.consolidate()
    assert shared.handle_runs() == [(0, 3)]
    assert torch.equal(shared.segment_view(1).cpu(), expected(shared, 1, 3 * g // 2, 4))


def test_consolidate_after_a_plain_shrink_drops_the_slack(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(16 * g, handle_sizing=HandleSizing(max_bytes=8 * g))
    t.resize_(16 * g)
    fill_blocks(t, seed=1)
    t.shrink_(5 * g)
    assert t.wait_released(10) and t.physical_bytes == 8 * g
    t.consolidate()
    assert t.handle_runs() == [(0, 5)]
    assert torch.equal(t.segment_view(0).cpu(), expected(t, 0, 5 * g, 1))


def _two_steps(make_tensor: MakeTensor, g: int, **kw: Any) -> ExtensibleTensor:
    """Two runs of granules, [0, 6) and [8, 11), each over several handles, filled: a
    consolidate of two steps."""
    t = make_tensor(2 * 8 * g, 2, handle_sizing=HandleSizing(max_bytes=2 * g), **kw)
    for step in (1, 3, 6):
        t.resize_per_segment_(step * g)
    t.shrink_per_segment_([6 * g, 3 * g])
    fill_blocks(t, seed=5)
    return t


def _calls_in_consolidate(make_tensor: MakeTensor, g: int, op: str) -> tuple[int, int]:
    """How many calls of `op` the two-step setup makes, and then its consolidate."""
    counter = _two_steps(make_tensor, g, _profile=True)
    setup = counter._profile_report()[op][0]
    counter.consolidate()
    total = counter._profile_report()[op][0]
    counter.close()
    return setup, total - setup


def test_a_consolidate_failing_past_its_first_step_keeps_every_byte_not_the_handles(
    make_tensor: MakeTensor, g: int
) -> None:
    # The README's word: each step is all or nothing, not the whole call. The second step's
    # swap fails: its last map, at the tensor's addresses.
    setup, maps = _calls_in_consolidate(make_tensor, g, "map")
    t = _two_steps(make_tensor, g, _fault=("map", setup + maps, "driver"))
    ptr, data, old = t.full_view().data_ptr(), contents(t), t.handle_runs()
    seg1_handles = [run for run in old if run[0] >= 8]
    assert len(seg1_handles) > 1 and len(old) > len(seg1_handles) + 1
    with pytest.raises(DriverError):
        t.consolidate()
    assert t.segment_bytes == (6 * g, 3 * g)
    assert t.full_view().data_ptr() == ptr
    assert all(torch.equal(a, b) for a, b in zip(contents(t), data, strict=True))
    assert t.handle_runs() == [(0, 6), *seg1_handles]  # the first (largest) step is done
    assert t.take_deferred_errors() == []
    t._check_invariants()
    t.consolidate()  # the fault was one call: again, it finishes
    assert t.handle_runs() == [(0, 6), (8, 3)]
    assert all(torch.equal(a, b) for a, b in zip(contents(t), data, strict=True))


def test_a_consolidate_redoes_in_its_turn_a_step_it_could_not_stage_ahead(
    make_tensor: MakeTensor, g: int
) -> None:
    # The second step is staged while the first is swapped in (memory allows, here); its create
    # then runs out of memory, and the step is staged again once the first has given its old
    # handles back: the call succeeds (staged in its turn only, the step would have failed).
    setup, creates = _calls_in_consolidate(make_tensor, g, "create")
    assert creates == 2
    t = _two_steps(make_tensor, g, _fault=("create", setup + 2, "oom"))
    data = contents(t)
    t.consolidate()
    assert t.handle_runs() == [(0, 6), (8, 3)]
    assert all(torch.equal(a, b) for a, b in zip(contents(t), data, strict=True))
    assert t.take_deferred_errors() == []
    t._check_invariants()


def test_shrink_refuses_what_it_cannot_do(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(4 * g, 2)
    t.resize_per_segment_(g)
    with pytest.raises(ValueError, match="cannot grow segment 1"):
        t.shrink_per_segment_([g, g + 1])
    with pytest.raises(ValueError, match="exceeds the capacity"):
        t.shrink_per_segment_(3 * g)
    with pytest.raises(ValueError, match="one segment"):
        t.shrink_(0)
    assert list(t.segment_bytes) == [g, g]
    t.close()
    with pytest.raises(ClosedError):
        t.shrink_per_segment_(0)
    with pytest.raises(ClosedError):
        t.consolidate()


# --------------------------------------------------------------------------------------------
# all or nothing: a failure at any driver call changes nothing


def _setup(make_tensor: MakeTensor, g: int, **kw: Any) -> ExtensibleTensor:
    # Two aligned segments grown in steps (several handles each), then filled.
    t = make_tensor(2 * 8 * g, 2, handle_sizing=HandleSizing(max_bytes=2 * g), **kw)
    for step in (1, 3, 8):
        t.resize_per_segment_(step * g - (BLOCK if step < 8 else 0))
    fill_blocks(t, seed=7)
    return t


def _snapshot(t: ExtensibleTensor) -> tuple[Any, ...]:
    data = [bytes(d.numpy()) for d in contents(t)]
    return (list(t.segment_bytes), t.physical_bytes, list(t.handle_runs()), data)


# Each waits for what it gave back (released on the tensor's thread once the stream has passed
# the call), so that the driver calls counted are all of the operation's.
OPERATIONS = {
    "exact shrink": lambda t, g: (
        t.shrink_per_segment_(4 * g + BLOCK, exact=True),
        t.wait_released(10),
    ),
    "plain shrink": lambda t, g: (t.shrink_per_segment_(3 * g), t.wait_released(10)),
    "consolidate": lambda t, g: t.consolidate(),
}


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_every_failed_call_leaves_the_tensor_unchanged(
    make_tensor: MakeTensor, g: int, operation: str
) -> None:
    run = OPERATIONS[operation]
    counter = _setup(make_tensor, g, _profile=True)
    setup_calls = {op: n for op, (n, _) in counter._profile_report(reset=True).items()}
    run(counter, g)
    calls = {op: n for op, (n, _) in counter._profile_report().items() if n}
    counter.close()
    injected = 0
    for op, num_calls in calls.items():
        if op in ("release", "free_reservation"):
            continue  # only in destructors, after the swap: reported later, never undone
        for k in range(1, num_calls + 1):
            for kind in ("driver", "oom"):
                nth = setup_calls.get(op, 0) + k
                t = _setup(make_tensor, g, _fault=(op, nth, kind), _profile=True)
                before = _snapshot(t)
                error: type[Exception] = OutOfMemoryError if kind == "oom" else DriverError
                try:
                    run(t, g)
                except error:
                    assert _snapshot(t) == before, f"{op} call {k} ({kind})"
                    assert t.take_deferred_errors() == []
                    t._check_invariants()
                    run(t, g)  # only the nth call fails: the same operation now succeeds
                    injected += 1
                else:
                    made = {o: n for o, (n, _) in t._profile_report().items()}
                    if made.get(op, 0) < nth:
                        # The release thread's waits depend on timing (with host events
                        # that complete late, whether the event had completed when it
                        # looked): this run made fewer such calls than the counted one.
                        assert op == "wait_event", f"{op}: {made.get(op, 0)} calls, not {nth}"
                        t.close()
                        continue
                    # The call was a clean-up after the swap (unmapping the scratch copy), or
                    # the release thread's (its wait, its event's destroy, its unmap): the
                    # operation took effect and the failure is reported, not lost.
                    assert op in ("unmap", "wait_event"), f"{op} call {k} ({kind}) did not fail"
                    assert any("INJECTED" in e for e in t.take_deferred_errors())
                t._check_invariants()
                for s in range(2):
                    got = t.segment_view(s).cpu().clone()
                    assert torch.equal(got, expected(t, s, got.numel(), 7))
                t.close()
    # A plain shrink whose release is deferred (CUDA; the host backend with delayed events)
    # can fail only at its event's record: its unmaps run on the tensor's thread afterwards.
    deferred = counter.backend != "host" or bool(os.environ.get(HOST_EVENT_DELAY))
    assert injected >= (2 if deferred and operation == "plain shrink" else 10), calls
