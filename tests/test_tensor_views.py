"""`ExtensibleTensor` views and lifetimes: torch views of every dtype and stride, pointers that
never move, views that outlive the tensor, closing, DLPack, and concurrent grows. Every test
on every backend; sizes in units of the granularity `g`."""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from typing import Any

import pytest
import torch
from extensible_kv import (
    ClosedError,
)
from support.memory import MakeTensor
from support.tensor_checks import check, pattern, read

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
