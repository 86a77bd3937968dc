"""`ExtensibleTensor` gives memory back: to the driver (`release_physical`, for good), keeping
the addresses (`suspend`/`resume`, and their deprecated names `release`/`released`), and
`free`; and the stream a call runs on. Every test on every backend; sizes in units of the
granularity `g`."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from extensible_kv import ExtensibleTensor
from support.memory import MakeTensor, needed_granules
from support.tensor_checks import check, expect_zero, pattern

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


def test_suspend_keeps_the_addresses_and_resume_the_sizes(make_tensor: MakeTensor, g: int) -> None:
    t = make_tensor(8 * g, 2)
    sizes = (3 * g + 5, 2 * g)
    t.resize_per_segment_(list(sizes))
    for i in range(2):
        t.segment_view(i).copy_(pattern(sizes[i], i))
    base, kept = t.base_ptr, [t.segment_view(i)[:g].cpu().clone() for i in range(2)]

    t.suspend(g)
    assert t.suspended and t.segment_bytes == (g, g) and t.pending_release_bytes == 0
    assert t.physical_bytes == len(needed_granules(t)) * g
    t.suspend()  # again: nothing changes, and the sizes to resume stay the first ones
    assert t.segment_bytes == (g, g)
    for i in range(2):
        assert torch.equal(t.segment_view(i).cpu(), kept[i])
    t.resume()
    assert not t.suspended and t.segment_bytes == sizes and t.base_ptr == base
    for i in range(2):
        assert torch.equal(t.segment_view(i)[:g].cpu(), kept[i])
        expect_zero(t.segment_view(i)[g:].cpu())
    t.resume()  # not suspended: nothing
    assert t.segment_bytes == sizes

    t.suspend()
    assert (t.segment_bytes, t.physical_bytes) == ((0, 0), 0)
    t.resume(zero_new=False)
    assert t.segment_bytes == sizes
    check(t)


@pytest.mark.parametrize("how", ["suspend", "release"])
def test_release_is_the_deprecated_name_of_suspend(
    make_tensor: MakeTensor, g: int, how: str
) -> None:
    """`release`/`released` (the keep-the-addresses pair's old names: "release" is the
    driver's word) warn, and do exactly what `suspend`/`suspended` do."""
    t = make_tensor(8 * g, 2)
    t.resize_per_segment_([3 * g, 2 * g])
    base = t.base_ptr
    if how == "release":
        with pytest.warns(DeprecationWarning, match=r"release\(\) is deprecated: use .*suspend"):
            t.release(g)
        with pytest.warns(DeprecationWarning, match="released is deprecated: use .*suspended"):
            assert t.released
    else:
        t.suspend(g)
    assert t.suspended and t.segment_bytes == (g, g) and t.pending_release_bytes == 0
    t.resume()
    assert not t.suspended and (t.segment_bytes, t.base_ptr) == ((3 * g, 2 * g), base)
    assert ExtensibleTensor.release.__deprecated__  # type: ignore[attr-defined]
    check(t)


def test_free_gives_the_memory_back_and_the_addresses_with_the_last_view(
    make_tensor: MakeTensor, g: int
) -> None:
    t = make_tensor(4 * g)
    t.resize_(2 * g)
    view = t.full_view()
    assert t.free() is False  # a view is alive: the addresses stay reserved for it
    assert (t.physical_bytes, t.pending_release_bytes, t.closed) == (0, 0, False)
    assert t.live_views == 1 and not t.suspended
    del view
    gc.collect()
    assert t.free() is True and t.closed
    assert t.free() is True  # idempotent


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
