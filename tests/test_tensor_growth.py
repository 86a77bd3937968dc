"""`ExtensibleTensor` grows: refused resizes change nothing, lockstep growth, shared granules,
zeroing, the handle policies, and every failed driver call rolled back (fault injection).
Every test on every backend; sizes in units of the granularity `g`."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from extensible_kv import (
    ClosedError,
    DriverError,
    HandleSizing,
    OutOfMemoryError,
)
from support.memory import MakeTensor, mapped_granules
from support.tensor_checks import (
    check,
    committed_contents,
    expect_zero,
    pattern,
    read,
    snapshot,
    write,
)

# --------------------------------------------------------------------------------------------
# resize errors: ValueError/TypeError, and the tensor is unchanged


def _resize_error_cases(g: int) -> list[tuple[str, Any, type[Exception], str]]:
    # (method, argument, exception, message fragment); the tensor has 2 segments of 4g, g each
    return [
        ("per_segment", g // 2, ValueError, "shrink"),
        ("per_segment", [g, g - 1], ValueError, "shrink segment 1"),
        ("per_segment", [g, 4 * g + 1], ValueError, "segment 1"),
        ("per_segment", [5 * g, g], ValueError, "segment 0"),
        ("per_segment", 4 * g + 1, ValueError, "capacity"),
        ("per_segment", [g], ValueError, "2 per-segment"),
        ("per_segment", [g, g, g], ValueError, "2 per-segment"),
        ("per_segment", -1, ValueError, "bytes_per_segment"),
        ("per_segment", [g, -1], ValueError, "bytes_per_segment"),
        ("per_segment", 2**64, ValueError, "bytes_per_segment"),
        ("per_segment", 2**70, ValueError, "bytes_per_segment"),
        ("per_segment", [2 * g, 2**70], ValueError, "bytes_per_segment"),
        ("per_segment", 1.5 * g, TypeError, "float"),
        ("per_segment", None, TypeError, "NoneType"),
        ("per_segment", True, TypeError, "bool"),
        ("per_segment", [2 * g, 2.0 * g], TypeError, "float"),
        ("per_segment", [2 * g, None], TypeError, "NoneType"),
        ("resize_", 2 * g, ValueError, "resize_per_segment_"),
    ]


def test_resize_errors_leave_tensor_unchanged(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(8 * g, 2)
    t.resize_per_segment_(g)
    for i in range(2):
        t.segment_view(i).copy_(pattern(g, i))
    before, contents = snapshot(t), committed_contents(t)
    for method, arg, exc, match in _resize_error_cases(g):
        with pytest.raises(exc, match=match) as info:
            if method == "resize_":
                t.resize_(arg)
            else:
                t.resize_per_segment_(arg)
        assert not isinstance(info.value, OverflowError), (method, arg)
        assert snapshot(t) == before, (method, arg)
        check(t)
    for i, data in enumerate(committed_contents(t)):
        assert torch.equal(data, contents[i])
    t.resize_per_segment_(4 * g)  # still usable
    check(t)


def test_single_segment_resize_errors(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(4 * g)
    t.resize_(g)
    before = snapshot(t)
    for arg, exc in [
        (-1, ValueError),
        (2**64, ValueError),
        (2**70, ValueError),
        (4 * g + 1, ValueError),
        (g - 1, ValueError),
        (1.5, TypeError),
        (True, TypeError),
        ("8192", TypeError),
        (None, TypeError),
    ]:
        with pytest.raises(exc) as info:
            t.resize_(arg)
        assert not isinstance(info.value, OverflowError), arg
        assert snapshot(t) == before, arg
        check(t)


def test_capacity_error_message_names_the_segment(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(6 * g, segment_capacities=[g, 2 * g, 3 * g])
    with pytest.raises(ValueError, match=rf"{2 * g + 1} bytes exceeds the capacity of segment 1"):
        t.resize_per_segment_([0, 2 * g + 1, 0])
    assert t.segment_bytes == (0, 0, 0) and t.physical_bytes == 0


# --------------------------------------------------------------------------------------------
# growth


def test_equal_size_resize_is_a_noop(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(8 * g, 2)
    t.resize_per_segment_(0)
    assert snapshot(t) == ((0, 0), 0, 0, [])
    size = g + g // 2 + 8
    t.resize_per_segment_(size)
    for i in range(2):
        t.segment_view(i).copy_(pattern(size, i))
    before, contents = snapshot(t), committed_contents(t)
    t.resize_per_segment_(size, zero_new=True)  # nothing is new: nothing may be zeroed
    t.resize_per_segment_([size, size])
    t.resize_per_segment_((size, size), zero_new=False)
    assert snapshot(t) == before
    for i, data in enumerate(committed_contents(t)):
        assert torch.equal(data, contents[i])
    check(t)


def test_noop_check_matches_what_a_resize_would_do(make_tensor: MakeTensor, g: int) -> None:
    # The facade skips the native call (and the torch stream lookup) when this says a resize
    # would change nothing: it must never say so for a resize that grows or raises.
    t = make_tensor(8 * g, 2)
    t.resize_per_segment_(g)
    assert t._is_noop_resize(g) and t._is_noop_resize([g, g]) and t._is_noop_resize((g, g))
    for refused_or_growing in (g + 1, [g, g + 1], [g], [g, g, g], g // 2, -1, 1.5, None, "x"):
        assert not t._is_noop_resize(refused_or_growing), refused_or_growing
    assert t.resize_per_segment_(g) is t
    single = make_tensor(4 * g)
    assert single._is_noop_resize([0]) and not single._is_noop_resize([0, 0])
    assert not t._is_noop_resize([0])  # resize_ on two segments raises instead
    with pytest.raises(ValueError, match="resize_per_segment_"):
        t.resize_(g)
    single.close()
    assert not single._is_noop_resize([0])  # closed: the resize raises ClosedError
    with pytest.raises(ClosedError):
        single.resize_(0)


def test_lockstep_growth(make_tensor: MakeTensor, g: int) -> None:
    # 3 segments of 2.5 granules: segments 0/1 and 1/2 share a granule.
    capacity = 2 * g + g // 2
    t = make_tensor(3 * capacity, 3)
    assert t.segment_offsets == (0, capacity, 2 * capacity)
    expected = [torch.empty(0, dtype=torch.uint8) for _ in range(3)]
    previous = 0
    for size in [0, 1, g // 3, g, g + 1, 2 * g - 7, 2 * g, capacity]:
        t.resize_per_segment_(size)
        assert t.segment_bytes == (size,) * 3
        assert t.bytes_per_segment == size
        check(t)
        for i in range(3):
            view = t.segment_view(i)
            assert view.numel() == size
            assert view.untyped_storage().nbytes() == size
            if size:  # torch gives an empty tensor a null data_ptr
                assert view.data_ptr() == t.base_ptr + t.segment_offsets[i]
            # the new bytes [previous, size) read zero, then get this step's pattern
            expect_zero(view[previous:].cpu())
            view[previous:].copy_(pattern(size - previous, 10 * i + size))
            expected[i] = torch.cat([expected[i], pattern(size - previous, 10 * i + size)])
        for i in range(3):  # writing one segment never clobbers another
            assert torch.equal(t.segment_view(i).cpu(), expected[i])
        previous = size
    assert t.physical_bytes == 8 * g  # 7.5 granules of capacity, reserved as 8


def test_shared_granule_is_mapped_once(make_tensor: MakeTensor, g: int) -> None:
    """The issue's dedup case: 3 granules, 2 segments of 1.5 granules each, grown from half a
    granule per segment to full: granule 1 holds the end of segment 0 and the start of
    segment 1, and must be mapped once."""
    t = make_tensor(3 * g, 2)
    half = g // 2
    assert t.segment_offsets == (0, g + half)
    written: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * 2
    previous = 0
    for size, physical in [(half, 2 * g), (g, 3 * g), (g + half, 3 * g)]:
        t.resize_per_segment_(size)
        assert t.physical_bytes == physical
        check(t)
        for i in range(2):
            view = t.segment_view(i)
            expect_zero(view[previous:].cpu())
            chunk = pattern(size - previous, 100 * i + size)
            view[previous:].copy_(chunk)
            written[i] = torch.cat([written[i], chunk])
        previous = size
    assert t.physical_bytes == 3 * g
    assert sorted(mapped_granules(t)) == [0, 1, 2]
    for i in range(2):
        assert torch.equal(t.segment_view(i).cpu(), written[i])
    # bytes written through segment views are where the full view says they are
    assert torch.equal(read(t, 0, g + half), written[0])
    assert torch.equal(read(t, g + half, g + half), written[1])


def test_unequal_segment_capacities(make_tensor: MakeTensor, g: int) -> None:
    caps = [g + 100, 2 * g + 28, g // 2 - 128]  # not granule multiples: offsets straddle
    t = make_tensor(sum(caps), segment_capacities=caps)
    assert t.num_segments == 3
    assert t.segment_capacities == tuple(caps)
    assert t.segment_offsets == (0, caps[0], caps[0] + caps[1])
    assert t.capacity_bytes == sum(caps)
    with pytest.raises(ValueError, match="segment_capacities"):
        t.segment_capacity_bytes  # noqa: B018
    check(t)
    contents = [torch.empty(0, dtype=torch.uint8) for _ in caps]
    previous = [0, 0, 0]
    steps = [[50, 0, 10], [50, 0, 10], [caps[0], g, 10], [caps[0], g, caps[2]], caps]
    for step in steps:
        t.resize_per_segment_(step)
        assert t.segment_bytes == tuple(step)
        check(t)
        for i in range(3):
            view = t.segment_view(i)
            assert view.numel() == step[i]
            expect_zero(view[previous[i] :].cpu())
            chunk = pattern(step[i] - previous[i], 7 * i + step[i])
            view[previous[i] :].copy_(chunk)
            contents[i] = torch.cat([contents[i], chunk])
        for i in range(3):
            assert torch.equal(t.segment_view(i).cpu(), contents[i])
        previous = list(step)
        if len(set(step)) > 1:
            with pytest.raises(ValueError, match="segment_bytes"):
                t.bytes_per_segment  # noqa: B018
    assert t.physical_bytes == 4 * g  # 3.5 granules of capacity, every granule needed once


@pytest.mark.parametrize("zero_new", [True, False])
def test_zero_new(make_tensor: MakeTensor, g: int, device: str, zero_new: bool) -> None:
    cap = 4 * g
    t = make_tensor(2 * cap, 2)
    old, new = g // 4, 2 * g + g // 2
    t.resize_per_segment_(old)
    assert t.physical_bytes == 2 * g  # granules 0 and 4, each partly committed
    for i in range(2):
        base = t.segment_offsets[i]
        write(t, base, pattern(old, i))  # the committed prefix
        # The rest of the already-mapped granule is accessible, though not committed: fill it
        # with junk that a zeroing grow must clear.
        write(t, base + old, torch.full((g - old,), 0xCD, dtype=torch.uint8))
    t.resize_per_segment_(new, zero_new=zero_new)
    check(t)
    for i in range(2):
        base = t.segment_offsets[i]
        assert torch.equal(read(t, base, old), pattern(old, i)), "committed bytes changed"
        if zero_new:
            expect_zero(read(t, base + old, new - old))  # exactly the new range [old, new)
        elif device == "cpu":
            # Only newly logical bytes are zeroed, and only when asked: with zero_new=False
            # the junk inside the granule that was mapped before stays; the granules mapped
            # by this grow are fresh memfd pages, which read zero on the host backend.
            assert bool((read(t, base + old, g - old) == 0xCD).all())
            expect_zero(read(t, base + g, new - g))


def test_zero_new_only_zeroes_the_new_range(make_tensor: MakeTensor, g: int) -> None:
    # A byte past the new committed prefix inside an already-mapped granule is not new logical
    # memory: a zeroing grow leaves it alone.
    t = make_tensor(2 * g)
    t.resize_(g // 4)
    write(t, 0, pattern(g // 4, 1))
    write(t, g // 4, torch.full((g - g // 4,), 0xEE, dtype=torch.uint8))
    t.resize_(g // 2, zero_new=True)
    assert torch.equal(read(t, 0, g // 4), pattern(g // 4, 1))
    expect_zero(read(t, g // 4, g // 4))
    assert bool((read(t, g // 2, g // 2) == 0xEE).all())


# --------------------------------------------------------------------------------------------
# handle policies


def _assert_aligned_powers_of_two(runs: list[tuple[int, int]]) -> None:
    for first, n in runs:
        assert n > 0 and n & (n - 1) == 0, runs
        assert first % n == 0, runs


def test_per_run_handles_of_a_granule_give_one_handle_per_granule(
    make_tensor: MakeTensor, g: int
) -> None:
    t = make_tensor(8 * g, handle_sizing=HandleSizing("per_run", g))
    t.resize_(8 * g)
    assert t.num_handles == 8
    assert t.handle_runs() == [(i, 1) for i in range(8)]
    check(t)
    t2 = make_tensor(8 * g, handle_sizing=HandleSizing("per_run", 2 * g))
    t2.resize_(7 * g)
    assert t2.handle_runs() == [(0, 2), (2, 2), (4, 2), (6, 1)]
    check(t2)


def test_aligned_powers_of_two_use_few_handles(make_tensor: MakeTensor, g: int) -> None:
    granules = 32  # per segment
    aligned = {"handle_sizing": HandleSizing("aligned_powers_of_two")}
    t = make_tensor(2 * granules * g, 2, **aligned)
    t.resize_per_segment_(512)  # one block per segment
    assert t.num_handles == 2
    t.resize_per_segment_(granules * g)
    check(t)
    runs = t.handle_runs()
    _assert_aligned_powers_of_two(runs)
    bound = 2 * (granules.bit_length() - 1) + 2
    for segment in range(2):
        lo, hi = segment * granules, (segment + 1) * granules
        inside = [r for r in runs if lo <= r[0] and r[0] + r[1] <= hi]
        assert 0 < len(inside) <= bound, (segment, runs)
    assert sum(n for _, n in runs) == 2 * granules

    bulk = make_tensor(2 * granules * g, 2, **aligned)
    bulk.resize_per_segment_(granules * g)  # from empty: one aligned power-of-two run
    assert bulk.handle_runs() == [(0, 2 * granules)]

    capped = make_tensor(16 * g, handle_sizing=HandleSizing("aligned_powers_of_two", 4 * g))
    capped.resize_(11 * g)
    assert capped.handle_runs() == [(0, 4), (4, 4), (8, 2), (10, 1)]
    check(capped)


def test_default_cuts_runs_only_at_cap_multiples(make_tensor: MakeTensor, g: int) -> None:
    # vLLM's layer-outermost layout: segments a granule apart, each grown from its first
    # block. Every run then starts one granule past a cap multiple: the default cuts it there
    # and at the cap multiples inside it, nowhere else.
    t = make_tensor(3 * 10 * g, 3, handle_sizing=HandleSizing(max_bytes=4 * g))
    t.resize_per_segment_(512)
    t.resize_per_segment_(9 * g)
    check(t)
    assert t.handle_runs() == [
        (0, 1), (1, 3), (4, 4), (8, 1),
        (10, 1), (11, 1), (12, 4), (16, 3),
        (20, 1), (21, 3), (24, 4), (28, 1),
    ]  # fmt: skip
    # A one-granule grow is one handle per segment.
    t.resize_per_segment_(10 * g)
    assert t.num_handles == 15
    check(t)


def test_one_handle_per_run_backs_each_segment_by_one_handle(
    make_tensor: MakeTensor, g: int
) -> None:
    # Three granule-aligned segments, a 4-granule cap that would cut each of them in pieces.
    t = make_tensor(3 * 11 * g, 3, handle_sizing=HandleSizing(max_bytes=4 * g))
    t.resize_per_segment_(g // 2)
    t.resize_per_segment_(9 * g)
    assert t.num_handles > 3  # the policy's cut
    t.release_physical()
    t.resize_per_segment_(9 * g, one_handle_per_run=True)
    assert t.handle_runs() == [(0, 9), (11, 9), (22, 9)]
    check(t)
    # A later grow goes back to the policy; the runs it adds are new handles.
    t.resize_per_segment_(10 * g)
    assert t.handle_runs() == [(0, 9), (9, 1), (11, 9), (20, 1), (22, 9), (31, 1)]
    check(t)


# --------------------------------------------------------------------------------------------
# all or nothing: fault injection

FAULT_OPS = ["create", "map", "set_access", "memset"]
# Calls of each op during the grow under test: 6 new granules, one handle each (create, map,
# set_access); two new logical ranges, each starting inside a granule mapped before (2
# memsets on every backend), plus one memset per fresh handle where fresh memory is not
# already zero (CUDA; the host backend's fresh memfds read zero).
FAULT_CALLS_IN_GROW = {"create": 6, "map": 6, "set_access": 6, "memset": 2}
FAULT_CALLS_IN_GROW_CUDA = {**FAULT_CALLS_IN_GROW, "memset": 8}


def _check_injected(err: Exception, op: str, kind: str, g: int) -> None:
    if kind == "driver":
        assert type(err) is DriverError
        assert isinstance(err, RuntimeError)
        assert err.code == "INJECTED_FAULT"  # type: ignore[attr-defined]
        assert err.op == op  # type: ignore[attr-defined]
    else:
        assert type(err) is OutOfMemoryError
        assert isinstance(err, MemoryError)
        assert err.code == "INJECTED_OOM"  # type: ignore[attr-defined]
        assert err.op == op  # type: ignore[attr-defined]
        assert err.requested_bytes > 0  # type: ignore[attr-defined]
        assert err.free_bytes is None  # type: ignore[attr-defined]
        if op in ("create", "map"):
            assert err.requested_bytes == g  # type: ignore[attr-defined]
    assert op in str(err)


@pytest.mark.parametrize("kind", ["driver", "oom"])
@pytest.mark.parametrize("op", FAULT_OPS)
def test_failed_grow_changes_nothing(
    make_tensor: MakeTensor, g: int, device: str, leak_check: Any, op: str, kind: str
) -> None:
    cap = 4 * g  # per segment
    start = [g // 4] * 2  # granules 0 and 4, partly committed
    target = [cap] * 2  # granules 1-3 and 5-7: 6 handles of at most g each
    host = device == "cpu"
    failures_in_grow = 0
    for nth in itertools.count(1):
        t = make_tensor(2 * cap, 2, handle_sizing=HandleSizing(max_bytes=g), _fault=(op, nth, kind))
        memfds = leak_check() if host else None
        try:
            t.resize_per_segment_(start)
        except (DriverError, OutOfMemoryError) as err:
            # the fault hit the first grow: from empty, it must stay empty
            _check_injected(err, op, kind, g)
            assert snapshot(t) == ((0, 0), 0, 0, [])
            check(t)
            if host:
                assert leak_check() == memfds
            t.resize_per_segment_(start)
            check(t)
            t.close()
            continue
        for i in range(2):
            base = t.segment_offsets[i]
            write(t, base, pattern(start[i], i))
            write(t, base + start[i], torch.full((g - start[i],), 0xCD, dtype=torch.uint8))
        before, contents = snapshot(t), committed_contents(t)
        memfds = leak_check() if host else None
        try:
            t.resize_per_segment_(target)
        except (DriverError, OutOfMemoryError) as err:
            failures_in_grow += 1
            _check_injected(err, op, kind, g)
            assert snapshot(t) == before, f"{op} #{nth}"
            check(t)
            for i, data in enumerate(committed_contents(t)):
                assert torch.equal(data, contents[i]), f"{op} #{nth}: segment {i} changed"
            if host:
                assert leak_check() == memfds, f"{op} #{nth}: memfds leaked"
            assert t.take_deferred_errors() == []
        else:
            t.close()
            break  # nth is past every call of op in both grows
        # the fault was the nth call only: the retry goes through
        t.resize_per_segment_(target)
        check(t)
        assert t.physical_bytes == 2 * cap and t.num_handles == 8
        for i in range(2):
            data = t.segment_view(i).cpu().clone()  # a copy: a live view would block close()
            assert torch.equal(data[: start[i]], contents[i])
            expect_zero(data[start[i] :])
        t.close()
    expected = FAULT_CALLS_IN_GROW_CUDA if device != "cpu" else FAULT_CALLS_IN_GROW
    assert failures_in_grow == expected[op]
