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
from conftest import memfd_counts
from extensible_kv import ExtensibleTensor, HandleSizing, SharedHandle, SharedTensor
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

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
