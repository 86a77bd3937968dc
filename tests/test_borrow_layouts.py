"""A loan is memory, not the lender's blocks (issue 52): caches of different models lend and
borrow, on every backend (see conftest.py). A borrower gains the blocks the loan's memory
holds in its own layout (`extensible_kv.shape.blocks_from` of the donor's `lend_sizes`: what
the pool weighs a cut by), flat or segmented, one buffer or many, both ways; handles its
layout cannot share go back at once, so the lender's reclaim never waits for them; bytes are
zeroed or kept as asked; give-back and reclaim restore the lender exactly; `kill -9` of either
side (a real process); fds and mappings unchanged after cycles.

Layouts (16 tokens a block, head size 32, bf16): `flat16k` (transformers' flat cache of a
Qwen2-like model, 16,384 bytes a block), `flat6k` (a Llama-like GQA one, 6,144), `kv2` (a K/V
split: 2 segments of 2,048), `layers32` (32 layers, a segment each, 4,096 a block each),
`buffers4` (4 buffers of a K/V split: 8 segments of 1,024).
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from extensible_kv import (
    AttentionLayerSpec,
    ExtensibleKVCache,
    KVCacheTensorSpec,
    Loan,
    LoanTimeoutError,
    StandardLayerSpec,
    blocks_from,
)
from support.child import TIMEOUT_S, Child
from support.devices import CPU_GRANULARITY

N, D = 16, 32
BF16 = torch.bfloat16
LENT, OWN, WRITTEN = 0xA5, 0x3C, 0x5A  # byte values: the lender's lent memory, kept, borrower's


def spec(layout: str) -> list[KVCacheTensorSpec]:
    if layout in ("flat16k", "flat6k"):
        heads = 8 if layout == "flat16k" else 3
        layer = AttentionLayerSpec("FLASHINFER", N, heads, D, BF16)
        return [KVCacheTensorSpec(2 * N * heads * D * 2, {"attn": layer})]
    if layout == "kv2":
        return [
            KVCacheTensorSpec(
                2 * N * 2 * D * 2, {"attn": AttentionLayerSpec("FLASH_ATTN", N, 2, D, BF16)}
            )
        ]
    if layout == "layers32":
        layers = {f"l{i}": StandardLayerSpec("LBHNC", 32, i, N, 2, D, BF16) for i in range(32)}
        return [KVCacheTensorSpec(32 * 2 * N * 2 * D * 2, layers)]
    if layout == "buffers4":
        layer = lambda i: AttentionLayerSpec("FLASH_ATTN", N, 1, D, BF16)  # noqa: E731
        return [KVCacheTensorSpec(2 * N * D * 2, {f"attn{i}": layer(i)}) for i in range(4)]
    raise ValueError(layout)


def unit(layout: str, g: int) -> int:
    """The fewest blocks that end at a granule boundary in every segment of `layout`."""
    sbbs = {s for s in _segment_block_bytes(layout)}
    return max(math.lcm(sbb, g) // sbb for sbb in sbbs)


def _segment_block_bytes(layout: str) -> tuple[int, ...]:
    from extensible_kv.kv_cache import segment_layout

    return tuple(sbb for _, sbb in segment_layout(spec(layout)))


def make(layout: str, device: str, g: int, capacity_units: int) -> ExtensibleKVCache:
    granularity = CPU_GRANULARITY if device == "cpu" else None
    cache = ExtensibleKVCache(
        spec(layout),
        capacity_units * unit(layout, g),
        device,
        granularity=granularity,
        export_handle_types="posix_fd",
    )
    assert cache.buffers[0].granularity == g
    return cache


def commit_in_steps(cache: ExtensibleKVCache, layout: str, g: int, units: list[int]) -> None:
    """Commits to each count of units in turn: each step its own handles (one per segment and
    step), so that a lend past an earlier step lends whole handles."""
    for count in units:
        cache.commit(count * unit(layout, g))


def fill(cache: ExtensibleKVCache, first: int, end: int, value: int) -> None:
    """Blocks `[first, end)` of every segment of every buffer hold `value` in every byte."""
    for tensor, sbb in zip(cache.buffers, cache.segment_block_bytes, strict=True):
        for s in range(tensor.num_segments):
            tensor.segment_view(s)[first * sbb : end * sbb].fill_(value)
    if cache.buffers[0].device.startswith("cuda"):
        torch.cuda.synchronize()


def values(cache: ExtensibleKVCache, first: int, end: int) -> set[int]:
    """The byte values in blocks `[first, end)` of every segment of every buffer."""
    seen: set[int] = set()
    for tensor, sbb in zip(cache.buffers, cache.segment_block_bytes, strict=True):
        for s in range(tensor.num_segments):
            part = tensor.segment_view(s)[first * sbb : end * sbb].cpu()
            seen |= {int(v) for v in torch.unique(part)}
    return seen


def state(cache: ExtensibleKVCache) -> tuple[Any, ...]:
    """What a give-back and reclaim must restore exactly."""
    return (
        cache.committed_blocks,
        cache.physical_bytes,
        tuple(tuple(t.segment_bytes) for t in cache.buffers),
        tuple(tuple(t.handle_runs()) for t in cache.buffers),
        sum(t.lent_bytes for t in cache.buffers),
        sum(t.borrowed_bytes for t in cache.buffers),
    )


def counts() -> tuple[int, int]:
    """`(open fds, mapping lines)` of this process."""
    with open("/proc/self/maps") as maps:
        return len(os.listdir("/proc/self/fd")), sum(1 for _ in maps)


# What each pair lends: the lender commits KEEP units, then STEPS one unit at a time, and lends
# past KEEP; the borrower starts at START units (a granule boundary: no slack).
KEEP, STEPS, START, CAPACITY = 2, 6, 1, 256
PAIRS = [
    ("flat16k", "flat6k"),  # the issue's example: Qwen2's memory to Llama, and back
    ("flat6k", "flat16k"),
    ("flat16k", "kv2"),  # flat to a K/V split
    ("kv2", "flat16k"),  # and back
    ("layers32", "flat6k"),  # 32 segments' handles into one
    ("flat16k", "layers32"),  # one segment's 40 handles over 32: 8 go back at once
    ("kv2", "buffers4"),  # 2 segments to 4 buffers of 2
    ("buffers4", "layers32"),
]


def steps_for(lender: str, borrower: str) -> int:
    return 40 if borrower == "layers32" else STEPS


@pytest.mark.parametrize("zero", [False, True], ids=["kept", "zeroed"])
@pytest.mark.parametrize(
    ("lender_layout", "borrower_layout"), PAIRS, ids=["-".join(p) for p in PAIRS]
)
def test_a_cache_of_another_model_borrows_the_memory_in_its_own_blocks(
    device: str, g: int, lender_layout: str, borrower_layout: str, zero: bool
) -> None:
    steps = steps_for(lender_layout, borrower_layout)
    lender = make(lender_layout, device, g, CAPACITY)
    borrower = make(borrower_layout, device, g, CAPACITY)
    with lender, borrower:
        u, v = unit(lender_layout, g), unit(borrower_layout, g)
        commit_in_steps(lender, lender_layout, g, list(range(KEEP, KEEP + steps + 1)))
        fill(lender, 0, KEEP * u, OWN)
        fill(lender, KEEP * u, lender.committed_blocks, LENT)
        borrower.commit(START * v)
        fill(borrower, 0, START * v, OWN)
        before = state(lender)

        sizes = lender.lend_sizes(KEEP * u)
        expected = blocks_from(borrower.shape(), sizes)
        assert expected > 0
        assert state(lender) == before, "lend_sizes changed the lender"
        loans = lender.lend(KEEP * u)
        assert [h.num_granules for loan in loans for h in loan.handles] == sizes
        assert lender.physical_bytes + sum(t.lent_bytes for t in lender.buffers) == before[1]

        gained = borrower.borrow(loans, zero=zero)
        assert gained == expected
        end = START * v + gained
        assert borrower.committed_blocks == end
        borrowed = sum(t.borrowed_bytes for t in borrower.buffers)
        assert 0 < borrowed <= sum(loan.num_bytes for loan in loans)
        # Every segment of every buffer grew by the same blocks, over borrowed memory only.
        for tensor, sbb in zip(borrower.buffers, borrower.segment_block_bytes, strict=True):
            assert tensor.segment_bytes == (end * sbb,) * tensor.num_segments
        assert values(borrower, 0, START * v) == {OWN}
        assert values(borrower, START * v, end) == ({0} if zero else {LENT})
        unused = sum(loan.num_bytes for loan in loans) - borrowed
        if borrower_layout == "layers32" and lender_layout == "flat16k":
            assert unused == 8 * sizes[0] * g, "the handles 32 segments cannot share"
        fill(borrower, START * v, end, WRITTEN)
        with pytest.raises(LoanTimeoutError):
            lender.reclaim(loans, timeout=0.01)

        borrower.give_back(loans)
        assert borrower.committed_blocks == START * v
        assert sum(t.borrowed_bytes for t in borrower.buffers) == 0
        assert values(borrower, 0, START * v) == {OWN}
        # What the borrower could not use went back at once: once it gives back what it maps,
        # the lender reclaims without waiting for the rest.
        lender.reclaim(loans, zero=zero, timeout=0)
        assert state(lender) == before, "the reclaim did not restore the lender"
        assert values(lender, 0, KEEP * u) == {OWN}
        back = values(lender, KEEP * u, lender.committed_blocks)
        if zero:
            assert back == {0}
        else:
            assert WRITTEN in back and back <= {WRITTEN, LENT}, back
        for cache in (lender, borrower):
            for tensor in cache.buffers:
                tensor._check_invariants()


def test_a_loan_a_borrower_cannot_use_at_all_is_refused_before_anything_is_mapped(
    device: str, g: int
) -> None:
    # 2 handles for 32 segments: no block of the borrower's; the loans stay offered.
    lender = make("flat16k", device, g, CAPACITY)
    borrower = make("layers32", device, g, CAPACITY)
    with lender, borrower:
        u = unit("flat16k", g)
        commit_in_steps(lender, "flat16k", g, [KEEP, KEEP + 1, KEEP + 2])
        assert blocks_from(borrower.shape(), lender.lend_sizes(KEEP * u)) == 0
        loans = lender.lend(KEEP * u)
        before = state(borrower)
        with pytest.raises(ValueError, match="hold no block of this cache"):
            borrower.borrow(loans)
        assert state(borrower) == before
        lender.reclaim(loans, timeout=0)  # never borrowed: back at once
        assert lender.committed_blocks == (KEEP + 2) * u


def test_slack_a_borrower_maps_past_its_end_counts(device: str, g: int) -> None:
    # The borrower's committed end lies inside a granule: the rest of it is slack, the loan's
    # memory begins after it, and a give-back cuts there.
    lender = make("flat16k", device, g, CAPACITY)
    borrower = make("flat6k", device, g, CAPACITY)
    with lender, borrower:
        u, v = unit("flat16k", g), unit("flat6k", g)
        commit_in_steps(lender, "flat16k", g, list(range(KEEP, KEEP + STEPS + 1)))
        first = START * v + 1  # past a granule boundary: slack up to the next
        borrower.commit(first)
        sbb = borrower.segment_block_bytes[0]
        slack = -(first * sbb) % g
        sizes = lender.lend_sizes(KEEP * u)
        loans = lender.lend(KEEP * u)
        gained = borrower.borrow(loans, zero=True)
        assert gained == (slack + sum(sizes) * g) // sbb
        assert values(borrower, first, first + gained) == {0}
        borrower.give_back(loans)
        assert borrower.committed_blocks == first + slack // sbb
        lender.reclaim(loans, timeout=10)


# --------------------------------------------------------------------------------------------
# the other side in a process of its own


def _child_main(conn: Any, device: str, g: int) -> None:
    cache: ExtensibleKVCache | None = None
    layout = ""
    try:
        while True:
            command, *args = conn.recv()
            if command == "make":
                layout, units = args
                cache = make(layout, device, g, CAPACITY)
                commit_in_steps(cache, layout, g, units)
                conn.send(("ok", os.getpid()))
                continue
            assert cache is not None
            if command == "fill":
                fill(cache, *args)
                conn.send(("ok",))
            elif command == "values":
                conn.send(("ok", values(cache, *args)))
            elif command == "lend":
                conn.send(("ok", cache.lend(args[0] * unit(layout, g))))
            elif command == "borrow":
                conn.send(("ok", cache.borrow(args[0], zero=args[1])))
            elif command == "give_back":
                cache.give_back(args[0])
                conn.send(("ok", cache.committed_blocks))
            elif command == "cycles":
                # ("cycles", n): n times borrow the loans sent, give them back, say the blocks.
                for _ in range(args[0]):
                    loans = conn.recv()
                    gained = cache.borrow(loans, zero=False)
                    cache.give_back(loans)
                    conn.send(gained)
                conn.send(("ok", counts()))
            elif command == "stop":
                cache.close()
                conn.send(("ok",))
                return
    except BaseException as error:  # report, so the parent fails with the child's reason
        conn.send(("error", f"{type(error).__name__}: {error}"))


@pytest.fixture
def child(device: str, g: int) -> Iterator[Child]:
    with Child(_child_main, device, g) as proc:
        yield proc


@pytest.mark.parametrize("step", ["lent", "borrowed", "given back"])
def test_kill_9_of_a_borrower_of_another_model_returns_the_loan(
    device: str, g: int, child: Child, step: str
) -> None:
    lender = make("flat16k", device, g, CAPACITY)
    with lender:
        u = unit("flat16k", g)
        commit_in_steps(lender, "flat16k", g, list(range(KEEP, KEEP + 41)))
        fill(lender, 0, lender.committed_blocks, OWN)
        before = state(lender)
        loans = lender.lend(KEEP * u)
        child("make", "layers32", [START])
        if step != "lent":
            (gained,) = child("borrow", loans, False)
            assert gained > 0
        if step == "given back":
            child("give_back", loans)
        child.kill()
        lender.reclaim(loans, zero=False, timeout=10)
        assert state(lender) == before
        assert values(lender, 0, lender.committed_blocks) == {OWN}


@pytest.mark.parametrize("step", ["borrowed", "given back"])
def test_kill_9_of_a_lender_of_another_model_leaves_the_borrower_its_memory(
    device: str, g: int, child: Child, step: str
) -> None:
    if device != "cpu":
        torch.zeros(1, device="cuda:0")  # torch's CUDA context (and its fds) first
    fds = counts()[0]
    borrower = make("kv2", device, g, CAPACITY)
    v = unit("kv2", g)
    borrower.commit(START * v)
    child("make", "flat6k", list(range(KEEP, KEEP + STEPS + 1)))
    child("fill", 0, (KEEP + STEPS) * unit("flat6k", g), LENT)
    (loans,) = child("lend", KEEP)
    gained = borrower.borrow(loans, zero=False)
    end = START * v + gained
    if step == "given back":
        borrower.give_back(loans)
    child.kill()
    child.process.join()
    if step == "borrowed":
        assert values(borrower, START * v, end) == {LENT}
        fill(borrower, START * v, end, WRITTEN)  # still the borrower's to write
        borrower.give_back(loans)  # the memory goes back to the driver
    assert borrower.committed_blocks == START * v
    assert sum(t.borrowed_bytes for t in borrower.buffers) == 0
    for tensor in borrower.buffers:
        tensor._check_invariants()
    borrower.close()
    del loans
    gc.collect()
    assert counts()[0] == fds, "an fd of the loan is still open"


def test_cycles_leave_fds_and_mappings_as_they_were(device: str, g: int, child: Child) -> None:
    # The lender here, a borrower of another model there; every cycle also gives back at once
    # the handles the borrower cannot use (8 of 40).
    lender = make("flat16k", device, g, CAPACITY)
    with lender:
        u = unit("flat16k", g)
        commit_in_steps(lender, "flat16k", g, list(range(KEEP, KEEP + 41)))
        child("make", "layers32", [START])

        def cycles(n: int) -> tuple[int, int]:
            child.conn.send(("cycles", n))
            for i in range(n):
                loans: tuple[Loan, ...] = lender.lend(KEEP * u)
                child.conn.send(loans)
                assert child.conn.poll(TIMEOUT_S)
                gained = child.conn.recv()
                assert isinstance(gained, int) and gained > 0, (i, gained)
                lender.reclaim(loans, zero=False, timeout=10)
            status, child_counts = child.conn.recv()
            assert status == "ok", child_counts
            return tuple(child_counts)

        child_warm = cycles(3)  # exports are made once, and kept: warm up first
        warm = counts()
        child_after = cycles(100)
        assert counts() == warm
        assert child_after == child_warm
        assert lender.committed_blocks == (KEEP + 40) * u


@pytest.mark.parametrize("failing", [0, 2], ids=["first buffer", "third buffer"])
def test_a_borrow_that_fails_part_way_leaves_the_borrower_as_it_was(
    device: str, g: int, failing: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A failure at the first buffer changed nothing: the loans stay offered, and borrow
    # elsewhere. One after buffers that mapped: those give back, and every handle of the loans
    # is returned, so that the lender reclaims them at once rather than wait.
    lender = make("kv2", device, g, CAPACITY)
    borrower = make("buffers4", device, g, CAPACITY)
    other = make("flat6k", device, g, CAPACITY)
    with lender, borrower, other:
        u, v = unit("kv2", g), unit("buffers4", g)
        commit_in_steps(lender, "kv2", g, list(range(KEEP, KEEP + STEPS + 1)))
        borrower.commit(START * v)
        before = state(borrower)
        loans = lender.lend(KEEP * u)
        tensor = borrower.buffers[failing]

        def fail(*args: Any) -> None:
            raise RuntimeError("injected")

        monkeypatch.setattr(tensor, "_borrow_placed", fail)
        with pytest.raises(RuntimeError, match="injected"):
            borrower.borrow(loans, zero=False)
        monkeypatch.undo()
        assert state(borrower) == before
        for t in borrower.buffers:
            t._check_invariants()
        if failing == 0:
            assert other.borrow(loans) > 0, "the loans stayed offered"
            other.give_back(loans)
        lender.reclaim(loans, timeout=0)  # every handle back: no wait
        assert lender.committed_blocks == (KEEP + STEPS) * u
