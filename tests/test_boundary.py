"""Every public argument is checked at the door (issue 22): a wrong type is a `TypeError`, a
value out of range a `ValueError`, each naming the argument, and the object is unchanged.
Integer-likes (numpy and torch integer scalars) are sizes. Also here: a stray access on the
host backend says what it hit, the host budget is the backend's own figure, and the wording
of the messages issue 22 lists.
"""

from __future__ import annotations

import gc
import inspect
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import extensible_kv
import numpy as np
import pytest
import torch
from extensible_kv import (
    AttentionLayerSpec,
    ExtensibleKVCache,
    ExtensibleTensor,
    HandleSizing,
    KVCacheFlow,
    KVCacheTensorSpec,
    OutOfMemoryError,
    UnsupportedError,
    _native,
    sizing,
)
from extensible_kv.vllm import ExtensibleTensor as DropIn
from extensible_kv.vllm import granule_size
from support.devices import CPU_GRANULARITY

G = CPU_GRANULARITY
PAGE = 2 * 16 * 2 * 32 * 2  # K and V of a 16-token block, 2 heads of 32, bf16


def _spec() -> list[KVCacheTensorSpec]:
    layer = AttentionLayerSpec("FLASH_ATTN", 16, 2, 32, torch.bfloat16)
    return [KVCacheTensorSpec(PAGE, {"layers.0": layer})]


def _tensor() -> ExtensibleTensor:
    t = ExtensibleTensor(8 * G, 2, "cpu", granularity=G)
    t.resize_per_segment_(G)
    return t


def _tensor_state(t: ExtensibleTensor) -> tuple[Any, ...]:
    return (t.segment_bytes, t.physical_bytes, t.num_handles, t.handle_runs(), t.closed)


def _cache() -> ExtensibleKVCache:
    cache = ExtensibleKVCache(_spec(), 64, "cpu", granularity=G)
    cache.commit(2)
    return cache


def _cache_state(cache: ExtensibleKVCache) -> tuple[Any, ...]:
    return (cache.committed_blocks, cache.physical_bytes, cache.closed)


def _flow() -> KVCacheFlow:
    return KVCacheFlow.reserve(_spec(), 64, "cpu", granularity=G)


def _flow_state(flow: KVCacheFlow) -> tuple[Any, ...]:
    return _cache_state(flow.cache)


def _dropin() -> DropIn:
    t = DropIn(4 * granule_size("cpu"), "cpu", num_segments=2)
    t.resize_per_segment_(4096)
    return t


def _dropin_state(t: DropIn) -> tuple[Any, ...]:
    return (t.num_bytes, t.physical_bytes, t.num_physical_chunks)


@dataclass(frozen=True)
class Case:
    """One bad argument of one public method: `call(obj, value)` must raise `error` naming
    `name`, and leave `state(obj)` as it was."""

    owner: str
    name: str
    value: Any
    error: type[Exception]
    call: Callable[[Any, Any], object]


OWNERS: dict[str, tuple[Callable[[], Any], Callable[[Any], tuple[Any, ...]]]] = {
    "tensor": (_tensor, _tensor_state),
    "cache": (_cache, _cache_state),
    "flow": (_flow, _flow_state),
    "dropin": (_dropin, _dropin_state),
}

BAD_INT = [1.5, "4096", None, True, np.float32(2.0), object()]
BAD_FLAG = ["yes", 1, None, 2.0]
BAD_DTYPE = ["float32", np.float32, np.dtype("float16"), int, 4]


def _cases() -> list[Case]:
    cases: list[Case] = []

    def add(owner: str, name: str, values: list[Any], error: type[Exception], call: Any) -> None:
        cases.extend(Case(owner, name, v, error, call) for v in values)

    # ExtensibleTensor: the constructor, then every method with an argument.
    for kwarg in ("num_segments", "granularity"):
        add("tensor", kwarg, [1.5, "2", True], TypeError,
            lambda t, v, k=kwarg: ExtensibleTensor(8 * G, device="cpu", **{k: v}))  # fmt: skip
    add("tensor", "handle_sizing", ["per_run", ("per_run", G), 4 * G], TypeError,
        lambda t, v: ExtensibleTensor(8 * G, device="cpu", handle_sizing=v))  # fmt: skip
    for kind in ("cap_aligned", "per_run"):
        add("tensor", "handle_sizing", [1.5, "2", True], TypeError,
            lambda t, v, k=kind: ExtensibleTensor(
                8 * G, device="cpu", handle_sizing=HandleSizing(k, v)))  # fmt: skip
        add("tensor", "handle_sizing", [-1, 0, 3 * G // 2, 2**64], ValueError,
            lambda t, v, k=kind: ExtensibleTensor(
                8 * G, device="cpu", handle_sizing=HandleSizing(k, v)))  # fmt: skip
    add("tensor", "max_bytes", [1.5, "8192", None, True], TypeError,
        lambda t, v: ExtensibleTensor(v, device="cpu"))  # fmt: skip
    add("tensor", "max_bytes", [-1, 0, 2**64], ValueError,
        lambda t, v: ExtensibleTensor(v, device="cpu"))  # fmt: skip
    add("tensor", "export_handle_types", [1.5, {1}, [None], True], TypeError,
        lambda t, v: ExtensibleTensor(G, device="cpu", export_handle_types=v))  # fmt: skip
    add("tensor", "bytes_per_segment", BAD_INT, TypeError, lambda t, v: t.lend(v))
    for method in ("borrow", "give_back", "reclaim"):
        add("tensor", "loan", [None, 5, ("cpu", G)], TypeError,
            lambda t, v, m=method: getattr(t, m)(v))  # fmt: skip
    add("tensor", "export_handle_types", [-1, 2**40, "bogus"], ValueError,
        lambda t, v: ExtensibleTensor(G, device="cpu", export_handle_types=v))  # fmt: skip
    # An int is a CUDA index, as torch takes it (`3` is `cuda:3`): a negative one is the bad int.
    add("tensor", "device", ["tpu", -3, 2**40, "cuda:x"], ValueError,
        lambda t, v: ExtensibleTensor(G, device=v))  # fmt: skip
    add("tensor", "device", [True], TypeError, lambda t, v: ExtensibleTensor(G, device=v))
    for method in ("resize_per_segment_", "shrink_per_segment_"):
        add("tensor", "bytes_per_segment", [*BAD_INT, b"12", "ab", [G, 1.5]], TypeError,
            lambda t, v, m=method: getattr(t, m)(v))  # fmt: skip
        add("tensor", "bytes_per_segment", [-1, 2**64, [G, -1], [G]], ValueError,
            lambda t, v, m=method: getattr(t, m)(v))  # fmt: skip
        add("tensor", "stream", [1.5, "0"], TypeError,
            lambda t, v, m=method: getattr(t, m)(2 * G, stream=v))  # fmt: skip
        add("tensor", "stream", [-1, 2**64], ValueError,
            lambda t, v, m=method: getattr(t, m)(2 * G, stream=v))  # fmt: skip
    for method in ("resize_", "shrink_"):
        add("tensor", "num_bytes", [1.5, "4096", None, True, [G]], TypeError,
            lambda t, v, m=method: getattr(t, m)(v))  # fmt: skip
        add("tensor", "num_bytes", [-1, 2**64], ValueError,
            lambda t, v, m=method: getattr(t, m)(v))  # fmt: skip
    add("tensor", "zero_new", BAD_FLAG, TypeError,
        lambda t, v: t.resize_per_segment_(2 * G, zero_new=v))  # fmt: skip
    add("tensor", "one_handle_per_run", BAD_FLAG, TypeError,
        lambda t, v: t.resize_per_segment_(2 * G, one_handle_per_run=v))  # fmt: skip
    add("tensor", "exact", BAD_FLAG, TypeError,
        lambda t, v: t.shrink_per_segment_(G, exact=v))  # fmt: skip
    add("tensor", "stream", [1.5, -1], (TypeError, ValueError),  # type: ignore[arg-type]
        lambda t, v: t.consolidate(stream=v))  # fmt: skip
    add("tensor", "stream", [1.5, -1], (TypeError, ValueError),  # type: ignore[arg-type]
        lambda t, v: t.release_physical(stream=v))  # fmt: skip
    add("tensor", "bytes_per_segment", [*BAD_INT, "ab", [G, 1.5]], TypeError,
        lambda t, v: t.suspend(v))  # fmt: skip
    add("tensor", "max_handles", [*BAD_INT, -1], (TypeError, ValueError),  # type: ignore[arg-type]
        lambda t, v: t.export_ahead(v))  # fmt: skip
    add("tensor", "zero_new", BAD_FLAG, TypeError, lambda t, v: t.resume(zero_new=v))
    add("tensor", "timeout", ["1", [1]], TypeError, lambda t, v: t.wait_released(v))
    add("tensor", "timeout", [float("nan")], ValueError, lambda t, v: t.wait_released(v))
    add("tensor", "dtype", BAD_DTYPE, TypeError, lambda t, v: t.view(v, (4,)))
    add("tensor", "dtype", BAD_DTYPE, TypeError, lambda t, v: t.full_view(v))
    add("tensor", "dtype", BAD_DTYPE, TypeError, lambda t, v: t.segment_view(0, v))
    add("tensor", "shape", [4, "abc", (4.0,), (None,)], TypeError,
        lambda t, v: t.view(torch.uint8, v))  # fmt: skip
    add("tensor", "shape", [(-4,)], ValueError, lambda t, v: t.view(torch.uint8, v))
    add("tensor", "strides", [(1.0,), 1], TypeError,
        lambda t, v: t.view(torch.uint8, (4,), v))  # fmt: skip
    add("tensor", "offset", [1.5, "0", True], TypeError,
        lambda t, v: t.view(torch.uint8, (4,), offset=v))  # fmt: skip
    add("tensor", "offset", [-1], ValueError, lambda t, v: t.view(torch.uint8, (4,), offset=v))
    add("tensor", "index", [1.0, "0", None], TypeError, lambda t, v: t.segment_view(v))
    # ExtensibleKVCache
    add("cache", "capacity_blocks", [1.5, "64", None, True], TypeError,
        lambda c, v: ExtensibleKVCache(_spec(), v, "cpu"))  # fmt: skip
    add("cache", "capacity_blocks", [0, -1], ValueError,
        lambda c, v: ExtensibleKVCache(_spec(), v, "cpu"))  # fmt: skip
    add("cache", "granularity", [1.5, "4096"], TypeError,
        lambda c, v: ExtensibleKVCache(_spec(), 64, "cpu", granularity=v))  # fmt: skip
    add("cache", "legacy", ["yes", 1], TypeError,
        lambda c, v: ExtensibleKVCache(_spec(), 64, "cpu", legacy=v))  # fmt: skip
    add("cache", "spec", [{"a": 1}, "spec", 3], TypeError,
        lambda c, v: ExtensibleKVCache(v, 64, "cpu"))  # fmt: skip
    add("cache", "block_bytes", [1.5, "8"], TypeError,
        lambda c, v: ExtensibleKVCache([KVCacheTensorSpec(v, _spec()[0].layers)], 64))  # fmt: skip
    add("cache", "num_blocks", BAD_INT, TypeError, lambda c, v: c.commit(v))
    add("cache", "blocks", [-1, 65], ValueError, lambda c, v: c.commit(v))
    add("cache", "num_blocks", BAD_INT, TypeError, lambda c, v: c.shrink_to(v))
    add("cache", "blocks", [-1], ValueError, lambda c, v: c.shrink_to(v))
    add("cache", "exact", BAD_FLAG, TypeError, lambda c, v: c.shrink_to(1, exact=v))
    add("cache", "num_blocks", BAD_INT, TypeError, lambda c, v: c.lend_sizes(v))
    add("cache", "block_size", [1.5, "16"], TypeError,
        lambda c, v: AttentionLayerSpec("FLASH_ATTN", v, 2, 32, torch.bfloat16))  # fmt: skip
    add("cache", "block_size", [0, -16], ValueError,
        lambda c, v: AttentionLayerSpec("FLASH_ATTN", v, 2, 32, torch.bfloat16))  # fmt: skip
    # KVCacheFlow
    for kwarg in ("budget_bytes", "margin_bytes", "transient_peak_bytes", "max_blocks"):
        add("flow", kwarg, [1.5, "1", True], TypeError,
            lambda f, v, k=kwarg: f.extend_to_fit(**{"budget_bytes": G, k: v}))  # fmt: skip
        add("flow", kwarg, [-5, -1], ValueError,
            lambda f, v, k=kwarg: f.extend_to_fit(**{"budget_bytes": G, k: v}))  # fmt: skip
    add("flow", "host_free", ["yes", 1], TypeError,
        lambda f, v: f.extend_to_fit(host_free=v))  # fmt: skip
    for kwarg in ("budget_bytes", "margin_bytes", "transient_peak_bytes"):
        add("flow", kwarg, [1.5, "1", True], TypeError,
            lambda f, v, k=kwarg: f.measure(**{"budget_bytes": G, k: v}))  # fmt: skip
        add("flow", kwarg, [-1], ValueError,
            lambda f, v, k=kwarg: f.measure(**{"budget_bytes": G, k: v}))  # fmt: skip
    add("flow", "num_blocks", [1.5, None, "2"], TypeError,
        lambda f, v: f.extend_to(v, f.measure(budget_bytes=G)))  # fmt: skip
    add("flow", "measured", [None, G, "x"], TypeError, lambda f, v: f.extend_to(2, v))
    add("flow", "num_blocks", [1.5, None], TypeError, lambda f, v: f.shrink_to(v))
    add("flow", "num_blocks", [-1], ValueError, lambda f, v: f.shrink_to(v))
    add("flow", "exact", ["yes"], TypeError, lambda f, v: f.shrink_to(0, exact=v))
    add("flow", "initial_blocks", [1.5, "1"], TypeError,
        lambda f, v: KVCacheFlow.reserve(_spec(), 64, "cpu", initial_blocks=v))  # fmt: skip
    add("flow", "initial_blocks", [-1], ValueError,
        lambda f, v: KVCacheFlow.reserve(_spec(), 64, "cpu", initial_blocks=v))  # fmt: skip
    # The vLLM drop-in (its own range errors keep vLLM's wording: tests/test_vllm_tensor.py)
    add("dropin", "max_num_bytes", [1.5, "8", None], TypeError, lambda d, v: DropIn(v, "cpu"))
    add("dropin", "num_segments", [1.5, "2"], TypeError,
        lambda d, v: DropIn(4 << 21, "cpu", num_segments=v))  # fmt: skip
    add("dropin", "segment_capacities", [5, [1.5]], TypeError,
        lambda d, v: DropIn(4 << 21, "cpu", segment_capacities=v))  # fmt: skip
    add("dropin", "export_handle_types", [1.5, "fabric"], TypeError,
        lambda d, v: DropIn(4 << 21, "cpu", export_handle_types=v))  # fmt: skip
    add("dropin", "device", [1.5, [0]], TypeError, lambda d, v: DropIn(4 << 21, v))
    add("dropin", "device_index", [1.5], TypeError, lambda d, v: granule_size(v))
    add("dropin", "bytes_per_segment", BAD_INT, TypeError, lambda d, v: d.resize_per_segment_(v))
    add("dropin", "zero_new", BAD_FLAG, TypeError,
        lambda d, v: d.resize_per_segment_(8192, zero_new=v))  # fmt: skip
    for method in ("resize_segments_", "shrink_segments_", "segments_backed_by_one_chunk"):
        add("dropin", "sizes", [4096, "ab", [1.5, 2]], TypeError,
            lambda d, v, m=method: getattr(d, m)(v))  # fmt: skip
    add("dropin", "index", [1.0, "0"], TypeError, lambda d, v: d.segment_view(v))
    return cases


CASES = _cases()


@pytest.fixture
def owners() -> Iterator[dict[str, Any]]:
    made: dict[str, Any] = {}
    yield made
    for obj in made.values():
        obj.close() if hasattr(obj, "close") else obj.free()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.owner}-{c.name}-{c.value!r}"[:60] for c in CASES])
def test_a_bad_argument_is_named_and_changes_nothing(
    case: Case, owners: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    make, state = OWNERS[case.owner]
    obj = owners[case.owner] = make()
    before = state(obj)
    with caplog.at_level(logging.CRITICAL, logger="extensible_kv"):
        with pytest.raises(case.error) as info:
            case.call(obj, case.value)
    error = info.value
    assert not isinstance(error, OverflowError | AttributeError), repr(error)
    assert case.name in str(error), f"{case.name!r} not named in {error!r}"
    assert state(obj) == before


def test_every_bad_argument_together_leaks_no_fd_or_mapping(
    leak_check: Callable[[], tuple[int, int]], caplog: pytest.LogCaptureFixture
) -> None:
    before = leak_check()
    with caplog.at_level(logging.CRITICAL, logger="extensible_kv"):
        for case in CASES:
            make, _ = OWNERS[case.owner]
            obj = make()
            with pytest.raises(case.error):
                case.call(obj, case.value)
            obj.close() if hasattr(obj, "close") else obj.free()
    gc.collect()
    assert leak_check() == before


def test_the_table_covers_every_public_method_with_arguments() -> None:
    """A new public method with an argument needs its row above."""

    def public(cls: type) -> set[str]:
        names = set()
        for name in dir(cls):
            attr = inspect.getattr_static(cls, name)
            if name.startswith("_") or isinstance(attr, property):
                continue
            if hasattr(attr, "__deprecated__"):  # an old name, covered by its new one's row
                continue
            if not callable(getattr(cls, name)):
                continue
            parameters = inspect.signature(getattr(cls, name)).parameters
            if set(parameters) - {"self", "cls"}:
                names.add(name)
        return names

    called = " ".join(
        c.call.__code__.co_names.__repr__() + repr(c.call.__defaults__) for c in CASES
    )
    for cls in (ExtensibleTensor, ExtensibleKVCache, KVCacheFlow, DropIn):
        for name in public(cls) - {"from_shared", "refresh"}:  # the lead's: shared descriptions
            assert name in called, f"{cls.__name__}.{name} has no bad-argument case"


INTEGER_LIKES = [np.int64, np.uint32, np.int32, lambda n: torch.tensor(n)]


@pytest.mark.parametrize("to", INTEGER_LIKES, ids=["np.int64", "np.uint32", "np.int32", "torch"])
def test_integer_scalars_are_sizes(to: Callable[[int], Any]) -> None:
    with ExtensibleTensor(to(16 * G), to(2), "cpu", granularity=to(G)) as t:
        t.resize_per_segment_(to(G))
        t.resize_per_segment_([to(2 * G), to(3 * G)])
        t.shrink_per_segment_(to(G))
        assert t.segment_bytes == (G, G)
        assert t.view(torch.uint8, (to(4),), (to(1),), to(G)).shape == (4,)
        assert t.segment_view(to(1)).numel() == G
    with ExtensibleTensor(4 * G, device="cpu", granularity=G) as t:
        t.resize_(to(2 * G))
        t.shrink_(to(G))
        assert t.segment_bytes == (G,)
    with ExtensibleKVCache(_spec(), to(64), "cpu", granularity=to(G)) as cache:
        cache.commit(to(5))
        assert cache.committed_blocks == 5 and type(cache.committed_blocks) is int
        cache.shrink_to(to(2))
        assert cache.committed_blocks == 2
    with KVCacheFlow.reserve(_spec(), 64, "cpu", granularity=G, initial_blocks=to(1)) as flow:
        report = flow.extend_to_fit(budget_bytes=to(1 << 20), max_blocks=to(10))
        assert report.blocks_after == 10
    dropin = DropIn(to(4 << 21), "cpu", num_segments=to(2))
    dropin.resize_per_segment_(to(4096))
    dropin.resize_segments_([to(8192), to(8192)])
    assert dropin.num_bytes == 2 * 8192
    dropin.free()


def test_extend_to_fit_budget_is_in_all() -> None:
    with _flow() as flow:
        held = flow.cache.physical_bytes
        first = flow.extend_to_fit(budget_bytes=held + 8 * G)
        assert first.blocks_after > first.blocks_before
        assert flow.cache.physical_bytes <= held + 8 * G
        again = flow.extend_to_fit(budget_bytes=held + 8 * G)
        assert (again.blocks_after, again.committed_bytes, again.budget_bytes) == (
            first.blocks_after,
            0,
            held + 8 * G - flow.cache.physical_bytes,
        )
        doc = KVCacheFlow.extend_to_fit.__doc__ or ""
        assert "in all" in doc and "second call with the same" in " ".join(doc.split())


# --------------------------------------------------------------------------------------------
# the wording issue 22 lists


def test_messages_say_what_is_wrong(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match=r"^max_bytes must be at least 1, got 0$"):
        ExtensibleTensor(0, device="cpu")
    with pytest.raises(ValueError, match=r"^max_bytes must be a non-negative int below 2\*\*64"):
        ExtensibleTensor(-1, device="cpu")
    with pytest.raises(OutOfMemoryError, match=r"^out of address space: reserving") as info:
        ExtensibleTensor(1 << 62, device="cpu", granularity=G)
    assert "commit fewer bytes" not in str(info.value) and info.value.op == "reserve"
    # Fabric alone, which the host backend never has: refused, not unshareable memory.
    with pytest.raises(UnsupportedError, match=r"^unsupported: the host backend on cpu cannot "):
        ExtensibleTensor(G, device="cpu", export_handle_types="fabric")
    with caplog.at_level(logging.WARNING, logger="extensible_kv"):
        ExtensibleTensor(G, device="cpu", export_handle_types=["posix_fd", "fabric"]).close()
    assert caplog.messages == [
        "cpu cannot export fabric handles; the memory is exportable as POSIX fds only"
    ]
    with pytest.raises(OutOfMemoryError, match=r"^out of memory: create of .*commit fewer bytes"):
        ExtensibleTensor(8 * G, device="cpu", granularity=G, _fault=("create", 1, "oom")).resize_(G)


def test_stream_is_documented_as_vouched_for_by_the_caller() -> None:
    import extensible_kv.tensor as facade

    for method in ("resize_per_segment_", "shrink_per_segment_", "consolidate", "release_physical"):
        doc = " ".join((getattr(ExtensibleTensor, method).__doc__ or "").split())
        assert "vouched for by the caller" in doc and "ExternalStream" in doc, method
    assert "The caller vouches for it" in " ".join((facade.__doc__ or "").split())
    stub = os.path.join(os.path.dirname(_native.__file__), "_native.pyi")
    with open(stub) as f:
        assert "that the caller\n# vouches for" in f.read()


# --------------------------------------------------------------------------------------------
# the host budget is the host backend's own figure


def test_host_free_bytes_is_the_figure_commits_are_checked_against() -> None:
    free = extensible_kv.host_free_bytes()
    assert 0 < free <= _native.host_mem_info()[0]
    assert "host_free_bytes" in extensible_kv.__all__
    with ExtensibleTensor(1 << 46, device="cpu") as t:  # address space only
        too_much = free + (4 << 30)
        with pytest.raises(OutOfMemoryError) as info:
            t.resize_(too_much - too_much % t.granularity)
        assert info.value.free_bytes is not None
        # Read a moment apart, the two figures differ by what the machine did meanwhile.
        assert abs(info.value.free_bytes - free) < 256 << 20
        assert t.physical_bytes == 0


def test_the_flow_and_the_demo_measure_host_free_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizing, "host_free_bytes", lambda: (1 << 30) + (1 << 20))
    with _flow() as flow:
        report = flow.extend_to_fit(host_free=True)
    assert (report.budget_source, report.free_bytes) == ("host_free_bytes", (1 << 30) + (1 << 20))
    from decoder import demo

    options = demo.DemoOptions(device="cpu", steps=4, num_seqs=2, budget_mib=None, max_blocks=40)
    result = demo.run(options)
    assert result.extensible.report.budget_source == "host_free_bytes"
    from decoder import cli

    assert (cli._budget_mib("free"), cli._budget_mib("8")) == (None, 8)


# --------------------------------------------------------------------------------------------
# a stray access says what it hit

STRAY = textwrap.dedent(
    """
    import sys
    {before}
    from extensible_kv import ExtensibleTensor
    t = ExtensibleTensor(1 << 20, 2, "cpu", granularity=4096)
    t.resize_per_segment_(5000)  # two granules of segment 1 mapped
    view = t.full_view()
    print(t.base_ptr, flush=True)

    def touch_past_the_committed_bytes():
        view[(1 << 19) + 3 * 4096 + 7] = 1

    touch_past_the_committed_bytes()
    """
)


def _stray(before: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", STRAY.format(before=before)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_a_stray_access_prints_the_tensor_offset_and_committed_bytes() -> None:
    run = _stray()
    assert run.returncode == -11, run.stderr  # SIGSEGV, as without the report
    base = int(run.stdout.split()[0])
    offset = (1 << 19) + 3 * 4096 + 7
    report, _, rest = run.stderr.partition("\n")
    assert report.startswith(
        f"extensible_kv: stray access (SIGSEGV) at offset {offset} of the tensor at base_ptr "
        f"{base:#x} (1048576 bytes reserved), in segment 1 of 2 (offset 524288, capacity "
        f"524288 bytes), {3 * 4096 + 7} bytes into it; committed bytes of that segment: 5000, "
        f"so the access is {3 * 4096 + 7 - 5000} bytes past them."
    ), run.stderr
    # Then Python's faulthandler, chained to, prints the stack.
    assert "Fatal Python error: Segmentation fault" in rest
    assert "in touch_past_the_committed_bytes" in rest


def test_the_report_chains_to_a_faulthandler_enabled_before() -> None:
    run = _stray("import faulthandler; faulthandler.enable(all_threads=False)")
    assert run.returncode == -11, run.stderr
    assert run.stderr.index("stray access") < run.stderr.index("Fatal Python error")
    assert "in touch_past_the_committed_bytes" in run.stderr


@pytest.mark.parametrize("off", ["0", "off", " False "])
def test_the_report_can_be_switched_off(off: str) -> None:
    """As every switch: `0`, `false`, `no`, `off` in any case (the README's words)."""
    run = _stray(EXTENSIBLE_KV_STRAY_REPORT=off)
    assert run.returncode == -11
    assert "stray access" not in run.stderr and "Fatal Python error" not in run.stderr


def test_a_segfault_outside_every_reservation_is_left_to_the_others() -> None:
    code = (
        "import ctypes\nfrom extensible_kv import ExtensibleTensor\n"
        "t = ExtensibleTensor(4096, device='cpu')\nctypes.string_at(8)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == -11
    assert "stray access" not in run.stderr and "Fatal Python error" in run.stderr


@pytest.mark.gpu
def test_on_cuda_a_stray_access_is_a_sticky_illegal_address() -> None:
    """What CUDA reports for the same mistake (in a child: it may ruin the context). Seen on the
    H200 (torch 2.11): the write itself fails with `CUDA error: invalid argument`; an error
    may instead surface at the next synchronising call. Either way a CUDA error, never silence."""
    code = textwrap.dedent(
        """
        import torch
        from extensible_kv import ExtensibleTensor
        t = ExtensibleTensor(64 << 21, 2, "cuda:0")
        t.resize_per_segment_(1)
        view = t.full_view()
        for attempt in ("write", "synchronize"):
            try:
                if attempt == "write":
                    view[(32 << 21) + (4 << 21)] = 1  # 4 granules past segment 1's byte
                torch.cuda.synchronize()
                print(attempt, "ok", flush=True)
            except RuntimeError as error:
                print(attempt, "failed:", str(error).splitlines()[0], flush=True)
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    lines = run.stdout.splitlines()
    assert len(lines) == 2, run.stdout + run.stderr
    assert lines[0].startswith("write failed:") and "CUDA error" in lines[0], run.stdout
