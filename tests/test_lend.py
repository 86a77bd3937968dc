"""Lend and borrow across two real processes (`lend`, `borrow`, `give_back`, `reclaim`,
`send_shared` / `recv_loan`), on every backend (see conftest.py): bytes checked at each step,
the lender's addresses and views kept, kill -9 of either side at each step, and 1,000 cycles
that leave /proc/self/fd and /proc/self/maps as they were.

The other process is a spawned child that takes commands over a pipe (as in test_ipc.py).
"""

from __future__ import annotations

import gc
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from extensible_kv import (
    ExtensibleTensor,
    HandleSizing,
    Loan,
    LoanTimeoutError,
    recv_loan,
    send_shared,
)
from support.child import TIMEOUT_S, Child
from support.devices import device_kwargs

SEGMENTS = 2
# In granules: the lender keeps KEPT of BEFORE per segment and lends the rest.
CAPACITY, BEFORE, KEPT, START = 8, 6, 2, 2


def pattern(n: int, seed: int) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 13 + seed) % 251 + 1).to(torch.uint8)


def counts() -> tuple[int, int]:
    """`(open fds, mapping lines)` of this process."""
    with open("/proc/self/maps") as maps:
        return len(os.listdir("/proc/self/fd")), sum(1 for _ in maps)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make(device: str, g: int, grow: int) -> ExtensibleTensor:
    """`SEGMENTS` segments of `CAPACITY` granules, handles of 2 granules, grown to `grow`."""
    t = ExtensibleTensor(
        SEGMENTS * CAPACITY * g,
        SEGMENTS,
        handle_sizing=HandleSizing(max_bytes=2 * g),
        export_handle_types="posix_fd",
        **device_kwargs(device),
    )
    t.resize_per_segment_(grow * g)
    return t


def fill(t: ExtensibleTensor, seed: int) -> None:
    for s in range(t.num_segments):
        view = t.segment_view(s)
        view.copy_(pattern(view.numel(), seed + s).to(view.device))


def read(t: ExtensibleTensor, segment: int, start: int, end: int) -> torch.Tensor:
    return t.segment_view(segment)[start:end].cpu().clone()  # no view outlives the call


# --------------------------------------------------------------------------------------------
# the child: a small command loop, borrower or lender


def _child_main(conn: Any, device: str, g: int) -> None:
    t: ExtensibleTensor | None = None
    loan: Loan | None = None
    try:
        while True:
            command, *args = conn.recv()
            if command == "make":
                t = make(device, g, args[0])
                conn.send(("ok", os.getpid()))
            elif command == "fill":
                assert t is not None
                fill(t, args[0])
                _sync(t.device)
                conn.send(("ok",))
            elif command == "read":
                assert t is not None
                conn.send(("ok", bytes(read(t, *args).numpy())))
            elif command == "borrow":
                assert t is not None
                loan = args[0]
                t.borrow(loan, zero=args[1])
                conn.send(("ok", t.segment_bytes))
            elif command == "recv_borrow":
                assert t is not None
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.connect(args[0])
                    loan = recv_loan(sock)
                t.borrow(loan, zero=False)
                conn.send(("ok", t.segment_bytes))
            elif command == "shrink":
                assert t is not None
                t.shrink_per_segment_(args[0])
                conn.send(("ok", t.borrowed_bytes))
            elif command == "give_back":
                assert t is not None and loan is not None
                t.give_back(loan)
                conn.send(("ok", t.segment_bytes))
            elif command == "lend":
                assert t is not None
                loan = t.lend(args[0])
                conn.send(("ok", loan))
            elif command == "cycles":
                # ("cycles", n): n times borrow the loan sent, check a byte, give it back.
                assert t is not None
                for _ in range(args[0]):
                    cycle_loan = conn.recv()
                    t.borrow(cycle_loan, zero=False)
                    first = int(t.segment_view(0)[START * g].item())
                    t.give_back(cycle_loan)
                    conn.send(first)
                conn.send(("ok", counts()))
            elif command == "counts":
                conn.send(("ok", counts()))
            elif command == "stop":
                conn.send(("ok",))
                return
    except BaseException as error:  # report, so the parent fails with the child's reason
        conn.send(("error", f"{type(error).__name__}: {error}"))


@pytest.fixture
def child(device: str, g: int) -> Iterator[Child]:
    with Child(_child_main, device, g) as proc:
        yield proc


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("zero", [False, True], ids=["kept", "zeroed"])
def test_lend_borrow_give_back_reclaim_across_processes(
    device: str, g: int, child: Child, zero: bool
) -> None:
    lender = make(device, g, BEFORE)
    fill(lender, 10)
    _sync(lender.device)
    base = lender.base_ptr
    held = lender.segment_view(1)  # taken before the loan: valid again after the reclaim
    physical = lender.physical_bytes
    loan = lender.lend(KEPT * g)
    assert lender.segment_bytes == (KEPT * g,) * SEGMENTS
    assert lender.physical_bytes + lender.lent_bytes == physical, "counted once"
    assert loan.num_bytes == SEGMENTS * (BEFORE - KEPT) * g

    child("make", START)
    child("fill", 50)
    (sizes,) = child("borrow", loan, zero)
    grown = (START + BEFORE - KEPT) * g
    assert tuple(sizes) == (grown,) * SEGMENTS
    for s in range(SEGMENTS):
        (got,) = child("read", s, 0, grown)
        lent = (
            bytes((BEFORE - KEPT) * g)
            if zero
            else bytes(pattern(BEFORE * g, 10 + s)[KEPT * g :].numpy())
        )
        assert got == bytes(pattern(START * g, 50 + s).numpy()) + lent, s
    with pytest.raises(ValueError, match="at most once"):
        make(device, g, START).borrow(loan)  # a replay, here
    with pytest.raises(LoanTimeoutError, match="still borrowed"):
        lender.reclaim(loan, timeout=0.05)
    assert lender.segment_bytes == (KEPT * g,) * SEGMENTS

    child("fill", 90)
    (sizes,) = child("give_back", loan)
    assert tuple(sizes) == (START * g,) * SEGMENTS
    lender.reclaim(loan, zero=zero, timeout=10)
    assert lender.base_ptr == base
    assert lender.segment_bytes == (BEFORE * g,) * SEGMENTS
    for s in range(SEGMENTS):
        got = read(lender, s, 0, BEFORE * g)
        back = (
            torch.zeros((BEFORE - KEPT) * g, dtype=torch.uint8)
            if zero
            else pattern(grown, 90 + s)[START * g :]
        )
        assert torch.equal(got, torch.cat([pattern(BEFORE * g, 10 + s)[: KEPT * g], back])), s
    assert torch.equal(held.cpu()[: KEPT * g], pattern(BEFORE * g, 11)[: KEPT * g])
    held[-1:].fill_(3)  # the view taken before the loan reaches the reclaimed memory again
    with pytest.raises(ValueError, match="stale"):
        make(device, g, START).borrow(loan)
    del held
    lender._check_invariants()


def test_a_loan_over_a_unix_socket(device: str, g: int, child: Child) -> None:
    lender = make(device, g, BEFORE)
    fill(lender, 20)
    _sync(lender.device)
    loan = lender.lend(KEPT * g)
    child("make", START)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sock")
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(path)
            server.listen(1)
            child.conn.send(("recv_borrow", path))
            conn, _ = server.accept()
            with conn:
                send_shared(conn, loan)
            status, *result = child.conn.recv()
            assert status == "ok", result[0]
    (got,) = child("read", 1, START * g, START * g + 64)
    assert got == bytes(pattern(BEFORE * g, 21)[KEPT * g : KEPT * g + 64].numpy())
    child("give_back")
    lender.reclaim(loan, zero=False, timeout=10)
    assert torch.equal(read(lender, 1, 0, BEFORE * g), pattern(BEFORE * g, 21))


def test_handles_exported_ahead_are_what_a_lend_sends(device: str, g: int, child: Child) -> None:
    """`export_ahead` (a pool donor's, between its steps) exports the top handles first, a
    few at a time; a later lend opens no fd for them, and the borrower reads the bytes."""
    other = make(device, g, BEFORE)
    assert other.export_ahead(0) == other.num_handles > 0
    plain = ExtensibleTensor(2 * g, **device_kwargs(device)).resize_(2 * g)
    assert plain.export_ahead(8) == 0, "no loan could take a handle not exported as an fd"
    lender = make(device, g, BEFORE)
    fill(lender, 30)
    _sync(lender.device)
    handles = lender.num_handles
    fds = counts()[0]
    assert lender.export_ahead(2) == handles - 2
    assert counts()[0] == fds + 2
    while lender.export_ahead(2):
        pass
    assert counts()[0] == fds + handles
    assert lender.export_ahead(2) == 0
    assert counts()[0] == fds + handles, "each handle is exported once"

    # A lend of exported handles opens only its board; one of fresh handles an fd each more.
    fresh = make(device, g, BEFORE)
    fds = counts()[0]
    fresh_loan = fresh.lend(KEPT * g)
    fresh_opened = counts()[0] - fds
    fds = counts()[0]
    loan = lender.lend(KEPT * g)
    opened = counts()[0] - fds
    lent_handles = SEGMENTS * (BEFORE - KEPT) // 2
    assert fresh_opened == opened + lent_handles, (fresh_opened, opened)
    fresh.reclaim(fresh_loan, timeout=0)

    child("make", START)
    child("borrow", loan, False)
    for s in range(SEGMENTS):
        (got,) = child("read", s, START * g, (START + BEFORE - KEPT) * g)
        assert got == bytes(pattern(BEFORE * g, 30 + s)[KEPT * g :].numpy()), s
    child("give_back")
    lender.reclaim(loan, zero=False, timeout=10)
    assert lender.export_ahead(2) == 0, "reclaimed handles keep their export"
    lender._check_invariants()


BORROWER_STEPS = ["lent", "borrowed", "partly given back", "given back"]


@pytest.mark.parametrize("step", BORROWER_STEPS)
def test_kill_9_of_the_borrower_returns_the_loan_within_100_ms(
    device: str, g: int, child: Child, step: str
) -> None:
    lender = make(device, g, BEFORE)
    fill(lender, 30)
    _sync(lender.device)
    loan = lender.lend(KEPT * g)
    child("make", START)
    if step != "lent":
        child("borrow", loan, False)
    if step == "partly given back":
        (borrowed,) = child("shrink", (START + 1) * g)
        assert borrowed == SEGMENTS * 2 * g  # whole handles only: the straddling one stays
    if step == "given back":
        child("give_back")
    killed = child.kill()
    lender.reclaim(loan, zero=False, timeout=10)
    took = time.monotonic() - killed
    assert took < 0.1, f"reclaimed {took * 1000:.1f} ms after the kill"
    assert lender.segment_bytes == (BEFORE * g,) * SEGMENTS
    for s in range(SEGMENTS):  # nothing the borrower wrote: the lender's own bytes, kept
        assert torch.equal(read(lender, s, 0, BEFORE * g), pattern(BEFORE * g, 30 + s)), s
    lender._check_invariants()


LENDER_STEPS = ["lent", "borrowed", "given back"]


@pytest.mark.parametrize("step", LENDER_STEPS)
def test_kill_9_of_the_lender_leaves_the_borrower_its_memory(
    device: str, g: int, child: Child, step: str
) -> None:
    if device != "cpu":
        torch.zeros(1, device="cuda:0")  # torch's CUDA context (and its fds) first
    fds = counts()[0]
    borrower = make(device, g, START)
    child("make", BEFORE)
    child("fill", 40)
    (loan,) = child("lend", KEPT * g)
    if step == "lent":
        child.kill()
        child.process.join()
        with pytest.raises(ValueError, match="stale"):
            borrower.borrow(loan)
        assert borrower.segment_bytes == (START * g,) * SEGMENTS
        return
    borrower.borrow(loan, zero=False)
    if step == "given back":
        borrower.give_back(loan)
    child.kill()
    child.process.join()
    if step == "borrowed":
        for s in range(SEGMENTS):
            got = read(borrower, s, START * g, (START + BEFORE - KEPT) * g)
            assert torch.equal(got, pattern(BEFORE * g, 40 + s)[KEPT * g :]), s
        fill(borrower, 7)  # still the borrower's to write
        borrower.give_back(loan)  # the memory goes back to the driver
    assert borrower.segment_bytes == (START * g,) * SEGMENTS
    borrower._check_invariants()
    borrower.close()
    gc.collect()
    assert counts()[0] == fds, "an fd of the loan is still open"


def test_a_thousand_cycles_leave_fds_and_mappings_as_they_were(
    device: str, g: int, child: Child
) -> None:
    lender = make(device, g, BEFORE)
    fill(lender, 60)
    _sync(lender.device)
    child("make", START)

    expected = int(pattern(BEFORE * g, 60)[KEPT * g])

    def cycles(n: int) -> tuple[int, int]:
        child.conn.send(("cycles", n))
        for i in range(n):
            loan = lender.lend(KEPT * g)
            child.conn.send(loan)
            assert child.conn.poll(TIMEOUT_S)
            first = child.conn.recv()
            assert first == expected, (i, first)
            lender.reclaim(loan, zero=False, timeout=10)
        status, child_counts = child.conn.recv()
        assert status == "ok", child_counts
        return tuple(child_counts)

    child_warm = cycles(5)  # the exports are made once, and kept: warm up first
    warm = counts()
    child_after = cycles(1000)
    assert counts() == warm
    assert child_after == child_warm
    lender._check_invariants()
