"""`extensible_kv.shape`: cache shapes (checked, to and from JSON) and the dealing of a loan's
handles over a borrower's segments, property-tested: never more than a segment's room, every
segment's need met for the blocks claimed, the blocks within the stated bound of the most
any dealing reaches (exactly the most, by exhaustive search, on small cases), deterministic,
and nothing heavy imported (the pool's policy runs it from the ledger alone).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from extensible_kv.shape import BufferShape, CacheShape, Dealing, blocks_from, deal
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

G = 2 << 20  # a CUDA granule: block bytes from 656 B to many MiB against it
SMALL_G = 4096


def need(n: int, block_bytes: int, slack: int, g: int) -> int:
    """Granules a segment needs past its mapped end for `n` more blocks."""
    return 0 if n == 0 else -(-max(0, n * block_bytes - slack) // g)


def check(
    shape: CacheShape,
    dealing: Dealing,
    sizes: list[int],
    slack: list[int],
    rooms: list[int | None],
) -> None:
    """What every dealing promises: handles to real segments, within rooms, each segment's
    need for `dealing.blocks` met."""
    flat = [(i, j) for i, b in enumerate(shape.buffers) for j in range(b.num_segments)]
    block = [b.segment_block_bytes for b in shape.buffers for _ in range(b.num_segments)]
    taken = dict.fromkeys(flat, 0)
    assert len(dealing.placements) == len(sizes)
    for k, where in enumerate(dealing.placements):
        if where is not None:
            taken[where] += sizes[k]
    for s, where in enumerate(flat):
        assert rooms[s] is None or taken[where] <= rooms[s], "more than the segment's room"
        assert taken[where] >= need(dealing.blocks, block[s], slack[s], shape.granularity)
    low, high = dealing.bound
    assert low <= dealing.blocks <= high


@st.composite
def shapes(draw: st.DrawFn, g: int = G, max_segments: int = 160) -> CacheShape:
    num_buffers = draw(st.integers(1, 4))
    buffers = []
    left = max_segments
    for _ in range(num_buffers):
        segments = draw(st.integers(1, max(1, left // num_buffers)))
        block = draw(
            st.one_of(
                st.sampled_from([656, 6144, 16384, 65536, 10496, 1 << 20, 3 << 20, 48 << 20]),
                st.integers(656, 64 << 20),
            )
        )
        buffers.append(BufferShape(segments, block))
    return CacheShape("cuda:0", g, tuple(buffers))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=shapes(),
    sizes=st.lists(st.integers(1, 512), max_size=64),
    data=st.data(),
)
def test_a_dealing_meets_every_need_within_rooms_and_its_bound(
    shape: CacheShape, sizes: list[int], data: st.DataObject
) -> None:
    n = shape.num_segments
    slack = data.draw(st.lists(st.integers(-G + 1, 4 * G), min_size=n, max_size=n))
    limited = data.draw(st.booleans())
    rooms: list[int | None] = (
        data.draw(st.lists(st.integers(0, 256), min_size=n, max_size=n)) if limited else [None] * n
    )
    max_blocks = data.draw(st.one_of(st.none(), st.integers(0, 1 << 20)))
    nested_slack, nested_rooms, at = [], [], 0
    for b in shape.buffers:
        nested_slack.append(slack[at : at + b.num_segments])
        nested_rooms.append(rooms[at : at + b.num_segments])
        at += b.num_segments
    dealing = deal(
        shape,
        nested_slack,
        sizes,
        room_granules=nested_rooms if limited else None,  # type: ignore[arg-type]
        max_blocks=max_blocks,
    )
    check(shape, dealing, sizes, slack, rooms)
    assert max_blocks is None or dealing.blocks <= max_blocks
    # Deterministic: the same question, the same answer.
    again = deal(
        shape,
        nested_slack,
        sizes,
        room_granules=nested_rooms if limited else None,  # type: ignore[arg-type]
        max_blocks=max_blocks,
    )
    assert again == dealing
    if not limited and max_blocks is None:
        # The stated bound: at least what the counting argument guarantees.
        total, largest = sum(sizes), max(sizes, default=0)
        block = [b.segment_block_bytes for b in shape.buffers for _ in range(b.num_segments)]

        def guaranteed(k: int) -> bool:
            needs = [need(k, bb, s, G) for bb, s in zip(block, slack, strict=True)]
            return sum(needs) + sum(1 for x in needs if x) * (largest - 1) <= total

        assert guaranteed(dealing.bound[0])
        assert dealing.blocks >= dealing.bound[0]
        needs_past = [
            need(dealing.bound[1] + 1, bb, s, G) for bb, s in zip(block, slack, strict=True)
        ]
        assert sum(needs_past) > total, "a block more could fit: the high bound is not one"


def best_by_search(
    shape: CacheShape, sizes: list[int], slack: list[int], rooms: list[int | None]
) -> int:
    """The most blocks any assignment of the handles reaches (exhaustive: small cases)."""
    segs = shape.num_segments
    block = [b.segment_block_bytes for b in shape.buffers for _ in range(b.num_segments)]
    best = 0
    for assign in itertools.product(range(segs + 1), repeat=len(sizes)):
        taken = [0] * segs
        for k, s in enumerate(assign):
            if s < segs:
                taken[s] += sizes[k]
        if any(r is not None and t > r for t, r in zip(taken, rooms, strict=True)):
            continue
        n = best
        while all(
            need(n + 1, bb, sl, shape.granularity) <= t
            for bb, sl, t in zip(block, slack, taken, strict=True)
        ):
            n += 1
            if n > 10_000:
                break
        best = max(best, n)
    return best


@settings(max_examples=200, deadline=None)
@given(
    segments=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    blocks=st.lists(st.integers(1000, 20000), min_size=2, max_size=2),
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    data=st.data(),
)
def test_a_dealing_is_the_most_on_small_cases_or_within_its_bound(
    segments: list[int], blocks: list[int], sizes: list[int], data: st.DataObject
) -> None:
    shape = CacheShape(
        "cpu", SMALL_G, tuple(BufferShape(n, b) for n, b in zip(segments, blocks, strict=False))
    )
    n = shape.num_segments
    assume((n + 1) ** len(sizes) <= 4096)
    slack = data.draw(st.lists(st.integers(0, 2 * SMALL_G), min_size=n, max_size=n))
    nested, at = [], 0
    for b in shape.buffers:
        nested.append(slack[at : at + b.num_segments])
        at += b.num_segments
    dealing = deal(shape, nested, sizes)
    check(shape, dealing, sizes, slack, [None] * n)
    best = best_by_search(shape, sizes, slack, [None] * n)
    assert dealing.bound[0] <= dealing.blocks <= best <= dealing.bound[1]
    if len(segments) == 1 and segments[0] == 1:
        assert dealing.blocks == best, "one segment: every handle counts"


def test_the_issues_example_and_the_split_of_k_and_v() -> None:
    # Qwen2's flat cache (16,384 bytes a block) and Llama's (6,144): each borrows the other's
    # memory in its own blocks, nothing left over but what a block cannot hold.
    qwen = CacheShape("cpu", SMALL_G, (BufferShape(1, 16384),), leading_blocks=2)
    llama = CacheShape("cpu", SMALL_G, (BufferShape(1, 6144),), leading_blocks=2)
    assert blocks_from(llama, [4, 4, 4]) == 8  # 48 KiB in 6 KiB blocks
    assert blocks_from(qwen, [3, 3]) == 1  # 24 KiB in 16 KiB blocks: one, 8 KiB of slack
    assert blocks_from(qwen, [4, 4, 4]) == 3
    # A K/V split of 2 segments takes whole handles per segment, in lockstep.
    kv = CacheShape("cpu", SMALL_G, (BufferShape(2, 2048),))
    dealing = deal(kv, 0, [4, 4, 4])
    assert dealing.blocks == 8 and dealing.unused == (2,)  # the third cannot be shared evenly
    assert dealing.segment_handles(0, 0) == (0,) and dealing.segment_handles(0, 1) == (1,)
    # 32 layers a segment, one buffer; and many buffers.
    layers = CacheShape("cuda:0", G, (BufferShape(32, 64 << 10),))
    assert blocks_from(layers, [32] * 32) == 32 * G // (64 << 10)
    assert blocks_from(layers, [32] * 31) == 0, "one segment would get nothing"
    many = CacheShape("cuda:0", G, tuple(BufferShape(2, 32 << 10) for _ in range(8)))
    assert blocks_from(many, [1] * 16) == G // (32 << 10)
    # Slack counts: a segment that maps a block past its end already needs a granule less.
    assert deal(kv, [[2048, 2048]], [1, 1]).blocks == 3
    assert deal(kv, [[0, 2048]], [1, 1]).blocks == 2
    # No room, no block; a capacity caps it.
    assert deal(kv, 0, [4, 4], room_granules=[[4, 0]]).blocks == 0
    assert deal(kv, 0, [4, 4], max_blocks=3).blocks == 3


def test_shapes_are_checked_and_read_back() -> None:
    shape = CacheShape(
        "cuda:3", G, (BufferShape(2, 16384), BufferShape(1, 656 * 16)), leading_blocks=2
    )
    assert shape.block_bytes() == 2 * 16384 + 656 * 16
    assert shape.num_segments == 3
    raw = json.loads(json.dumps(shape.to_json()))
    assert CacheShape.from_json(raw) == shape
    bad: list[tuple[object, str]] = [
        ([], "JSON object"),
        ({**raw, "device": "tpu"}, "device"),
        ({**raw, "granularity": 3000}, "power of two"),
        ({**raw, "granularity": True}, "granularity must be an int"),
        ({**raw, "buffers": []}, "buffers"),
        ({**raw, "buffers": [[0, 16]]}, "buffers[0].num_segments"),
        ({**raw, "buffers": [[1, 16], [2, -1]]}, "buffers[1].segment_block_bytes"),
        ({**raw, "buffers": [[1, 1.5]]}, "segment_block_bytes must be an int"),
        ({**raw, "buffers": [[1]]}, "buffers[0] must be"),
        ({**raw, "leading_blocks": -1}, "leading_blocks"),
        ({**raw, "extra": 1}, "unknown fields extra"),
        ({k: v for k, v in raw.items() if k != "device"}, "lacks device"),
    ]
    for value, fragment in bad:
        with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            CacheShape.from_json(value)
    no_leading = {k: v for k, v in raw.items() if k != "leading_blocks"}
    assert CacheShape.from_json(no_leading).leading_blocks == 0
    with pytest.raises(ValueError, match="handle_granules\\[1\\]"):
        deal(shape, 0, [1, 0])
    with pytest.raises(ValueError, match="slack_bytes_per_segment"):
        deal(shape, [[0, 0]], [1])


def test_the_module_imports_nothing_heavy() -> None:
    """Standard library only, and importing it loads no torch: a pool's policy weighs loans
    from the ledger in any process."""
    import ast

    import extensible_kv.shape as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
    code = "import sys, extensible_kv.shape; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout
