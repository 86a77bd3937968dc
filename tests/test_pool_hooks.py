"""The pool's engine hooks are declared once (`extensible_kv.pool.hooks`, issue 54 item 4):
one table of what a member asks of its engine, and one recogniser that finds each hook as a
keyword handed to `PoolMember`, else a method of the cache, else its default."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from extensible_kv.pool import Pool, PoolMember, hooks
from support.pool_members import Moving, cache


def _device_free() -> int:
    return 123


def test_the_table_and_the_recognised_hooks_name_the_same_hooks() -> None:
    declared = {spec.name for spec in hooks.HOOKS}
    assert declared == {f.name for f in dataclasses.fields(hooks.PoolHooks)}
    assert {spec.name for spec in hooks.HOOKS if spec.needed == "always"} == {"free_tail_blocks"}
    assert {spec.name for spec in hooks.HOOKS if spec.needed == "move"} == {
        "free_blocks",
        "move_below",
    }


def test_a_hook_given_wins_then_the_caches_method_then_the_default() -> None:
    class Cache:
        def free_tail_blocks(self) -> int:
            return 1

        def free_blocks(self) -> int:
            return 2

        def move_below(self, num_blocks: int) -> None: ...

        free_bytes = 7  # not callable: not a hook

    found = hooks.recognise(Cache(), _device_free)
    assert found.free_tail_blocks() == 1 and found.moves and found.anywhere(10) == 2
    assert found.free_bytes is _device_free and found.on_resize is None
    given = hooks.recognise(Cache(), _device_free, free_tail_blocks=lambda: 5, on_resize=print)
    assert given.free_tail_blocks() == 5 and given.on_resize is print
    assert given.tail(3) == 3, "at most the committed blocks"
    plain = hooks.recognise(object(), _device_free, free_tail_blocks=lambda: 0)
    assert not plain.moves and plain.anywhere(10) is None


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({}, "free_tail_blocks must be callable, not None: pass free_tail_blocks="),
        ({"free_tail_blocks": 3}, "free_tail_blocks must be callable, not int"),
        ({"free_tail_blocks": len, "free_bytes": "x"}, "free_bytes must be callable, not str"),
        ({"free_tail_blocks": len, "free_top_blocks": len}, "'free_top_blocks' is not a pool hook"),
    ],
)
def test_a_hook_missing_or_not_callable_is_a_type_error(
    given: dict[str, Any], message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        hooks.recognise(object(), _device_free, **given)


def test_a_count_the_engine_gives_is_checked() -> None:
    found = hooks.recognise(object(), _device_free, free_tail_blocks=lambda: -1)
    with pytest.raises(ValueError, match=r"free_tail_blocks\(\) must be at least 0"):
        found.tail(8)


def test_a_member_finds_its_hooks_on_its_cache(tmp_path: Path) -> None:
    """A moving cache's methods are its hooks: no keyword needed, `move=True` allowed; a plain
    cache without `free_tail_blocks` is refused, naming the hook."""
    pool = Pool("hooks", directory=tmp_path)
    with cache() as plain:
        moving = Moving(plain)
        moving.free_tail_blocks = moving.free_tail  # type: ignore[attr-defined]
        member = PoolMember(pool, "m", moving, move=True)  # type: ignore[arg-type]
        assert member.hooks.moves and member.hooks.free_tail_blocks() == 0
        with pytest.raises(TypeError, match="give the cache a free_tail_blocks"):
            PoolMember(pool, "n", plain)
