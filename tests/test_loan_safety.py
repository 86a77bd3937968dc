"""Loans under attack (issue 51), on every backend (see conftest.py) unless a test says why not:
a borrowed handle is never lent onward; a reclaim commits only what is mapped; loans and shares
refuse each other, across processes; a refused `pidfd_getfd` is a typed `PtraceRefusedError`;
Ctrl-C ends a reclaim or a wait that would wait for ever, before anything changed, or says that
the reclaim completed; a cache's reclaim that fails part-way takes the rest at its next call; a
NaN timeout is refused. Every refusal leaves the tensor as it was: its sizes, its handles, and
this process's fds and mapping lines (`/proc/self`).

The other process is a spawned child that takes commands over a pipe (as in test_lend.py);
the Ctrl-C tests run a script of their own in a subprocess, which signals itself once its main
thread is inside the native wait.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from extensible_kv import (
    AttentionLayerSpec,
    ExtensibleKVCache,
    ExtensibleTensor,
    HandleSizing,
    KVCacheTensorSpec,
    LoanConflictError,
    LoanTimeoutError,
    PtraceRefusedError,
    SharedTensor,
)
from support.child import Child
from support.devices import device_kwargs

SEGMENTS = 2
# In granules: handles of 2 granules; the lender keeps KEPT of BEFORE per segment.
CAPACITY, BEFORE, KEPT, START = 8, 6, 2, 2


def pattern(n: int, seed: int) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 13 + seed) % 251 + 1).to(torch.uint8)


def counts() -> tuple[int, int]:
    """`(open fds, mapping lines)` of this process."""
    with open("/proc/self/maps") as maps:
        return len(os.listdir("/proc/self/fd")), sum(1 for _ in maps)


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
    if t.device.startswith("cuda"):
        torch.cuda.synchronize()


def read(t: ExtensibleTensor, segment: int, start: int, end: int) -> torch.Tensor:
    return t.segment_view(segment)[start:end].cpu().clone()  # no view outlives the call


def state(t: ExtensibleTensor) -> tuple[Any, ...]:
    """What a refused call must leave as it was."""
    return (t.segment_bytes, t.physical_bytes, t.handle_runs(), t.lent_bytes, t.borrowed_bytes)


# --------------------------------------------------------------------------------------------
# the child: a small command loop


def _child_main(conn: Any, device: str, g: int) -> None:
    t: ExtensibleTensor | None = None
    imported: ExtensibleTensor | None = None
    try:
        while True:
            command, *args = conn.recv()
            if command == "make":
                t = make(device, g, args[0])
                fill(t, args[1])
                conn.send(("ok",))
            elif command == "import":
                imported = ExtensibleTensor.from_shared(args[0])
                conn.send(("ok",))
            elif command == "read_import":
                assert imported is not None
                conn.send(("ok", bytes(read(imported, *args).numpy())))
            elif command == "lend":
                assert t is not None
                conn.send(("ok", t.lend(args[0])))
            elif command == "reclaim":
                assert t is not None
                t.reclaim(args[0], zero=False, timeout=10)
                conn.send(("ok", bytes(read(t, 0, 0, BEFORE * g).numpy())))
            elif command in ("borrow", "try_import"):
                assert t is not None
                try:
                    if command == "borrow":
                        t.borrow(args[0])
                    else:
                        ExtensibleTensor.from_shared(args[0])
                    conn.send(("ok", None))
                except Exception as error:  # the parent checks the type, by name and bases
                    bases = [c.__name__ for c in type(error).__mro__]
                    conn.send(("ok", (bases, str(error))))
            elif command == "setuid":
                os.setuid(args[0])  # from here on, no capability: ptrace by uid alone
                conn.send(("ok",))
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
# a borrowed handle is never lent onward


def test_a_borrowed_handle_is_not_lent_onward(device: str, g: int) -> None:
    """Else: the middle tensor closes, the first lender's reclaim succeeds, and the third
    tensor still maps the handle: two owners."""
    lender = make(device, g, BEFORE)
    middle = make(device, g, START)
    loan = lender.lend(KEPT * g)
    middle.borrow(loan, zero=False)
    before, held = state(middle), counts()
    for kept in (START * g, (START + 2) * g):
        with pytest.raises(LoanConflictError, match=f"borrowed.*loan {loan.loan_id}"):
            middle.lend(kept)
        assert state(middle) == before
        assert counts() == held, "a refused lend kept an fd or a mapping"
    assert isinstance(LoanConflictError("x"), ValueError)
    middle._check_invariants()
    middle.give_back(loan)
    lender.reclaim(loan, zero=False, timeout=10)
    own = middle.lend(0)  # its own memory lends as ever
    middle.reclaim(own, timeout=0)


# --------------------------------------------------------------------------------------------
# a reclaim commits only what is mapped


@pytest.mark.parametrize("between", ["exact shrink", "consolidate", "shrink to 0 and grow back"])
def test_a_reclaim_grows_back_only_over_mapped_granules(device: str, g: int, between: str) -> None:
    """A lend that keeps 3 granules leaves the handle over granules 2-3 straddling; each of
    these drops its unneeded tail, and a reclaim that grew back over it anyway reported
    granules committed that nothing mapped (the next write: SIGSEGV on the host, an illegal
    address on CUDA)."""
    kept = 3 * g
    t = make(device, g, BEFORE)
    fill(t, 5)
    loan = t.lend(kept)
    if between == "exact shrink":
        t.shrink_per_segment_(kept, exact=True)
    elif between == "consolidate":
        t.consolidate()
    else:
        t.shrink_per_segment_(0)
        t.wait_released()  # else the grow may take back the handles the shrink gave
        t.resize_per_segment_(kept)
    t._check_invariants()
    # The straddling handle's tail (granule 3 of each segment) is gone: checked, not assumed.
    mapped = {granule for first, n in t.handle_runs() for granule in range(first, first + n)}
    tail_mapped = all(s * CAPACITY + 3 in mapped for s in range(SEGMENTS))
    t.reclaim(loan, zero=False, timeout=10)
    t._check_invariants()
    assert t.lent_bytes == 0
    assert not tail_mapped
    assert t.segment_bytes == (kept,) * SEGMENTS, "grew back over an unmapped granule"
    t.resize_per_segment_(BEFORE * g)  # maps only the missing tail: the rest is slack
    t._check_invariants()
    fill(t, 9)
    for s in range(SEGMENTS):
        assert torch.equal(read(t, s, 0, BEFORE * g), pattern(BEFORE * g, 9 + s)), s


# --------------------------------------------------------------------------------------------
# loans and shares refuse each other


def test_a_shared_handle_is_not_lent_while_an_importer_may_map_it(
    device: str, g: int, child: Child
) -> None:
    """Else the importer in the other process reads what the borrower writes, and its writes
    land in the borrower's memory."""
    lender = make(device, g, BEFORE)
    fill(lender, 30)
    child("make", START, 60)
    child("import", lender.share())
    before, held = state(lender), counts()
    with pytest.raises(LoanConflictError, match=r"share\(\)"):
        lender.lend(KEPT * g)
    assert state(lender) == before
    assert counts() == held, "a refused lend kept an fd or a mapping"
    (got,) = child("read_import", 1, 0, BEFORE * g)
    assert got == bytes(pattern(BEFORE * g, 31).numpy()), "the importer lost the memory"
    # Memory grown after the last share() was never described: that lends.
    lender.resize_per_segment_(CAPACITY * g)
    loan = lender.lend(BEFORE * g)
    assert loan.num_bytes == SEGMENTS * (CAPACITY - BEFORE) * g
    lender.reclaim(loan, timeout=0)
    lender._check_invariants()


def test_borrowed_memory_is_not_shared(device: str, g: int, child: Child) -> None:
    """Else the borrower's importers keep the lender's memory after the give-back and the
    reclaim: they read the lender's bytes, and their writes land in the lender."""
    child("make", BEFORE, 40)
    (loan,) = child("lend", KEPT * g)
    borrower = make(device, g, START)
    description = borrower.share()  # before the borrow: its own memory only
    borrower.borrow(loan, zero=False)
    before, held = state(borrower), counts()
    with pytest.raises(LoanConflictError, match=f"borrowed.*loan {loan.loan_id}"):
        borrower.share()
    assert state(borrower) == before
    assert counts() == held, "a refused share kept an fd or a mapping"
    assert all(h.num_granules + h.first_granule <= START for h in description.handles[:1])
    borrower.give_back(loan)
    (kept,) = child("reclaim", loan)
    assert kept == bytes(pattern(BEFORE * g, 40)[: BEFORE * g].numpy())
    assert isinstance(borrower.share(), SharedTensor)  # its own again
    borrower._check_invariants()


# --------------------------------------------------------------------------------------------
# a refused pidfd_getfd


def test_a_refused_take_is_a_ptrace_refused_error(device: str, g: int, child: Child) -> None:
    """A borrow or an import whose `pidfd_getfd` the kernel refuses (EPERM: another user,
    Yama's ptrace_scope) raises `PtraceRefusedError`, a `PermissionError` (so an `OSError`, as
    the pool's member catches), whose text still says the process may not trace the owner."""
    if device != "cpu":
        pytest.skip("pidfd_getfd is the same call on every backend: the host one is enough")
    lender = make(device, g, BEFORE)
    loan = lender.lend(KEPT * g)
    owner = make(device, g, START)
    description = owner.share()
    if os.geteuid() == 0:
        # Root may trace anyone: a child that gave up root may not trace this process.
        child("make", START, 1)
        child("setuid", 65534)
        refusals = [child("borrow", loan)[0], child("try_import", description)[0]]
    else:
        # Pid 1 is another user's: this process may not trace it.
        borrower = make(device, g, START)
        before, held = state(borrower), counts()
        refusals = []
        for call in (
            lambda: borrower.borrow(replace(loan, owner_pid=1)),
            lambda: ExtensibleTensor.from_shared(
                replace(
                    description,
                    owner_pid=1,
                    handles=tuple(replace(h, pid=1) for h in description.handles),
                )
            ),
        ):
            with pytest.raises(PtraceRefusedError) as refused:
                call()
            refusals.append(([c.__name__ for c in type(refused.value).__mro__], str(refused.value)))
        assert state(borrower) == before
        assert counts() == held, "a refused borrow or import kept an fd or a mapping"
    for bases, message in refusals:
        assert bases[:2] == ["PtraceRefusedError", "PermissionError"], (bases, message)
        assert "OSError" in bases
        assert "may not trace the owner" in message, message
    lender.reclaim(loan, timeout=0)
    assert issubclass(PtraceRefusedError, PermissionError)


# --------------------------------------------------------------------------------------------
# Ctrl-C

# The subprocess's preamble: a lender and a borrower in one process (the borrower keeps the
# loan), and `interrupt_when_waiting()`, a thread that sends this process SIGINT once the
# main thread sleeps inside the native call on line `line` of the facade.
_PREAMBLE = """
import json, os, signal, sys, threading, time
import extensible_kv.tensor as facade
from extensible_kv import ExtensibleTensor, HandleSizing, LoanTimeoutError

cpu = "{device}" == "cpu"
kw = dict(device="{device}", granularity=4096) if cpu else dict(device="{device}")
g = 4096 if cpu else ExtensibleTensor(1, **kw).granularity

def make(grow):
    t = ExtensibleTensor(
        2 * 8 * g, 2, handle_sizing=HandleSizing(max_bytes=2 * g),
        export_handle_types="posix_fd", **kw,
    )
    t.resize_per_segment_(grow * g)
    return t

def sleeping_in(function):
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident)
    if frame is None or frame.f_code.co_name != function:
        return False
    with open(f"/proc/self/task/{{main.native_id}}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "S"

def interrupt_when_waiting(function):
    def watch():
        seen = 0
        while seen < 3:  # three looks 20 ms apart: the main thread is in the native wait
            time.sleep(0.02)
            seen = seen + 1 if sleeping_in(function) else 0
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=watch, daemon=True).start()

lender, borrower = make(6), make(2)
loan = lender.lend(2 * lender.granularity)
borrower.borrow(loan, zero=False)
before = dict(lent=lender.lent_bytes, sizes=lender.segment_bytes)
"""


def _run(device: str, body: str) -> dict[str, Any]:
    script = _PREAMBLE.format(device=device) + textwrap.dedent(body)
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"Ctrl-C did not end the wait within 60 s: {hung.stderr!r}")
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_ctrl_c_ends_a_reclaim_that_waits_for_ever_with_nothing_changed(device: str) -> None:
    result = _run(
        device,
        """
        interrupt_when_waiting("reclaim")
        try:
            lender.reclaim(loan, timeout=None)
            raised = None
        except KeyboardInterrupt as interrupt:
            raised = str(interrupt)
        after = dict(lent=lender.lent_bytes, sizes=lender.segment_bytes)
        borrower.give_back(loan)
        lender.reclaim(loan, zero=False, timeout=10)  # the loan is still whole
        lender._check_invariants()
        print(json.dumps(dict(raised=raised, before=before, after=after)))
        """,
    )
    assert result["raised"] is not None, "reclaim returned, though the loan was borrowed"
    assert "completed" not in result["raised"]
    assert result["after"] == result["before"], "an interrupted reclaim changed the lender"


def test_ctrl_c_after_the_loan_came_back_says_the_reclaim_completed(device: str) -> None:
    """The SIGINT handler gives the loan back and raises: the reclaim then completes, and the
    KeyboardInterrupt it raises says so, in place of a bare one after a reclaim that happened."""
    result = _run(
        device,
        """
        def give_back_then_interrupt(signum, frame):
            borrower.give_back(loan)
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, give_back_then_interrupt)
        interrupt_when_waiting("reclaim")
        try:
            lender.reclaim(loan, zero=False, timeout=None)
            raised = None
        except KeyboardInterrupt as interrupt:
            raised = str(interrupt)
        lender._check_invariants()
        after = dict(lent=lender.lent_bytes, sizes=lender.segment_bytes)
        print(json.dumps(dict(raised=raised, after=after, loan=loan.loan_id)))
        """,
    )
    assert result["raised"] is not None, "the interrupt was lost"
    assert "completed" in result["raised"] and f"loan {result['loan']}" in result["raised"]
    assert result["after"]["lent"] == 0


def test_ctrl_c_ends_waits_for_releases_and_a_borrow_behind_them() -> None:
    """Host only: its held events stand in for a stream that never gets there
    (`_hold_events`); CUDA's events complete."""
    result = _run(
        "cpu",
        """
        other = make(4)
        other._hold_events(True)
        other.shrink_per_segment_(2 * other.granularity)  # pending until the events go
        outcomes = {}
        lender2 = make(6)
        offered = lender2.lend(2 * lender2.granularity)
        for call, function in [
            (lambda: other.wait_released(), "wait_released"),
            (lambda: other.borrow(offered, zero=False), "borrow"),
        ]:
            interrupt_when_waiting(function)
            try:
                call()
                outcomes[function] = None
            except KeyboardInterrupt as interrupt:
                outcomes[function] = f"KeyboardInterrupt {interrupt}"
        unchanged = other.borrowed_bytes == 0 and other.pending_release_bytes > 0
        other._hold_events(False)
        assert other.wait_released(timeout=10)
        other.borrow(offered, zero=False)  # the loan is still offered
        # suspend() waits too: interrupted there, the tensor is suspended all the same, and
        # resume() grows it back.
        third = make(4)
        third._hold_events(True)
        interrupt_when_waiting("wait_released")
        try:
            third.suspend(2 * g)
            outcomes["suspend"] = None
        except KeyboardInterrupt as interrupt:
            outcomes["suspend"] = f"KeyboardInterrupt {interrupt}"
        suspended = third.suspended
        third._hold_events(False)
        third.resume()
        resumed = third.segment_bytes == (4 * g, 4 * g)
        print(json.dumps(dict(outcomes=outcomes, unchanged=unchanged, suspended=suspended,
                              resumed=resumed)))
        """,
    )
    assert all(result["outcomes"].values()), result
    assert result["unchanged"], "an interrupted wait changed the tensor"
    assert result["suspended"] and result["resumed"], "an interrupted suspend lost its sizes"


# --------------------------------------------------------------------------------------------
# a cache's reclaim, one loan per buffer


def test_a_cache_reclaim_that_fails_part_way_takes_the_rest_next_time() -> None:
    """The borrower gives its loans back buffer by buffer: a lender that looks in between
    reclaims the first buffer's and times out on the second's. Its next reclaim of the same
    loans must take back the rest, not fail on the first ("not outstanding"), which left the
    cache short of those blocks for good. Host only: the cache's own bookkeeping."""
    layer = AttentionLayerSpec("FLASH_ATTN", 16, 2, 32, torch.bfloat16)
    spec = [KVCacheTensorSpec(4096, {"a": layer}), KVCacheTensorSpec(4096, {"b": layer})]

    def make() -> ExtensibleKVCache:
        cache = ExtensibleKVCache(spec, 64, "cpu", granularity=4096, export_handle_types="posix_fd")
        return cache

    with make() as lender, make() as borrower:
        lender.commit(8)
        lender.commit(32)
        borrower.commit(8)
        loans = lender.lend(8)
        borrower.borrow(loans, zero=False)
        borrower.buffers[0].give_back(loans[0])
        with pytest.raises(LoanTimeoutError):
            lender.reclaim(loans, timeout=0)
        assert lender.buffers[0].lent_bytes == 0 and lender.buffers[1].lent_bytes > 0
        assert lender.committed_blocks == 8
        borrower.buffers[1].give_back(loans[1])
        lender.reclaim(loans, timeout=10)
        assert lender.committed_blocks == 32
        assert all(buffer.lent_bytes == 0 for buffer in lender.buffers)
        for buffer in lender.buffers:
            buffer._check_invariants()
        again = lender.lend(8)  # and the next loans start afresh
        lender.reclaim(again, timeout=0)
        assert lender.committed_blocks == 32


def test_a_nan_timeout_is_refused_at_the_native_door(device: str, g: int) -> None:
    """The facade refuses it (`_args.seconds`); the native methods made it 0, so a reclaim
    told to wait NaN seconds took back at once a loan that was still offered."""
    from extensible_kv import _native

    lender = make(device, g, BEFORE)
    loan = lender.lend(KEPT * g)
    before = state(lender)
    with pytest.raises(ValueError, match="NaN"):
        lender._reclaim(loan._to_native(), False, float("nan"), None)
    with pytest.raises(ValueError, match="NaN"):
        _native.ExtensibleTensor.wait_released(lender, float("nan"))
    assert state(lender) == before, "a NaN timeout reclaimed the loan"
    lender.reclaim(loan, timeout=0)
