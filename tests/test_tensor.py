"""The Python API of `ExtensibleTensor`: construction, its properties and its refusals, every test
on every backend (see conftest.py). The other subjects: growth and its failures
(`test_tensor_growth.py`), views and lifetimes (`test_tensor_views.py`), memory given back
(`test_tensor_release.py`); their checks live in `support/tensor_checks.py`.

Sizes are in units of the tensor's granularity `g`. Bytes are only ever read or written inside
granules that are mapped: touching anything else faults (SIGSEGV on the host backend)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
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
from support.memory import MakeTensor
from support.tensor_checks import check

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
