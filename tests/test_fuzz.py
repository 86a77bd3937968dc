"""Hypothesis fuzz of the argument values of the constructor and of resizing (host backend).

Whatever the arguments, only ValueError (ClosedError is one), TypeError or OutOfMemoryError
may come out, never a crash or another exception; after any failure the invariants hold and
the tensor is unchanged. Valid sizes stay tiny (a few granules of 4 KiB) so this runs fast.
Sizes that are valid ints but too large to reserve, and absurd segment counts (2**40 segments
abort the process as of writing), are covered by dedicated tests in test_tensor.py rather
than drawn here, where one of them would kill the whole test run.
"""

from __future__ import annotations

from typing import Any

from extensible_kv import ClosedError, ExtensibleTensor, HandleSizing, OutOfMemoryError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.memory import memfd_counts

G = 4096
HANDLE_KINDS = ["cap_aligned", "aligned_powers_of_two", "per_run", "whole_runs"]
ALLOWED = (ValueError, TypeError, OutOfMemoryError)

SETTINGS = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
)

small_size = st.integers(0, 8 * G)
bad_int = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=2**64, max_value=2**80),
    st.sampled_from([-1, -(2**63), -(2**64), 2**64, 2**70, 2**64 - 1]),
)
not_int = st.one_of(
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.booleans(),
    st.just(b"1"),
    st.just(object()),
)
size = st.one_of(small_size, small_size, small_size, bad_int, not_int)
optional_size = st.one_of(st.none(), size)
granularity = st.one_of(
    st.none(),
    st.sampled_from([G, 2 * G, 4 * G, 16 * G, 2 << 20]),  # valid on the host backend
    st.sampled_from([0, 1, 512, 1024, 3 * G, G + 1, 12345]),  # invalid
    bad_int,
    not_int,
)
handle_bytes = st.one_of(
    st.none(),
    st.integers(1, 8).map(lambda k: k * G),
    st.integers(0, 4 * G),
    bad_int,
    not_int,
)
num_segments = st.one_of(st.none(), st.integers(-3, 24), bad_int, not_int)
capacities = st.one_of(
    st.none(),
    st.lists(st.integers(0, 3 * G), min_size=0, max_size=6),
    st.lists(st.integers(1, 3 * G), min_size=1, max_size=6),
    st.lists(size, min_size=0, max_size=4),
    not_int,
)


def _state(t: ExtensibleTensor) -> tuple[Any, ...]:
    return (t.segment_bytes, t.physical_bytes, t.num_handles, list(t.handle_runs()))


def _check_consistent(t: ExtensibleTensor) -> None:
    assert t.wait_released(10)  # what a shrink or release gave back goes on the tensor's thread
    t._check_invariants()
    g = t.granularity
    needed: set[int] = set()
    for offset, committed in zip(t.segment_offsets, t.segment_bytes, strict=True):
        if committed:
            needed.update(range(offset // g, -(-(offset + committed) // g)))
    mapped = [first + i for first, n in t.handle_runs() for i in range(n)]
    assert sorted(mapped) == sorted(needed)
    assert t.physical_bytes == len(needed) * g


@st.composite
def constructor_arguments(draw: st.DrawFn) -> dict[str, Any]:
    """Valid arguments, then none, one or all of them replaced by anything."""
    n = draw(st.integers(1, 6))
    gran = draw(st.sampled_from([None, G, 2 * G, 16 * G]))
    unit = gran or (2 << 20)
    args: dict[str, Any] = {
        "max_bytes": n * draw(st.integers(1, 2 * G)),
        "num_segments": draw(st.sampled_from([n, None])) if n == 1 else n,
        "segment_capacities": None,
        "match_sum": False,
        "granularity": gran,
        "handle_kind": draw(st.sampled_from(HANDLE_KINDS[:3])),
        "handle_bytes": draw(st.one_of(st.none(), st.integers(1, 4).map(lambda k: k * unit))),
    }
    if draw(st.booleans()):
        caps = draw(st.lists(st.integers(1, 3 * G), min_size=1, max_size=6))
        args.update(segment_capacities=caps, max_bytes=sum(caps), num_segments=None)
    if draw(st.booleans()):
        args.update(handle_kind="whole_runs", handle_bytes=None)
    fuzzed = {
        "max_bytes": size,
        "num_segments": num_segments,
        "segment_capacities": capacities,
        "match_sum": st.booleans(),
        "granularity": granularity,
        "handle_kind": st.one_of(st.sampled_from(HANDLE_KINDS), st.text(max_size=3)),
        "handle_bytes": st.one_of(st.none(), handle_bytes),
    }
    mode = draw(st.sampled_from(["valid", "one", "one", "all"]))
    args["must_work"] = mode == "valid"
    if mode == "one":
        name = draw(st.sampled_from(sorted(fuzzed)))
        args[name] = draw(fuzzed[name])
    elif mode == "all":
        args = {name: draw(strategy) for name, strategy in fuzzed.items()} | {"must_work": False}
    return args


@SETTINGS
@given(kwargs=constructor_arguments())
def test_constructor_arguments(kwargs: dict[str, Any]) -> None:
    max_bytes = kwargs["max_bytes"]
    num_segments = kwargs["num_segments"]
    segment_capacities = kwargs["segment_capacities"]
    granularity = kwargs["granularity"]
    handle_sizing = HandleSizing(kwargs["handle_kind"], kwargs["handle_bytes"])
    match_sum = kwargs["match_sum"]
    if match_sum and isinstance(segment_capacities, list):
        if all(type(c) is int for c in segment_capacities):
            max_bytes = sum(segment_capacities)  # make the capacities valid more often
    before = memfd_counts()
    try:
        t = ExtensibleTensor(
            max_bytes,
            num_segments,
            "cpu",
            segment_capacities=segment_capacities,
            granularity=granularity,
            handle_sizing=handle_sizing,
        )
    except ALLOWED as err:
        event(f"constructor raised {type(err).__name__}")
        assert not kwargs["must_work"], f"valid arguments refused: {err!r}"
        assert memfd_counts() == before
        return
    event("constructed")
    with t:
        assert t.capacity_bytes == max_bytes
        assert sum(t.segment_capacities) == max_bytes
        assert all(c > 0 for c in t.segment_capacities)
        if segment_capacities is not None:
            assert list(t.segment_capacities) == list(segment_capacities)
        elif num_segments is not None:
            assert t.num_segments == num_segments
        if granularity is not None:
            assert t.granularity == granularity
        assert t.segment_bytes == (0,) * t.num_segments
        assert t.physical_bytes == 0
        _check_consistent(t)
        t.resize_per_segment_(list(t.segment_capacities))  # the whole capacity commits
        _check_consistent(t)
    assert t.closed
    assert memfd_counts() == before


def _valid_targets(t: ExtensibleTensor, targets: Any) -> bool:
    """Whether `resize_per_segment_(targets)` must succeed on open `t`."""
    n = t.num_segments
    if type(targets) is int:
        targets = [targets] * n
    elif isinstance(targets, list):  # a sequence of ints; bytes and str are refused
        if len(targets) != n or any(type(b) is not int for b in targets):
            return False
    else:
        return False
    return all(
        old <= new <= cap
        for old, new, cap in zip(t.segment_bytes, targets, t.segment_capacities, strict=True)
    )


segment_count = st.one_of(st.just(1), st.integers(1, 5))
per_segment_capacity = st.integers(1, 3 * G)


def one_target(cap: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, cap), st.integers(0, cap), st.integers(cap, cap + G), bad_int)


@st.composite
def targets_for(draw: st.DrawFn, n: int, cap: int) -> Any:
    one = one_target(cap)
    return draw(
        st.one_of(
            one,
            st.lists(one, min_size=n, max_size=n),
            st.lists(one, min_size=n, max_size=n),
            st.lists(one, min_size=0, max_size=n + 2),
            not_int,
            st.lists(st.one_of(one, not_int), min_size=n, max_size=n),
        )
    )


@st.composite
def resize_programs(draw: st.DrawFn) -> tuple[int, int, list[tuple[str, Any, bool]]]:
    n = draw(segment_count)
    cap = draw(per_segment_capacity)
    ops = []
    for _ in range(draw(st.integers(1, 10))):
        op = draw(
            st.sampled_from(["per_segment"] * 6 + ["resize_"] * 2 + ["release", "close", "view"])
        )
        if op == "per_segment":
            ops.append((op, draw(targets_for(n, cap)), draw(st.booleans())))
        elif op == "resize_":
            arg = draw(st.one_of(one_target(cap), one_target(cap), targets_for(n, cap)))
            ops.append((op, arg, draw(st.booleans())))
        elif op == "view":
            ops.append(
                (op, (draw(st.integers(-8, n * cap + 8)), draw(st.integers(-8, 4 * G))), False)
            )
        else:
            ops.append((op, None, False))
    return n, cap, ops


@SETTINGS
@given(program=resize_programs(), fixed=st.booleans())
def test_resize_arguments(
    program: tuple[int, int, list[tuple[str, Any, bool]]], fixed: bool
) -> None:
    n, cap, ops = program
    before = memfd_counts()
    sizing = HandleSizing("per_run", G) if fixed else HandleSizing(max_bytes=2 * G)
    t = ExtensibleTensor(n * cap, n, "cpu", granularity=G, handle_sizing=sizing)
    try:
        closed = False
        for op, arg, zero_new in ops:
            state = _state(t)
            try:
                if op == "per_segment":
                    expect_ok = not closed and _valid_targets(t, arg)
                    t.resize_per_segment_(arg, zero_new=zero_new)
                    target = [arg] * n if type(arg) is int else list(arg)
                elif op == "resize_":
                    expect_ok = not closed and n == 1 and type(arg) is int
                    expect_ok = expect_ok and _valid_targets(t, arg)
                    t.resize_(arg, zero_new=zero_new)
                    target = [arg]
                    assert type(arg) is int
                elif op == "release":
                    expect_ok = not closed
                    t.release_physical()
                    target = [0] * n
                elif op == "view":
                    offset, num_bytes = arg
                    expect_ok = not closed and 0 <= offset and 0 <= num_bytes
                    expect_ok = expect_ok and offset + num_bytes <= n * cap
                    capsule = t._capsule(offset, num_bytes)
                    assert t.live_views == 1
                    del capsule
                    assert t.live_views == 0
                    target = list(state[0])
                else:
                    t.close()
                    closed, expect_ok, target = True, True, [0] * n
            except ALLOWED as err:
                event(f"{op} raised {type(err).__name__}")
                assert not expect_ok, f"{op}({arg!r}) failed: {err!r}"
                if closed and op == "release":
                    assert isinstance(err, ClosedError)
                assert _state(t) == state, f"{op}({arg!r}) changed the tensor"
                _check_consistent(t)
                continue
            event(f"{op} succeeded")
            assert expect_ok, f"{op}({arg!r}) should have failed"
            assert list(t.segment_bytes) == target
            _check_consistent(t)
    finally:
        t.close()
    assert memfd_counts() == before
