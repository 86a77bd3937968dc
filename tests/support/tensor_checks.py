"""Checks and byte patterns of the `ExtensibleTensor` tests (`tests/test_tensor*.py`): sizes
in units of the tensor's granularity, bytes read and written only inside mapped granules."""

from __future__ import annotations

from typing import Any

import torch
from extensible_kv import ExtensibleTensor

from support.memory import mapped_granules, needed_granules


def pattern(n: int, seed: int) -> torch.Tensor:
    """`n` deterministic non-zero bytes (1..251), different for different seeds."""
    return ((torch.arange(n, dtype=torch.int64) * 31 + seed * 7) % 251 + 1).to(torch.uint8)


def write(t: ExtensibleTensor, offset: int, data: torch.Tensor) -> None:
    """Writes `data` (uint8) at byte `offset` of the reservation, through a full view."""
    t.full_view()[offset : offset + data.numel()].copy_(data)


def read(t: ExtensibleTensor, offset: int, n: int) -> torch.Tensor:
    """A host copy of bytes `[offset, offset + n)` of the reservation."""
    return t.full_view()[offset : offset + n].cpu().clone()


def committed_contents(t: ExtensibleTensor) -> list[torch.Tensor]:
    """A host copy of the committed prefix of every segment."""
    return [t.segment_view(i).cpu().clone() for i in range(t.num_segments)]


def snapshot(t: ExtensibleTensor) -> tuple[Any, ...]:
    return (t.segment_bytes, t.physical_bytes, t.num_handles, list(t.handle_runs()))


def check(t: ExtensibleTensor) -> None:
    """The invariants, from the inside and from the outside."""
    t._check_invariants()
    mapped = mapped_granules(t)
    assert len(mapped) == len(set(mapped)), "a granule is mapped twice"
    # Growth only, so what is mapped is exactly what the committed prefixes need: whole
    # granules covering them, each shared granule once.
    assert set(mapped) == needed_granules(t)
    assert t.physical_bytes == len(mapped) * t.granularity
    assert t.num_handles == len(t.handle_runs())
    for committed, capacity in zip(t.segment_bytes, t.segment_capacities, strict=True):
        assert 0 <= committed <= capacity


def expect_zero(data: torch.Tensor) -> None:
    assert int(data.count_nonzero()) == 0, f"{int(data.count_nonzero())} non-zero bytes"
