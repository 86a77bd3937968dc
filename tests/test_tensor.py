"""The Python API of `ExtensibleTensor`, every test on every backend (see conftest.py).

Sizes are in units of the tensor's granularity `g`. Bytes are only ever read or written inside
granules that are mapped: touching anything else faults (SIGSEGV on the host backend).
"""

from __future__ import annotations

import gc
import itertools
import logging
import subprocess
import sys
import textwrap
import threading
import weakref
from typing import Any

import extensible_kv
import numpy as np
import pytest
import torch
from extensible_kv import (
    ClosedError,
    DriverError,
    ExtensibleTensor,
    HandleSizing,
    OutOfMemoryError,
    UnsupportedError,
)
from support.devices import CPU_GRANULARITY
from support.memory import MakeTensor, mapped_granules, needed_granules

# --------------------------------------------------------------------------------------------
# helpers


def pattern(n: int, seed: int) -> torch.Tensor:
    """`n` deterministic non-zero bytes (1..251), different for different seeds."""
    return ((torch.arange(n, dtype=torch.int64) * 31 + seed * 7) % 251 + 1).to(torch.uint8)


def write(t: ExtensibleTensor, offset: int, data: torch.Tensor) -> None:
    """Writes `data` (uint8) at byte `offset` of the reservation, through a full view."""
    t.full_view()[offset : offset + data.numel()].copy_(data)


def read(t: ExtensibleTensor, offset: int, n: int) -> torch.Tensor:
    """A host copy of bytes `[offset, offset + n)` of the reservation."""
    return t.full_view()[offset : offset + n].cpu().clone()


def committed_contents(t: ExtensibleTensor) -> list[torch.Tensor]:
    """A host copy of the committed prefix of every segment."""
    return [t.segment_view(i).cpu().clone() for i in range(t.num_segments)]


def snapshot(t: ExtensibleTensor) -> tuple[Any, ...]:
    return (t.segment_bytes, t.physical_bytes, t.num_handles, list(t.handle_runs()))


def check(t: ExtensibleTensor) -> None:
    """The invariants, from the inside and from the outside."""
    t._check_invariants()
    mapped = mapped_granules(t)
    assert len(mapped) == len(set(mapped)), "a granule is mapped twice"
    # Growth only, so what is mapped is exactly what the committed prefixes need: whole
    # granules covering them, each shared granule once.
    assert set(mapped) == needed_granules(t)
    assert t.physical_bytes == len(mapped) * t.granularity
    assert t.num_handles == len(t.handle_runs())
    for committed, capacity in zip(t.segment_bytes, t.segment_capacities, strict=True):
        assert 0 <= committed <= capacity


def expect_zero(data: torch.Tensor) -> None:
    assert int(data.count_nonzero()) == 0, f"{int(data.count_nonzero())} non-zero bytes"


# --------------------------------------------------------------------------------------------
# construction and properties


def test_construction_and_properties(make_tensor: MakeTensor, g: int, device: str) -> None:
    t = make_tensor(8 * g, 2)
    assert isinstance(t, ExtensibleTensor)
    assert isinstance(t.base_ptr, int) and t.base_ptr != 0
    assert t.base_ptr % g == 0
    assert t.capacity_bytes == 8 * g
    assert t.segment_capacity_bytes == 4 * g
    assert t.segment_capacities == (4 * g, 4 * g)
    assert t.segment_offsets == (0, 4 * g)
    assert t.bytes_per_segment == 0
    assert t.segment_bytes == (0, 0)
    assert t.num_segments == 2
    assert t.physical_bytes == 0
    assert t.num_handles == 0
    assert t.handle_runs() == []
    assert t.granularity == g
    assert t.live_views == 0
    assert t.closed is False
    if device == "cpu":
        assert (t.device, t.backend, t.__dlpack_device__()) == ("cpu", "host", (1, 0))
    else:
        assert (t.device, t.backend, t.__dlpack_device__()) == ("cuda:0", "cuda", (2, 0))
    assert t.take_deferred_errors() == []
    text = repr(t)
    assert text.startswith("ExtensibleTensor(")
    for part in (f"device={t.device}", f"backend={t.backend}", f"capacity_bytes={8 * g}"):
        assert part in text
    assert "num_segments=2" in text
    check(t)

    assert t.resize_per_segment_(g // 2) is t  # in place, returns self like torch's `_`
    assert "physical_bytes" in repr(t) and str(2 * g) in repr(t)
    assert t.segment_bytes == (g // 2, g // 2)
    assert t.bytes_per_segment == g // 2
    check(t)


def test_single_segment_defaults(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(3 * g)
    assert t.num_segments == 1
    assert t.segment_capacities == (3 * g,)
    assert t.resize_(g + 1) is t
    assert t.segment_bytes == (g + 1,)
    assert t.physical_bytes == 2 * g
    check(t)


def test_device_accepts_str_and_torch_device(make_tensor: MakeTensor, device: str) -> None:
    if device == "cpu":
        specs: list[Any] = ["cpu", " cpu ", torch.device("cpu")]
        expected = "cpu"
    else:
        specs = ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0)]
        expected = "cuda:0"
    for spec in specs:
        t = make_tensor(2 * CPU_GRANULARITY, device=spec)
        assert t.device == expected, spec
        t.close()


def test_default_device_and_granularity_is_cpu_2mib() -> None:
    with ExtensibleTensor(1) as t:
        assert t.device == "cpu"
        assert t.backend == "host"
        assert t.granularity == 2 << 20
        assert t.capacity_bytes == 1
    assert t.closed  # the context manager closes


def test_vmm_unavailable_reason() -> None:
    assert extensible_kv.vmm_unavailable_reason("cpu") is None
    assert extensible_kv.vmm_unavailable_reason(torch.device("cpu")) is None
    reason = extensible_kv.vmm_unavailable_reason("tpu")
    assert isinstance(reason, str) and "tpu" in reason
    cuda = extensible_kv.vmm_unavailable_reason("cuda:0")
    assert cuda is None or (isinstance(cuda, str) and cuda)


def test_exception_hierarchy() -> None:
    assert issubclass(ClosedError, ValueError)
    assert issubclass(OutOfMemoryError, MemoryError)
    assert issubclass(DriverError, RuntimeError)
    assert issubclass(extensible_kv.UnsupportedError, RuntimeError)


# --------------------------------------------------------------------------------------------
# construction errors

CONSTRUCTOR_VALUE_ERRORS = {
    "not divisible": (lambda g: ((4 * g + 1, 2), {}), "divisible"),
    "zero capacity": (lambda g: ((0,), {}), r"^max_bytes must be at least 1, got 0$"),
    "zero segments": (lambda g: ((4 * g, 0), {}), "num_segments"),
    "capacities sum": (
        lambda g: ((4 * g,), {"segment_capacities": [g, 2 * g]}),
        "sum to",
    ),
    "capacities count": (
        lambda g: ((3 * g, 2), {"segment_capacities": [g, g, g]}),
        "num_segments",
    ),
    "capacities zero entry": (
        lambda g: ((2 * g,), {"segment_capacities": [2 * g, 0]}),
        "capacity 0",
    ),
    "capacities empty": (lambda g: ((0,), {"segment_capacities": []}), "segment"),
    "granularity not power of two": (lambda g: ((4 * g,), {"granularity": 3 * g}), "power of two"),
    "granularity zero": (lambda g: ((4 * g,), {"granularity": 0}), "granularity"),
    "granularity below backend's": (
        # not a page multiple on cpu; not a multiple of the driver's on cuda
        lambda g: ((4 * g,), {"granularity": 1024 if g == CPU_GRANULARITY else g // 2}),
        "granularity",
    ),
    "max_bytes of handles not a multiple": (
        lambda g: ((4 * g,), {"handle_sizing": HandleSizing(max_bytes=g + g // 2)}),
        "handle_sizing",
    ),
    "max_bytes of handles below granularity": (
        lambda g: ((4 * g,), {"handle_sizing": HandleSizing(max_bytes=g // 2)}),
        "handle_sizing",
    ),
    "max_bytes of handles zero": (
        lambda g: ((4 * g,), {"handle_sizing": HandleSizing(max_bytes=0)}),
        "handle_sizing",
    ),
    "per-run pieces not a multiple": (
        lambda g: ((4 * g,), {"handle_sizing": HandleSizing("per_run", g + 512)}),
        "granularity",
    ),
    "per-run pieces zero": (
        lambda g: ((4 * g,), {"handle_sizing": HandleSizing("per_run", 0)}),
        "granularity",
    ),
    "whole runs with a cap": (
        lambda g: ((4 * g,), {"handle_sizing": HandleSizing("whole_runs", g)}),
        "handle_sizing",
    ),
    "unknown handle sizing": (
        lambda g: ((4 * g,), {"handle_sizing": HandleSizing("huge")}),  # type: ignore[arg-type]
        "handle_sizing.kind",
    ),
}


@pytest.mark.parametrize("case", list(CONSTRUCTOR_VALUE_ERRORS))
def test_constructor_value_errors(make_tensor: MakeTensor, g: int, case: str) -> None:
    build, match = CONSTRUCTOR_VALUE_ERRORS[case]
    args, kwargs = build(g)
    with pytest.raises(ValueError, match=match) as info:
        make_tensor(*args, **kwargs)
    assert type(info.value) is ValueError


@pytest.mark.parametrize("kind", ["cap_aligned", "aligned_powers_of_two", "per_run"])
def test_only_the_default_handle_cap_rises_to_a_larger_granularity(kind: str) -> None:
    """With a 2 GiB granularity, a `max_bytes` given is taken as it is (1 GiB is refused as
    512 MiB is), and only `None`, the default, rises to the granule."""
    gib = 1 << 30
    for max_bytes in (gib // 2, gib, 3 * gib):
        sizing = HandleSizing(kind, max_bytes)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"max_bytes \\({max_bytes}\\)"):
            ExtensibleTensor(8 * gib, device="cpu", granularity=2 * gib, handle_sizing=sizing)
    for sizing in (HandleSizing(kind, None), HandleSizing(kind, 4 * gib)):  # type: ignore[arg-type]
        with ExtensibleTensor(8 * gib, device="cpu", granularity=2 * gib, handle_sizing=sizing):
            pass


@pytest.mark.parametrize("index", [0, np.int64(0), torch.tensor(0)], ids=["int", "numpy", "torch"])
def test_a_cuda_index_is_a_device_as_torch_takes_it(index: Any) -> None:
    """`device=N` is `cuda:N`, as for torch: the same tensor, or the same refusal where CUDA
    is unusable (no GPU here), and the same `vmm_unavailable_reason`."""
    assert extensible_kv.vmm_unavailable_reason(index) == extensible_kv.vmm_unavailable_reason(
        "cuda:0"
    )
    try:
        expected = ExtensibleTensor(4096, device="cuda:0")
    except UnsupportedError as error:
        with pytest.raises(UnsupportedError) as info:
            ExtensibleTensor(4096, device=index)
        assert str(info.value) == str(error)
    else:
        with expected, ExtensibleTensor(4096, device=index) as t:
            assert t.device == expected.device == "cuda:0"


@pytest.mark.parametrize(
    ("device", "error"), [(True, TypeError), (-1, ValueError), (2**32, ValueError)]
)
def test_a_bad_cuda_index_is_named(device: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="device"):
        ExtensibleTensor(4096, device=device)
    with pytest.raises(error, match="device"):
        extensible_kv.vmm_unavailable_reason(device)


@pytest.mark.parametrize("spec", ["tpu", "gpu", "", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "CPU"])
def test_unknown_device_is_value_error(spec: str) -> None:
    with pytest.raises(ValueError, match="device"):
        ExtensibleTensor(8192, device=spec, granularity=4096)


# `handle_sizing:<kind>` stands for the `max_bytes` of a `HandleSizing` of that kind.
SIZE_ARGS = [
    "max_bytes",
    "num_segments",
    "granularity",
    "handle_sizing:cap_aligned",
    "handle_sizing:per_run",
]


def _size_kwargs(g: int, name: str, value: object) -> dict[str, Any]:
    """A one-segment tensor's arguments with `value` for the size argument `name`."""
    argument, _, kind = name.partition(":")
    if kind:
        return {"max_bytes": 4 * g, "num_segments": 1, argument: HandleSizing(kind, value)}  # type: ignore[arg-type]
    return {"max_bytes": 4 * g, "num_segments": 1, argument: value}


@pytest.mark.parametrize("value", [-1, -(2**70), 2**64, 2**70])
@pytest.mark.parametrize("name", SIZE_ARGS)
def test_constructor_out_of_range_ints_are_value_errors(
    make_tensor: MakeTensor, g: int, name: str, value: int
) -> None:
    with pytest.raises(ValueError) as info:
        make_tensor(**_size_kwargs(g, name, value))
    assert not isinstance(info.value, OverflowError)
    assert name.partition(":")[0] in str(info.value)


@pytest.mark.parametrize("value", [1.5, "4096", b"4096", True, [4096], object()])
@pytest.mark.parametrize("name", SIZE_ARGS)
def test_constructor_non_ints_are_type_errors(
    make_tensor: MakeTensor, g: int, name: str, value: Any
) -> None:
    with pytest.raises(TypeError):
        make_tensor(**_size_kwargs(g, name, value))


@pytest.mark.parametrize(
    ("sizing", "match"),
    [
        ("per_run", "handle_sizing must be a HandleSizing, not str"),
        (4096, "handle_sizing must be a HandleSizing, not int"),
        (HandleSizing(1), "handle_sizing.kind must be a str, not int"),  # type: ignore[arg-type]
    ],
)
def test_handle_sizing_of_another_type_is_a_type_error(
    make_tensor: MakeTensor, g: int, sizing: object, match: str
) -> None:
    with pytest.raises(TypeError, match=match):
        make_tensor(4 * g, handle_sizing=sizing)


def test_segment_capacities_entry_errors(make_tensor: MakeTensor, g: int) -> None:
    with pytest.raises(ValueError, match="segment_capacities"):
        make_tensor(g, segment_capacities=[2 * g, -g])
    with pytest.raises(ValueError, match="segment_capacities"):
        make_tensor(g, segment_capacities=[2**64])
    with pytest.raises(TypeError):
        make_tensor(2 * g, segment_capacities=[g, 1.0 * g])
    with pytest.raises(TypeError):
        make_tensor(2 * g, segment_capacities=2 * g)  # not iterable


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
# views

DTYPES = [torch.uint8, torch.int32, torch.float16, torch.bfloat16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_views_of_every_dtype(make_tensor: MakeTensor, g: int, dtype: torch.dtype) -> None:
    t = make_tensor(4 * g, 2)
    t.resize_per_segment_(g)
    itemsize = torch.empty((), dtype=dtype).element_size()
    device = torch.device(t.device)

    full = t.full_view(dtype)
    assert full.dtype == dtype and full.device == device
    assert full.shape == (4 * g // itemsize,)
    assert full.data_ptr() == t.base_ptr
    assert full.untyped_storage().nbytes() == 4 * g

    n = g // itemsize
    seg = t.segment_view(1, dtype)
    assert seg.dtype == dtype and seg.shape == (n,) and seg.is_contiguous()
    assert seg.data_ptr() == t.base_ptr + t.segment_offsets[1]
    assert seg.untyped_storage().nbytes() == t.segment_bytes[1] == g

    values = (torch.arange(n, dtype=torch.float32) % 50).to(dtype).to(device)
    seg.copy_(values)
    raw = values.view(torch.uint8).cpu()
    # the same bytes through a uint8 segment view, a typed full view and an offset view
    assert torch.equal(t.segment_view(1).cpu(), raw)
    assert torch.equal(full[2 * g // itemsize : 2 * g // itemsize + n].view(torch.uint8).cpu(), raw)
    at = t.view(dtype, (n,), offset=2 * g)
    assert at.data_ptr() == t.base_ptr + 2 * g
    assert torch.equal(at.view(torch.uint8).cpu(), raw)

    # a write through the full view shows in the segment view
    full[2 * g // itemsize] = torch.tensor(3, dtype=torch.float32).to(dtype)
    assert float(seg[0].float()) == 3.0
    del full, seg, at
    assert t.live_views == 0


def test_strided_views(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(4 * g, 2)
    t.resize_per_segment_(g)
    base = t.base_ptr

    # a transposed 2-D view
    rows, cols = 16, 32
    a = t.view(torch.float32, (rows, cols))
    b = t.view(torch.float32, (cols, rows), strides=(1, cols))
    assert a.is_contiguous() and not b.is_contiguous()
    assert b.stride() == (1, cols) and b.data_ptr() == a.data_ptr() == base
    assert b.untyped_storage().nbytes() == rows * cols * 4
    a.copy_(torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols))
    assert torch.equal(b.cpu(), a.t().cpu())
    b[3, 5] = -42.0
    assert float(a[5, 3]) == -42.0

    # the K/V split of a paged cache: blocks laid out as [B][K|V][N][H][D], viewed as
    # (2, B, N, H, D) with strides, in segment 1
    blocks, tokens, heads, dim = 4, 16, 2, 8
    per_kv = tokens * heads * dim
    offset = t.segment_offsets[1]
    kv = t.view(
        torch.bfloat16,
        (2, blocks, tokens, heads, dim),
        strides=(per_kv, 2 * per_kv, heads * dim, dim, 1),
        offset=offset,
    )
    assert kv.shape == (2, blocks, tokens, heads, dim)
    assert kv.stride() == (per_kv, 2 * per_kv, heads * dim, dim, 1)
    assert kv.data_ptr() == base + offset
    assert kv.untyped_storage().nbytes() == 2 * blocks * per_kv * 2
    kv[0].fill_(-2.0)
    kv[1].fill_(1.5)
    kv[1, 2, 3, 1, 4] = 7.0
    layout = t.view(torch.bfloat16, (blocks, 2, tokens, heads, dim), offset=offset)
    assert bool((layout[:, 0] == -2.0).all())
    assert float(layout[2, 1, 3, 1, 4]) == 7.0
    assert int((layout[:, 1] == 1.5).sum()) == blocks * per_kv - 1
    assert torch.equal(kv.cpu(), layout.permute(1, 0, 2, 3, 4).cpu())

    # a byte offset
    x = t.view(torch.int32, (4,), offset=8)
    assert x.data_ptr() == base + 8
    x.copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int32))
    assert torch.equal(
        read(t, 8, 16), torch.tensor([1, 2, 3, 4], dtype=torch.int32).view(torch.uint8)
    )

    # an empty view
    empty = t.view(torch.float32, (0, 5), offset=4 * g)
    assert empty.numel() == 0 and empty.untyped_storage().nbytes() == 0


def test_view_pointers_never_move(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(8 * g, 2)
    base = t.base_ptr
    t.resize_per_segment_(100)
    full = t.full_view()
    segs = [t.segment_view(i) for i in range(2)]
    typed = t.view(torch.float16, (50,), offset=t.segment_offsets[1])
    for i in range(2):
        segs[i].copy_(pattern(100, i))
    pointers = [full.data_ptr(), *(s.data_ptr() for s in segs), typed.data_ptr()]
    for size in [g, g + 1, 3 * g, 4 * g]:
        t.resize_per_segment_(size)
        assert t.base_ptr == base
        assert [full.data_ptr(), *(s.data_ptr() for s in segs), typed.data_ptr()] == pointers
        for i in range(2):
            assert t.segment_view(i).data_ptr() == pointers[1 + i]
            assert torch.equal(segs[i].cpu(), pattern(100, i))  # old views see the same bytes
            # and the full view sees what a fresh segment view sees
            off = t.segment_offsets[i]
            assert torch.equal(full[off : off + size].cpu(), t.segment_view(i).cpu())
        check(t)


def test_view_errors(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(4 * g, 2)
    t.resize_per_segment_(g)
    cap = t.capacity_bytes
    with pytest.raises(ValueError, match="capacity"):
        t.view(torch.uint8, (cap + 1,))
    with pytest.raises(ValueError, match="capacity"):
        t.view(torch.uint8, (1,), offset=cap)
    with pytest.raises(ValueError, match="capacity"):
        t.view(torch.float32, (g,), offset=cap - 4 * g + 4)
    with pytest.raises(ValueError, match="capacity"):
        t.view(torch.float32, (2, 2), strides=(cap, 1))
    with pytest.raises(ValueError):
        t.view(torch.uint8, (2**62, 2**62))  # more bytes than 64 bits hold
    with pytest.raises(ValueError, match="offset"):
        t.view(torch.int32, (4,), offset=2)  # misaligned
    with pytest.raises(ValueError, match="offset"):
        t.view(torch.uint8, (4,), offset=-1)
    with pytest.raises(ValueError, match=r"^strides\[0\] must be at least 0, got -4$"):
        t.view(torch.float32, (4, 4), strides=(-4, 1), offset=64)
    with pytest.raises(ValueError, match=r"^shape\[0\] must be at least 0, got -1$"):
        t.view(torch.float32, (-1, 4))
    with pytest.raises(ValueError, match="length"):
        t.view(torch.float32, (4, 4), strides=(1,))
    with pytest.raises(IndexError):
        t.segment_view(2)
    with pytest.raises(IndexError):
        t.segment_view(-1)
    with pytest.raises(ValueError):
        t._capsule(cap, 1)
    with pytest.raises(ValueError):
        t._capsule(2**63, 2**63)  # offset + size overflows
    with pytest.raises(ValueError):
        t._capsule(-1, 1)
    t.resize_per_segment_([g, g + 2])
    with pytest.raises(ValueError, match="multiple"):
        t.segment_view(1, torch.int32)
    odd = make_tensor(g + 2, segment_capacities=[g, 2])
    with pytest.raises(ValueError, match="multiple"):
        odd.full_view(torch.float32)
    assert t.live_views == 0  # no failed view leaked a guard
    check(t)


# --------------------------------------------------------------------------------------------
# lifetimes


def test_view_outlives_tensor(
    make_tensor: MakeTensor, g: int, device: str, leak_check: Any
) -> None:
    before = leak_check()
    t = make_tensor(2 * g, 2)
    t.resize_per_segment_(g // 2)
    view = t.segment_view(1)
    full = t.full_view()
    view.fill_(7)
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None  # the Python object is gone; the memory is not
    assert bool((view == 7).all())
    view.add_(1)
    assert bool((full[g : g + g // 2] == 8).all())
    full[:16] = 3
    assert bool((full[:16] == 3).all())
    if device == "cpu":
        assert leak_check() != before
    del view
    gc.collect()
    assert bool((full[g : g + g // 2] == 8).all())  # the last view keeps it alive
    del full
    gc.collect()
    if device == "cpu":
        assert leak_check() == before  # the last view released memory and address space


def test_close_with_live_views(
    make_tensor: MakeTensor, g: int, device: str, leak_check: Any
) -> None:
    before = leak_check()
    t = make_tensor(4 * g, 2)
    t.resize_per_segment_(g)
    view = t.segment_view(0)
    assert t.live_views == 1
    with pytest.raises(BufferError, match="1 view"):
        t.close()
    assert not t.closed
    t.resize_per_segment_(2 * g)  # still usable
    view.fill_(5)
    assert bool((t.segment_view(0)[:g] == 5).all())
    check(t)
    del view
    gc.collect()
    assert t.live_views == 0
    t.close()
    assert t.closed
    t.close()  # idempotent
    assert t.closed
    assert (t.segment_bytes, t.physical_bytes, t.num_handles) == ((0, 0), 0, 0)
    t._check_invariants()
    assert "ExtensibleTensor(" in repr(t)
    if device == "cpu":
        assert leak_check() == before


def test_leaving_with_on_an_exception_never_hides_it(
    make_tensor: MakeTensor, g: int, device: str, leak_check: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception raised in `with` while a view is alive comes out unchanged (not as the
    BufferError of the close that cannot run); the view keeps the memory, freed when it dies.
    Without an exception, `with` still refuses to end with a view alive."""
    before = leak_check()

    class Boom(Exception):
        pass

    with pytest.raises(Boom) as info, caplog.at_level(logging.WARNING, "extensible_kv"):
        with make_tensor(4 * g, 2) as t:
            t.resize_per_segment_(g)
            view = t.segment_view(0)
            raise Boom("the user's error")
    assert str(info.value) == "the user's error"
    assert info.value.__context__ is None  # raised as it was, not while handling another
    assert any("BufferError: cannot close: 1 view" in note for note in info.value.__notes__)
    assert "did not close" in caplog.text
    assert not t.closed
    view.fill_(3)  # the view is still good
    del view, info
    gc.collect()
    t.close()
    with pytest.raises(BufferError, match="1 view"):
        with make_tensor(4 * g, 2) as t:
            t.resize_per_segment_(g)
            view = t.segment_view(0)
    del view
    gc.collect()
    t.close()
    if device == "cpu":
        assert leak_check() == before


def test_closed_tensor_raises_closed_error(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(4 * g, 2)
    t.resize_per_segment_(g)
    t.close()
    calls = [
        lambda: t.resize_per_segment_(2 * g),
        lambda: t.resize_per_segment_(0),  # a no-op on an open tensor
        lambda: t.resize_per_segment_([0, 0]),
        lambda: t.full_view(),
        lambda: t.segment_view(0),
        lambda: t.view(torch.uint8, (4,)),
        lambda: t.base_ptr,
        lambda: t.release_physical(),
        lambda: t._capsule(0, 16),
        lambda: t.__dlpack__(),
        lambda: torch.from_dlpack(t),
    ]
    for call in calls:
        with pytest.raises(ClosedError):
            call()
    single = make_tensor(2 * g)
    single.close()
    with pytest.raises(ClosedError):
        single.resize_(g)
    with pytest.raises(ClosedError):
        single.resize_(0)
    assert t.live_views == 0


def test_dlpack_protocol(make_tensor: MakeTensor, g: int, device: str, leak_check: Any) -> None:
    before = leak_check()
    t = make_tensor(4 * g, 2)
    t.resize_per_segment_(g)
    x = torch.from_dlpack(t)
    assert x.dtype == torch.uint8
    assert x.shape == (t.capacity_bytes,)
    assert x.device == torch.device(t.device)
    assert x.data_ptr() == t.base_ptr
    assert t.live_views == 1
    x[:g].copy_(pattern(g, 3))
    assert torch.equal(t.segment_view(0).cpu(), pattern(g, 3))
    with pytest.raises(BufferError):
        t.__dlpack__(copy=True)
    other = (2, 0) if device == "cpu" else (1, 0)
    with pytest.raises(BufferError):
        t.__dlpack__(dl_device=other)
    assert '"dltensor"' in repr(t.__dlpack__())  # the legacy capsule without max_version
    assert "dltensor_versioned" in repr(t.__dlpack__(max_version=(1, 0)))
    gc.collect()
    assert t.live_views == 1
    del t
    gc.collect()
    assert torch.equal(x[:g].cpu(), pattern(g, 3))  # x keeps the memory alive
    x[:8] = 9
    assert bool((x[:8] == 9).all())
    del x
    gc.collect()
    if device == "cpu":
        assert leak_check() == before


@pytest.mark.parametrize("versioned", [True, False])
def test_unconsumed_capsule_releases_its_view(
    make_tensor: MakeTensor, g: int, versioned: bool
) -> None:
    t = make_tensor(2 * g)
    capsule = t._capsule(0, 16, versioned)
    assert t.live_views == 1
    with pytest.raises(BufferError):
        t.close()
    del capsule
    gc.collect()
    assert t.live_views == 0
    t.close()


def test_deleter_runs_on_another_thread(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(2 * g)
    t.resize_(g)
    box = [t.segment_view(0)]
    assert t.live_views == 1
    died: list[bool] = []

    def drop() -> None:
        view = box.pop()  # the main thread holds no reference any more
        view.fill_(4)
        ref = weakref.ref(view)
        del view  # the last reference dies here: the DLPack deleter runs on this thread
        died.append(ref() is None)

    thread = threading.Thread(target=drop)
    thread.start()
    thread.join()
    assert died == [True]
    assert t.live_views == 0
    assert bool((t.segment_view(0) == 4).all())
    t.close()
    assert t.closed


def test_concurrent_grows_keep_invariants(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(32 * g, 2)
    errors: list[BaseException] = []

    def grow(sizes: list[int]) -> None:
        for size in sizes:
            try:
                t.resize_per_segment_(size)
            except ValueError as err:  # the other thread got further: a shrink is refused
                if "shrink" not in str(err):
                    errors.append(err)
            except BaseException as err:  # pragma: no cover - reported below
                errors.append(err)

    steps = [k * g // 3 for k in range(1, 49)]
    threads = [threading.Thread(target=grow, args=(steps[i::2],)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert t.segment_bytes == (steps[-1],) * 2
    check(t)


# --------------------------------------------------------------------------------------------
# release_physical


def test_release_physical(make_tensor: MakeTensor, g: int, device: str, leak_check: Any) -> None:
    before = leak_check()
    t = make_tensor(4 * g, 2)
    base = t.base_ptr
    t.release_physical()  # nothing to release
    size = g + g // 2
    t.resize_per_segment_(size)
    for i in range(2):
        t.segment_view(i).copy_(pattern(size, i))
    if device == "cpu":
        assert leak_check() != before
    views = [t.segment_view(i) for i in range(2)]
    pointers = [v.data_ptr() for v in views]

    t.release_physical()  # allowed with live views: they must not be touched until regrown
    assert t.wait_released(10)  # released on the tensor's thread once the stream has passed
    assert (t.segment_bytes, t.physical_bytes, t.num_handles) == ((0, 0), 0, 0)
    assert t.handle_runs() == []
    assert t.base_ptr == base and not t.closed
    check(t)
    if device == "cpu":
        assert leak_check() == before  # no memfd and no memfd mapping left
    t.release_physical()  # again: still fine

    t.resize_per_segment_(size)
    check(t)
    assert t.base_ptr == base
    for i in range(2):
        fresh = t.segment_view(i)
        assert fresh.data_ptr() == pointers[i]
        expect_zero(fresh.cpu())  # new memory, zeroed
        expect_zero(views[i].cpu())  # the old views see it too
    del views, fresh
    gc.collect()
    t.close()
    if device == "cpu":
        assert leak_check() == before


def test_release_keeps_the_addresses_and_resume_the_sizes(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(8 * g, 2)
    sizes = (3 * g + 5, 2 * g)
    t.resize_per_segment_(list(sizes))
    for i in range(2):
        t.segment_view(i).copy_(pattern(sizes[i], i))
    base, kept = t.base_ptr, [t.segment_view(i)[:g].cpu().clone() for i in range(2)]

    t.release(g)
    assert t.released and t.segment_bytes == (g, g) and t.pending_release_bytes == 0
    assert t.physical_bytes == len(needed_granules(t)) * g
    t.release()  # again: nothing changes, and the sizes to resume stay the first ones
    assert t.segment_bytes == (g, g)
    for i in range(2):
        assert torch.equal(t.segment_view(i).cpu(), kept[i])
    t.resume()
    assert not t.released and t.segment_bytes == sizes and t.base_ptr == base
    for i in range(2):
        assert torch.equal(t.segment_view(i)[:g].cpu(), kept[i])
        expect_zero(t.segment_view(i)[g:].cpu())
    t.resume()  # not released: nothing
    assert t.segment_bytes == sizes

    t.release()
    assert (t.segment_bytes, t.physical_bytes) == ((0, 0), 0)
    t.resume(zero_new=False)
    assert t.segment_bytes == sizes
    check(t)


def test_free_gives_the_memory_back_and_the_addresses_with_the_last_view(
    make_tensor: MakeTensor, g: int
) -> None:
    t = make_tensor(4 * g)
    t.resize_(2 * g)
    view = t.full_view()
    assert t.free() is False  # a view is alive: the addresses stay reserved for it
    assert (t.physical_bytes, t.pending_release_bytes, t.closed) == (0, 0, False)
    assert t.live_views == 1 and not t.released
    del view
    gc.collect()
    assert t.free() is True and t.closed
    assert t.free() is True  # idempotent


def test_the_handle_sizing_kinds_are_the_cores(make_tensor: MakeTensor, g: int) -> None:
    """`HandleSizingKind` restates the native kinds for type checkers: the same names, and
    each one builds a tensor."""
    import typing

    from extensible_kv import _native
    from extensible_kv.tensor import HandleSizingKind

    assert typing.get_args(HandleSizingKind) == _native.HANDLE_SIZING_KINDS
    assert HandleSizing().kind == _native.HANDLE_SIZING_KINDS[0]  # the default comes first
    for kind in _native.HANDLE_SIZING_KINDS:
        make_tensor(4 * g, handle_sizing=HandleSizing(kind)).resize_(3 * g)  # type: ignore[arg-type]


def test_a_call_without_a_stream_asks_the_provider_only_when_it_uses_one(
    make_tensor: MakeTensor, g: int, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The facade registers torch's current stream once; the native method asks for it only
    where it uses a stream (never on the host backend, which has none)."""
    from extensible_kv import _native
    from extensible_kv import tensor as tensor_module

    asked: list[int] = []

    def provider(index: int) -> int:
        asked.append(index)
        return tensor_module._current_stream(index)

    t = make_tensor(8 * g)
    _native._set_stream_provider(provider)
    try:
        t.resize_(2 * g)
        t.resize_(2 * g)  # nothing to do: no stream either
        t.resize_(3 * g, zero_new=False)  # nothing to zero: no stream
        t.shrink_(g, stream=0)  # given: used as it is
        grew_zeroed = len(asked)
        t.shrink_(0)
    finally:
        _native._set_stream_provider(tensor_module._current_stream)
    if device == "cpu":
        assert asked == []
    else:
        assert (grew_zeroed, asked) == (1, [0, 0])


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
# sizes that cannot be reserved


@pytest.mark.parametrize(
    ("max_bytes", "granularity"),
    [
        (2**64 - 4096, 4096),  # the capacity fits 64 bits; reserving it does not
        (4096, 2**63),  # a huge granularity: the reservation is one 2**63-byte granule
        (2**62, 4096),  # more address space than the process has
    ],
    ids=["capacity-near-2**64", "granularity-2**63", "capacity-2**62"],
)
def test_unreservable_sizes_are_value_or_memory_errors(max_bytes: int, granularity: int) -> None:
    """An argument too large to reserve is the caller's error (ValueError) or an
    out-of-memory condition (OutOfMemoryError), never a backend failure of some other kind."""
    with pytest.raises((ValueError, OutOfMemoryError)):
        ExtensibleTensor(max_bytes, device="cpu", granularity=granularity)


@pytest.mark.parametrize("exponent", [40, 62])
def test_absurd_segment_counts_do_not_crash(exponent: int) -> None:
    """`num_segments` beyond what memory can describe must be an exception, not an abort.

    Run in a child process (with its address space capped) because the failure mode is the
    process dying."""
    code = textwrap.dedent(
        f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        import extensible_kv
        n = 2**{exponent}
        try:
            extensible_kv.ExtensibleTensor(n, n, granularity=4096)
        except (ValueError, MemoryError) as err:
            print("raised", type(err).__name__)
        except BaseException as err:
            print("wrong exception", type(err).__name__, err)
        else:
            print("constructed")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0 and result.stdout.startswith("raised"), (
        result.returncode,
        result.stdout,
        result.stderr[-600:],
    )


def test_profile_counts_driver_calls(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(8 * g, 2, handle_sizing=HandleSizing(max_bytes=g), _profile=True)
    t.resize_per_segment_(3 * g)
    times = t._profile_report(reset=True)
    assert times["create"][0] == times["map"][0] == t.num_handles == 6
    assert all(ns >= 0 for _, ns in times.values())
    assert t._profile_report() == {}
    assert make_tensor(8 * g)._profile_report() == {}
