"""Hypothesis fuzz of shared descriptions (host backend): thousands of mutated descriptions of
a real owner's memory — wrong types, out-of-range values, shuffled, dropped, duplicated or
forged handles, another tensor's id — given to `from_shared`. None crashes the process, each
is refused with a `TypeError` or `ValueError` (naming the field) unless it still describes the
owner's memory exactly, none leaves an fd or a mapping behind, and the owner is unchanged."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
from extensible_kv import (
    ExtensibleTensor,
    HandleSizing,
    Loan,
    LoanHandle,
    PtraceRefusedError,
    SharedHandle,
    SharedTensor,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.memory import memfd_counts

G = 4096
FIELDS = [f.name for f in dataclasses.fields(SharedTensor) if f.name != "received_fds"]
HANDLE_FIELDS = [f.name for f in dataclasses.fields(SharedHandle)]

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**130), 2**130),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**32, 2**63, 2**64 - 1, 2**64, 2**128]),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=70),
    st.lists(st.integers(-5, 2**20), max_size=4).map(tuple),
    st.just(object()),
)


@pytest.fixture(scope="module")
def owner() -> Any:
    t = ExtensibleTensor(
        16 * G,
        2,
        "cpu",
        granularity=G,
        handle_sizing=HandleSizing(max_bytes=2 * G),
        export_handle_types="posix_fd",
    )
    t.resize_per_segment_(5 * G)
    for s in range(2):
        t.segment_view(s).copy_(torch.arange(5 * G).remainder(251) + s)
    yield t
    t.close()


def _mutate(data: st.DataObject, description: SharedTensor) -> tuple[SharedTensor, str]:
    kind = data.draw(st.sampled_from(["field", "handle", "handles", "id"]))
    if kind == "field":
        name = data.draw(st.sampled_from(FIELDS))
        return dataclasses.replace(description, **{name: data.draw(junk)}), f"field {name}"
    handles = list(description.handles)
    if kind == "handle":
        i = data.draw(st.integers(0, len(handles) - 1))
        name = data.draw(st.sampled_from(HANDLE_FIELDS))
        value = data.draw(st.one_of(junk, st.integers(0, 64)))
        handles[i] = dataclasses.replace(handles[i], **{name: value})
        return dataclasses.replace(description, handles=tuple(handles)), f"handle {name}"
    if kind == "handles":
        op = data.draw(st.sampled_from(["drop", "dup", "shuffle", "junk"]))
        if op == "drop":
            handles.pop(data.draw(st.integers(0, len(handles) - 1)))
        elif op == "dup":
            handles.append(handles[data.draw(st.integers(0, len(handles) - 1))])
        elif op == "shuffle":
            handles = data.draw(st.permutations(handles))
        else:
            handles.append(data.draw(junk))
        return dataclasses.replace(description, handles=tuple(handles)), f"handles {op}"
    return dataclasses.replace(description, tensor_id=data.draw(junk)), "tensor_id"


@settings(
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)
@given(data=st.data())
def test_a_mutated_description_is_refused_or_exact_and_leaves_nothing(
    owner: ExtensibleTensor, data: st.DataObject
) -> None:
    description = owner.share()
    before = (owner.segment_bytes, owner.handle_runs(), owner.physical_bytes)
    counts = memfd_counts()
    fds = len(os.listdir("/proc/self/fd"))
    wrong, what = _mutate(data, description)
    try:
        imported = ExtensibleTensor.from_shared(wrong)
    except (TypeError, ValueError) as error:
        event(f"{what}: {type(error).__name__}")
        assert str(error), what
    else:  # only the owner's own memory may map, at its own offsets
        event(f"{what}: accepted")
        assert set(imported.handle_runs()) <= set(owner.handle_runs()), what
        for s, committed in enumerate(imported.segment_bytes):
            assert committed <= owner.segment_bytes[s], what
            mine = imported.segment_view(s)
            assert torch.equal(mine, owner.segment_view(s)[:committed]), what
            del mine
        imported.close()
    assert memfd_counts() == counts, what
    assert len(os.listdir("/proc/self/fd")) == fds, what
    assert (owner.segment_bytes, owner.handle_runs(), owner.physical_bytes) == before
    owner._check_invariants()


LOAN_FIELDS = [f.name for f in dataclasses.fields(Loan) if f.name != "received_fds"]
LOAN_HANDLE_FIELDS = [f.name for f in dataclasses.fields(LoanHandle)]


def _mutate_loan(data: st.DataObject, loan: Loan) -> tuple[Loan, str]:
    kind = data.draw(st.sampled_from(["field", "handle", "handles"]))
    if kind == "field":
        name = data.draw(st.sampled_from(LOAN_FIELDS))
        value = data.draw(st.one_of(junk, st.integers(0, 64)))
        return dataclasses.replace(loan, **{name: value}), f"field {name}"
    handles = list(loan.handles)
    if kind == "handle":
        i = data.draw(st.integers(0, len(handles) - 1))
        name = data.draw(st.sampled_from(LOAN_HANDLE_FIELDS))
        value = data.draw(st.one_of(junk, st.integers(0, 64)))
        handles[i] = dataclasses.replace(handles[i], **{name: value})
        return dataclasses.replace(loan, handles=tuple(handles)), f"handle {name}"
    op = data.draw(st.sampled_from(["drop", "dup", "shuffle", "junk"]))
    if op == "drop":
        handles.pop(data.draw(st.integers(0, len(handles) - 1)))
    elif op == "dup":
        handles.append(handles[data.draw(st.integers(0, len(handles) - 1))])
    elif op == "shuffle":
        handles = data.draw(st.permutations(handles))
    else:
        handles.append(data.draw(junk))
    return dataclasses.replace(loan, handles=tuple(handles)), f"handles {op}"


@pytest.fixture(scope="module")
def lender_and_borrower() -> Any:
    def make() -> ExtensibleTensor:
        return ExtensibleTensor(
            16 * G,
            2,
            "cpu",
            granularity=G,
            handle_sizing=HandleSizing(max_bytes=2 * G),
            export_handle_types="posix_fd",
        )

    lender, borrower = make(), make()
    lender.resize_per_segment_(6 * G)
    for s in range(2):
        lender.segment_view(s).copy_(torch.arange(6 * G).remainder(251) + s)
    borrower.resize_per_segment_(2 * G)
    # Each lent handle is exported once and its fd kept for the handle's life: export first.
    lender.reclaim(lender.lend(2 * G), zero=False)
    yield lender, borrower
    lender.close()
    borrower.close()


def _borrow_mutated(data: st.DataObject, loan: Loan, borrower: ExtensibleTensor) -> str:
    """Borrows a mutation of `loan`: refused, or exactly the loan."""
    before = (borrower.segment_bytes, borrower.physical_bytes)
    wrong, what = _mutate_loan(data, loan)
    try:
        borrower.borrow(wrong, zero=False)
    # Another owner_pid may be a process this one may not trace (pid 1, say).
    except (TypeError, ValueError, PtraceRefusedError) as error:
        event(f"{what}: {type(error).__name__}")
        assert str(error), what
        assert (borrower.segment_bytes, borrower.physical_bytes) == before, what
        return what
    event(f"{what}: accepted")
    assert borrower.segment_bytes == (6 * G, 6 * G), what
    for s in range(2):
        expected = (torch.arange(6 * G).remainder(251) + s).byte()
        assert torch.equal(borrower.segment_view(s)[2 * G :], expected[2 * G :]), what
    return what


@settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)
@given(data=st.data())
def test_a_mutated_loan_is_refused_or_exact_and_leaves_nothing(
    lender_and_borrower: tuple[ExtensibleTensor, ExtensibleTensor], data: st.DataObject
) -> None:
    """Tampered loans: refused with a `TypeError` or `ValueError` before anything is mapped,
    unless still exactly the loan; a stale one (already reclaimed) is refused too. Neither
    side changes, and no fd or mapping is left."""
    lender, borrower = lender_and_borrower
    before = (borrower.segment_bytes, borrower.handle_runs(), borrower.physical_bytes)
    counts = memfd_counts()
    fds = len(os.listdir("/proc/self/fd"))
    loan = lender.lend(2 * G)
    try:
        what = _borrow_mutated(data, loan, borrower)
    finally:  # back as before, whatever failed: the next example starts from the same state
        if borrower.borrowed_bytes:
            borrower.give_back(loan)
        lender.reclaim(loan, zero=False, timeout=5)
    with pytest.raises(ValueError, match="stale"):
        borrower.borrow(loan)
    assert (borrower.segment_bytes, borrower.handle_runs(), borrower.physical_bytes) == before
    assert lender.segment_bytes == (6 * G, 6 * G)
    assert memfd_counts() == counts, what
    assert len(os.listdir("/proc/self/fd")) == fds, what
    lender._check_invariants()
    borrower._check_invariants()
