"""Stress that runs every time (host backend) and on the device (CUDA, marked `gpu`).

- threads through the bindings: 8 threads grow, shrink and release their own tensors and write
  through torch views while 4 others take torch views of every tensor and drop them (DLPack
  deleters on any thread), and 4 race on one shared tensor; invariants after;
- grow/release cycles of one granule, 100,000 on the host and 10,000 on CUDA: no fd, mapping
  or handle leak (/proc, `mem_get_info`), time per cycle flat (last tenth within 3x the first,
  medians, printed with `-s`);
- CUDA: release and close while kernels on another stream still write the range (the fence
  must wait for them), the last view dropped while its kernels run, and an out-of-memory in
  the middle of a 100+ handle grow that leaves `mem_get_info` where it was.

Each GPU test stays well under a minute on an H200.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from extensible_kv import ExtensibleTensor, HandleSizing, OutOfMemoryError
from support.memory import MakeTensor, memfd_counts, settled_free

MIB = 1 << 20
GIB = 1 << 30
HOST_CYCLES = 100_000
CUDA_CYCLES = 10_000


def _leak_probe(device: str) -> Callable[[], object]:
    """What must not change across a stress run: the memfds and their mappings in /proc on the
    host; the device's free memory, settled, on CUDA."""
    if device == "cpu":
        return memfd_counts
    return settled_free


def _assert_unchanged(device: str, before: object, after: object) -> None:
    if device == "cpu":
        assert after == before, f"memfds / mappings: {before} -> {after}"
    else:
        assert isinstance(before, int) and isinstance(after, int)
        assert abs(after - before) <= 16 * MIB, f"free bytes: {before} -> {after}"


# ---------------------------------------------------------------------------------------------
# threads through the bindings


def _mutate(t: ExtensibleTensor, rng: random.Random, capacity: int) -> int | None:
    """One random change of `t`; the bytes per segment committed, if it grew. Racing threads
    may find the frontier moved: a grow that would shrink is a ValueError, nothing else."""
    current = max(t.segment_bytes)
    choice = rng.randrange(10)
    try:
        if choice < 6:
            target = rng.randint(current, capacity)
            t.resize_per_segment_(target)
            return target
        if choice < 8:
            t.shrink_per_segment_(rng.randint(0, current), exact=rng.random() < 0.5)
        elif choice == 8:
            t.release_physical()
        else:
            t.consolidate()
    except ValueError as error:
        assert "shrink" in str(error) or "grow" in str(error), error
    return None


def test_threads_grow_view_and_race(make_tensor: MakeTensor, g: int, device: str) -> None:
    probe = _leak_probe(device)
    before = probe()
    segment = 32 * g - g // 2  # not a granule multiple: the two segments share a granule
    owned = [
        make_tensor(2 * segment, 2, handle_sizing=HandleSizing(max_bytes=4 * g)) for _ in range(8)
    ]
    shared = make_tensor(2 * segment, 2, handle_sizing=HandleSizing(max_bytes=4 * g))
    tensors = [*owned, shared]
    done = threading.Event()
    errors: list[BaseException] = []
    iterations = 150

    def guarded(work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                work()
            except BaseException as error:
                errors.append(error)

        return run

    def owner(index: int) -> None:
        t, rng = owned[index], random.Random(index)
        for i in range(iterations):
            grown = _mutate(t, rng, segment)
            if grown:
                # Only this thread moves this tensor's frontier: its committed bytes stay.
                view = t.segment_view(1)
                view.fill_((index + i) % 250 + 1)
                assert int(view.min()) == int(view.max()) == (index + i) % 250 + 1
                del view
            t._check_invariants()

    def racer(index: int) -> None:
        rng = random.Random(100 + index)
        for _ in range(iterations):
            _mutate(shared, rng, segment)
            shared._check_invariants()

    def viewer(index: int) -> None:
        rng, held, made = random.Random(200 + index), [], 0
        while not done.is_set() or made < 500:
            t = rng.choice(tensors)
            offset = rng.randrange(t.capacity_bytes)
            view = t.view(torch.uint8, (rng.randint(1, t.capacity_bytes - offset),), None, offset)
            assert view.data_ptr() == t.base_ptr + offset
            held.append(view)
            made += 1
            if len(held) > 16 or rng.random() < 0.5:
                held.pop(rng.randrange(len(held)))

    workers = [threading.Thread(target=guarded(lambda i=i: owner(i))) for i in range(8)]
    workers += [threading.Thread(target=guarded(lambda i=i: racer(i))) for i in range(4)]
    viewers = [threading.Thread(target=guarded(lambda i=i: viewer(i))) for i in range(4)]
    for thread in workers + viewers:
        thread.start()
    for thread in workers:
        thread.join()
    done.set()
    for thread in viewers:
        thread.join()
    assert not errors, errors[:3]
    if device != "cpu":
        torch.cuda.synchronize()
    for t in tensors:
        t._check_invariants()
        assert t.live_views == 0
        assert t.take_deferred_errors() == []
        t.close()
    _assert_unchanged(device, before, probe())


# ---------------------------------------------------------------------------------------------
# cycles


def test_grow_release_cycles_leak_nothing_and_stay_flat(
    make_tensor: MakeTensor, g: int, device: str
) -> None:
    cycles = HOST_CYCLES if device == "cpu" else CUDA_CYCLES
    probe = _leak_probe(device)
    t = make_tensor(64 * g, 1)
    view = t.full_view()  # a live view through it all: addresses must stay put
    before = probe()
    times = []
    clock = time.perf_counter_ns
    for i in range(cycles):
        start = clock()
        t.resize_(g)
        t.release_physical()
        times.append(clock() - start)
        if i % 1000 == 0:  # the memory is real, and zeroed each time
            t.resize_(g)
            assert int(view[g - 1]) == 0
            view[:g].fill_(7)
            t.release_physical()
    assert t.wait_released(10)
    assert (t.num_handles, t.physical_bytes, t.live_views) == (0, 0, 1)
    assert view.data_ptr() == t.base_ptr and t.take_deferred_errors() == []
    after = probe()
    tenth = cycles // 10
    first, last = statistics.median(times[:tenth]), statistics.median(times[-tenth:])
    print(
        f"\n{device}: {cycles} grow/release cycles of one {g}-byte granule: median "
        f"{first / 1e3:.1f} us/cycle in the first tenth, {last / 1e3:.1f} us in the last "
        f"({last / first:.2f}x), {sum(times) / 1e9:.1f} s in all; leak probe {before} -> {after}"
    )
    _assert_unchanged(device, before, after)
    assert last <= 3 * first, (first, last)
    del view


# ---------------------------------------------------------------------------------------------
# CUDA: the fence, the last view, out of memory mid-grow

SLEEP_CYCLES = 200_000_000  # ~100 ms of torch.cuda._sleep at the H200's ~2 GHz


@pytest.fixture
def side() -> Iterator[torch.cuda.Stream]:
    torch.cuda.synchronize()
    yield torch.cuda.Stream(0)  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()


def _busy_writing(view: torch.Tensor, stream: torch.cuda.Stream) -> torch.cuda.Event:
    """Queues on `stream` a long sleep and then writes all of `view` (several times); returns
    an event recorded after them. The host returns at once."""
    with torch.cuda.stream(stream):
        for value in range(1, 4):
            torch.cuda._sleep(SLEEP_CYCLES)
            view.fill_(value)
        done = torch.cuda.Event()
        done.record(stream)
    return done


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["release_physical", "close"])
def test_release_and_close_wait_for_kernels_still_writing(
    how: str, side: torch.cuda.Stream
) -> None:
    g = 2 * MIB
    before = settled_free()
    t = ExtensibleTensor(256 * g, device="cuda:0")
    t.resize_(256 * g)
    view = t.full_view(torch.int32)
    done = _busy_writing(view, side)
    assert not done.query(), "the kernels finished before the release: nothing was tested"
    if how == "close":
        del view  # torch does not know the memory is in use: nothing keeps it but the fence
        t.close()
    else:
        # Stream-ordered (§3.11): the fence is the stream given, the writers' one here.
        t.release_physical(stream=side.cuda_stream)
        assert t.wait_released(timeout=30)
    # The fence: the unmap waited for every kernel that wrote the range.
    assert done.query()
    torch.cuda.synchronize()  # an unmap under the kernels would surface here
    assert t.take_deferred_errors() == []
    if how == "release_physical":
        t.resize_(g)
        assert int(view[: g // 4].abs().sum()) == 0  # fresh, zeroed memory at the same place
        del view
        t.close()
    assert abs(settled_free() - before) <= 16 * MIB


@pytest.mark.gpu
def test_the_last_view_dropped_while_its_kernels_run(side: torch.cuda.Stream) -> None:
    g = 2 * MIB
    before = settled_free()
    t = ExtensibleTensor(256 * g, device="cuda:0")
    t.resize_(256 * g)
    view = t.full_view(torch.int32)
    del t  # the view alone keeps the memory
    done = _busy_writing(view, side)
    assert not done.query(), "the kernels finished early: nothing was tested"
    del view  # the last reference: unmap and release happen here, after the fence
    assert done.query()
    torch.cuda.synchronize()
    assert abs(settled_free() - before) <= 16 * MIB


@pytest.mark.gpu
def test_out_of_memory_in_a_100_handle_grow_leaves_free_memory_as_it_was() -> None:
    g = 2 * MIB
    before = settled_free()
    # More than is free, in handles of at most 1 GiB and small enough for 100+ of them on any
    # card (512 MiB on an 80 GiB H100): the driver refuses one of the last creates, after
    # 100+ handles were created, mapped and queued for zeroing.
    request = (before + 4 * GIB) // g * g
    handle = min(GIB, max(g, 1 << ((request // 120).bit_length() - 1)))
    t = ExtensibleTensor(
        request, device="cuda:0", handle_sizing=HandleSizing(max_bytes=handle), _profile=True
    )
    with pytest.raises(OutOfMemoryError) as info:
        t.resize_(request)
    creates = t._profile_report()["create"][0]
    assert creates >= 100, f"only {creates} creates: not the middle of a large grow"
    assert (info.value.op, info.value.code) == ("create", "CUDA_ERROR_OUT_OF_MEMORY")
    assert (t.physical_bytes, t.num_handles, t.segment_bytes) == (0, 0, (0,))
    assert t.take_deferred_errors() == []
    torch.cuda.synchronize()  # the queued memsets were fenced before their memory went
    t.resize_(g)  # the tensor still works
    t.close()
    after = settled_free()
    print(f"\nOOM after {creates} creates: free {before} -> {after} bytes")
    assert abs(after - before) <= 16 * MIB
