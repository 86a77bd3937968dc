"""What a loan is worth to a borrower of another model: cache shapes, and the dealing of a
loan's handles over a borrower's segments (docs/design.md §3.10).

A loan is memory, not the lender's blocks: whole physical handles, each some granules. A
borrower turns them into blocks of its own layout. Every segment of every buffer of a cache
grows in lockstep (by `segment_block_bytes` of its buffer a block), so `N` more blocks need,
in segment `j` of buffer `i`, `N * segment_block_bytes[i]` bytes past its committed end, of
which what the segment already maps past that end (its slack) is free. A handle goes to one
segment whole, right after what it maps: `deal` decides which handle goes where, and how many
blocks `N` that buys.

Pure and deterministic: this module imports nothing heavy (no torch, no native module), so a
pool's policy can weigh a loan for any borrower from the ledger alone (`blocks_from`).

The dealing (`deal`) is greedy. For a block count `N`, each segment needs
`ceil(max(0, N * block_bytes - slack) / granularity)` granules; the handles go largest first
(ties: lower index first), each to the segment furthest behind its need (the most granules
still missing; ties: the lowest segment) that has room for it, until every need is met. `N` is
the largest count found so by a binary search between a count the greedy provably reaches and
the count the granules could at best hold. The bound: with `m` segments that need memory, the
largest handle `H` granules and `G` granules in all, the greedy meets every need whenever
`sum(needs) + m * (H - 1) <= G` (a segment is overfilled by less than one handle; one whose
need is unmet got less than its need), and no dealing meets them when `sum(needs) > G`. So
the blocks dealt are at least the most whose needs fit in `G - m * (H - 1)` granules, and at
most the most whose needs fit in `G` (`Dealing.bound`). With rooms (a segment's capacity) the
greedy may fall short of that bound, never over a room. Handles the dealing leaves out are
the borrower's to give back at once (`Dealing.unused`).
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BufferShape", "CacheShape", "Dealing", "blocks_from", "deal"]

# Bounds a shape read from a ledger must keep (its readers refuse anything else).
MAX_BUFFERS = 4096
MAX_SEGMENTS = 1 << 20  # per buffer, as the core's
MAX_BYTES = 1 << 62
_DEVICE = re.compile(r"cpu|cuda:[0-9]{1,4}")


def _count(value: object, field: str, minimum: int, maximum: int) -> int:
    """`value` as an int in `[minimum, maximum]` (no bools, no floats), else a `ValueError`
    naming `field`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be an int, not {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{field} = {value} must be in [{minimum}, {maximum}]")
    return value


@dataclass(frozen=True)
class BufferShape:
    """One buffer of a cache: `num_segments` segments, each growing by `segment_block_bytes`
    a block."""

    num_segments: int
    segment_block_bytes: int

    def __post_init__(self) -> None:
        _count(self.num_segments, "num_segments", 1, MAX_SEGMENTS)
        _count(self.segment_block_bytes, "segment_block_bytes", 1, MAX_BYTES)

    @property
    def block_bytes(self) -> int:
        """The bytes one block takes in this buffer, over all its segments."""
        return self.num_segments * self.segment_block_bytes


@dataclass(frozen=True)
class CacheShape:
    """A cache as a borrower: its `device` (`"cpu"`, `"cuda:N"`, as loans name it), its
    `granularity` (a loan must have both the same), its `buffers`, and `leading_blocks`, the
    blocks below block 0 in every segment (transformers' trash sectors; 0 for an
    `ExtensibleKVCache`)."""

    device: str
    granularity: int
    buffers: tuple[BufferShape, ...]
    leading_blocks: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be 'cpu' or 'cuda:N', not {self.device!r}")
        g = _count(self.granularity, "granularity", 1, MAX_BYTES)
        if g & (g - 1):
            raise ValueError(f"granularity = {g} must be a power of two")
        buffers = self.buffers
        if isinstance(buffers, list):
            buffers = tuple(buffers)
            object.__setattr__(self, "buffers", buffers)
        if not isinstance(buffers, tuple) or not 1 <= len(buffers) <= MAX_BUFFERS:
            raise ValueError(f"buffers must be a tuple of 1 to {MAX_BUFFERS} BufferShapes")
        for i, buffer in enumerate(buffers):
            if not isinstance(buffer, BufferShape):
                raise ValueError(f"buffers[{i}] must be a BufferShape, not {type(buffer).__name__}")
        _count(self.leading_blocks, "leading_blocks", 0, MAX_BYTES)

    @property
    def num_segments(self) -> int:
        """Segments over all buffers."""
        return sum(b.num_segments for b in self.buffers)

    def block_bytes(self) -> int:
        """The bytes one block takes in all buffers (each buffer's segments times their
        block bytes): what a cache of this shape needs per block, before granule rounding."""
        return sum(b.block_bytes for b in self.buffers)

    def mapped_bytes(self, blocks: int) -> int:
        """At most the physical bytes `blocks` committed blocks map: each segment maps whole
        granules, from its start to past its last block (the blocks below block 0 included).
        Segments that share a granule map it once, so a cache may map less, never more: what
        the pool counts against its cap before a commit."""
        g = self.granularity
        return sum(
            buffer.num_segments
            * (-(-(self.leading_blocks + blocks) * buffer.segment_block_bytes // g) * g)
            for buffer in self.buffers
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict, which `from_json` reads back."""
        return {
            "device": self.device,
            "granularity": self.granularity,
            "buffers": [[b.num_segments, b.segment_block_bytes] for b in self.buffers],
            "leading_blocks": self.leading_blocks,
        }

    @classmethod
    def from_json(cls, raw: object) -> CacheShape:
        """The shape `raw` (from `to_json`) describes, checked: a `ValueError` naming the
        field for anything else (a wrong type, a value out of range, a missing or extra key)."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"shape must be a JSON object, not {type(raw).__name__}")
        keys = {"device", "granularity", "buffers", "leading_blocks"}
        if missing := sorted(keys - {"leading_blocks"} - raw.keys()):
            raise ValueError(f"shape lacks {', '.join(missing)}")
        if extra := sorted(str(k) for k in raw.keys() - keys):
            raise ValueError(f"shape has unknown fields {', '.join(extra)}")
        buffers = raw["buffers"]
        if not isinstance(buffers, list | tuple) or not 1 <= len(buffers) <= MAX_BUFFERS:
            raise ValueError(f"shape.buffers must be a list of 1 to {MAX_BUFFERS} buffers")
        parsed = []
        for i, buffer in enumerate(buffers):
            if not isinstance(buffer, list | tuple) or len(buffer) != 2:
                raise ValueError(f"shape.buffers[{i}] must be [num_segments, segment_block_bytes]")
            try:
                parsed.append(BufferShape(buffer[0], buffer[1]))
            except ValueError as error:
                raise ValueError(f"shape.buffers[{i}].{error}") from None
        try:
            return cls(
                raw["device"],
                raw["granularity"],
                tuple(parsed),
                raw.get("leading_blocks", 0),
            )
        except ValueError as error:
            raise ValueError(f"shape.{error}") from None


@dataclass(frozen=True)
class Dealing:
    """Where each handle goes, and what that buys: `placements[k]` is `(buffer, segment)` for
    handle `k`, or `None` for one left out; every segment of every buffer gains `blocks`
    blocks. `bound` is `(low, high)`: the dealing is at least `low` blocks (what the greedy
    provably reaches without rooms) and no dealing of these handles holds more than `high`."""

    placements: tuple[tuple[int, int] | None, ...]
    blocks: int
    bound: tuple[int, int]

    @property
    def unused(self) -> tuple[int, ...]:
        """The handles left out: the borrower gives them back at once, unmapped."""
        return tuple(k for k, where in enumerate(self.placements) if where is None)

    def segment_handles(self, buffer: int, segment: int) -> tuple[int, ...]:
        """The handles dealt to `segment` of `buffer`, in the order they are mapped there
        (handle order)."""
        return tuple(k for k, where in enumerate(self.placements) if where == (buffer, segment))


def _per_segment(
    shape: CacheShape, values: int | Sequence[Sequence[int]], what: str, minimum: int
) -> list[int]:
    """`values` (one int for every segment, or per buffer one per segment) flattened in buffer
    order, each checked."""
    if isinstance(values, int):
        return [_count(values, what, minimum, MAX_BYTES)] * shape.num_segments
    if isinstance(values, str | bytes) or len(values) != len(shape.buffers):
        raise ValueError(f"{what} must list the shape's {len(shape.buffers)} buffers")
    flat: list[int] = []
    for i, (per, buffer) in enumerate(zip(values, shape.buffers, strict=True)):
        if isinstance(per, int | str | bytes) or len(per) != buffer.num_segments:
            raise ValueError(f"{what}[{i}] must list the buffer's {buffer.num_segments} segments")
        flat.extend(_count(v, f"{what}[{i}]", minimum, MAX_BYTES) for v in per)
    return flat


def deal(
    shape: CacheShape,
    slack_bytes_per_segment: int | Sequence[Sequence[int]],
    handle_granules: Sequence[int],
    *,
    room_granules: int | Sequence[Sequence[int]] | None = None,
    max_blocks: int | None = None,
) -> Dealing:
    """Deals handles of `handle_granules` (each a handle's size in granules of
    `shape.granularity`) over `shape`'s segments, for the most blocks every segment gains.

    `slack_bytes_per_segment` is one int for every segment, or per buffer a sequence of one
    per segment: the bytes each segment maps past its committed end already (negative where
    the first handle placed also holds bytes before it). `room_granules` (same forms; None:
    no limit) caps the granules a segment may take, and `max_blocks` the blocks gained (a
    capacity). Deterministic: the same arguments give the same dealing (module docstring)."""
    sizes = [
        _count(h, f"handle_granules[{k}]", 1, MAX_BYTES) for k, h in enumerate(handle_granules)
    ]
    slack = _per_segment(shape, slack_bytes_per_segment, "slack_bytes_per_segment", -MAX_BYTES)
    rooms: list[int | None] = (
        [None] * shape.num_segments
        if room_granules is None
        else list(_per_segment(shape, room_granules, "room_granules", 0))
    )
    if max_blocks is not None:
        _count(max_blocks, "max_blocks", 0, MAX_BYTES)
    g = shape.granularity
    block = [b.segment_block_bytes for b in shape.buffers for _ in range(b.num_segments)]
    where = [(i, j) for i, b in enumerate(shape.buffers) for j in range(b.num_segments)]
    total = sum(sizes)
    largest = max(sizes, default=0)

    def needs(n: int) -> list[int]:
        if n == 0:
            return [0] * len(block)
        return [-(-max(0, n * bb - s) // g) for bb, s in zip(block, slack, strict=True)]

    def fits(n: int, spare: int) -> bool:
        """Whether `n` blocks' needs fit `total - spare` granules, and each segment's room."""
        need = needs(n)
        if any(r is not None and k > r for k, r in zip(need, rooms, strict=True)):
            return False
        busy = sum(1 for k in need if k > 0)
        return sum(need) + busy * spare <= total

    def largest_such(ok: Callable[[int], bool], low: int, high: int) -> int:
        """The largest n in [low, high] with ok(n), given ok(low) and ok monotone."""
        while low < high:
            mid = (low + high + 1) // 2
            if ok(mid):
                low = mid
            else:
                high = mid - 1
        return low

    # A count past which nothing can fit: the granules and every slack, over the smallest block.
    ceiling = (total * g + sum(max(0, s) for s in slack)) // min(block) + 1
    if max_blocks is not None:
        ceiling = min(ceiling, max_blocks)
    high = largest_such(lambda n: fits(n, 0), 0, ceiling)
    low = (
        0
        if any(r is not None for r in rooms)
        else largest_such(lambda n: fits(n, largest - 1), 0, high)
    )

    order = sorted(range(len(sizes)), key=lambda k: (-sizes[k], k))

    def greedy(n: int) -> list[int | None] | None:
        """Segment of each handle meeting `n` blocks' needs, or None where the greedy fails."""
        need = needs(n)
        left = list(rooms)
        heap = [(-k, s) for s, k in enumerate(need) if k > 0]
        heapq.heapify(heap)
        placed: list[int | None] = [None] * len(sizes)
        for k in order:
            if not heap:
                break
            size, skipped = sizes[k], []
            while heap:
                behind, s = heapq.heappop(heap)
                room = left[s]
                if room is None or room >= size:
                    placed[k] = s
                    need[s] -= size
                    if room is not None:
                        left[s] = room - size
                    if need[s] > 0:
                        heapq.heappush(heap, (-need[s], s))
                    break
                skipped.append((behind, s))
            for item in skipped:
                heapq.heappush(heap, item)
        return placed if not heap else None

    best = greedy(high)
    blocks = high
    if best is None:
        found = greedy(low)
        assert found is not None, "the greedy reaches its bound"
        best, blocks = found, low
        lo, hi = low, high - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            dealt = greedy(mid)
            if dealt is not None:
                best, blocks, lo = dealt, mid, mid
            else:
                hi = mid - 1
    placements = tuple(None if s is None else where[s] for s in best)
    return Dealing(placements, blocks, (low, high))


def blocks_from(shape: CacheShape, handle_granules: Sequence[int]) -> int:
    """The blocks a borrower of `shape` with no slack (committed ends at granule boundaries)
    gains from handles of `handle_granules` granules: what a donor weighs a cut by
    (`lend_sizes`)."""
    return deal(shape, 0, handle_granules).blocks
