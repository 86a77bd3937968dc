"""The pool's engine hooks, declared once (as pluggy declares a hook specification): what a
`PoolMember` asks of the engine beside its cache's own operations (`PoolCache`), each hook by
name, with its signature, what it answers and when it is needed.

- `free_tail_blocks() -> int`: the top committed blocks no request uses now. Needed.
- `on_resize(committed_blocks: int) -> None`: told the cache's size after each change.
- `free_bytes() -> int`: the device's free memory (default: measured, `device_free_bytes`).
- `free_blocks() -> int`: the committed blocks no request holds, wherever they lie. Needed,
  with `move_below`, for `move=True`.
- `move_below(num_blocks: int) -> None`: moves every live block at or past `num_blocks` into
  a free one below it (a `RuntimeError`, nothing moved, when too few are free there).

The three counts of free blocks have one name each, here and everywhere in the pool:
`free_tail_blocks` (free at the top, as they lie), `free_blocks` (free anywhere), and what
the member derives from them, its `spare_blocks`: what could go at once (its free tail, or,
moving live blocks down, as many as are free anywhere), which it posts to the ledger.

`recognise` is the one recogniser: each hook is the callable handed to `PoolMember` under its
name (`free_tail_blocks=`, `on_resize=`, `free_bytes=`), else the cache's method of that name
(transformers' pooled cache has all five: `MovingCache`), else its default. Nothing else in the
pool looks a hook up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from extensible_kv import _args

__all__ = ["HOOKS", "HookSpec", "PoolHooks", "recognise"]


@dataclass(frozen=True)
class HookSpec:
    """One hook: its name, signature and meaning, and when it is needed (`"always"`, `"move"`:
    with `move=True`, or `""`: never, a default standing in)."""

    name: str
    signature: str
    answers: str
    needed: str = ""


HOOKS = (
    HookSpec(
        "free_tail_blocks", "() -> int", "the top committed blocks no request uses now", "always"
    ),
    HookSpec("on_resize", "(committed_blocks: int) -> None", "the cache's size after each change"),
    HookSpec("free_bytes", "() -> int", "the device's free memory"),
    HookSpec("free_blocks", "() -> int", "the committed blocks no request holds", "move"),
    HookSpec(
        "move_below", "(num_blocks: int) -> None", "live blocks past a cut moved down", "move"
    ),
)


@dataclass
class PoolHooks:
    """An engine's hooks, as `recognise` found them (the table in the module's docstring)."""

    free_tail_blocks: Callable[[], int]
    free_bytes: Callable[[], int]
    on_resize: Callable[[int], None] | None = None
    free_blocks: Callable[[], int] | None = None
    move_below: Callable[[int], None] | None = None

    @property
    def moves(self) -> bool:
        """Whether the cache moves live blocks down (`free_blocks` and `move_below` both)."""
        return self.free_blocks is not None and self.move_below is not None

    def tail(self, committed_blocks: int) -> int:
        """`free_tail_blocks()`, checked (an int of at least 0) and at most `committed_blocks`."""
        free = _args.size(self.free_tail_blocks(), "free_tail_blocks()")
        return min(free, committed_blocks)

    def anywhere(self, committed_blocks: int) -> int | None:
        """`free_blocks()`, checked, at most `committed_blocks`; None where it does not move."""
        if self.free_blocks is None:
            return None
        return min(_args.size(self.free_blocks(), "free_blocks()"), committed_blocks)


def recognise(
    cache: object, default_free_bytes: Callable[[], int], **given: Callable[..., Any] | None
) -> PoolHooks:
    """`cache`'s engine hooks: each the callable `given` under its name, else the cache's
    method of that name, else the default (`default_free_bytes` for `free_bytes`, none for the
    others). A `TypeError` for a hook given that is not callable, for a name no hook has, and
    where `free_tail_blocks` is found nowhere."""
    names = {spec.name for spec in HOOKS}
    unknown = sorted(set(given) - names)
    if unknown:
        raise TypeError(f"{unknown[0]!r} is not a pool hook (the hooks: {', '.join(names)})")
    found: dict[str, Any] = {}
    for spec in HOOKS:
        hook = given.get(spec.name)
        if hook is None:
            hook = getattr(cache, spec.name, None)
            hook = hook if callable(hook) else None
        elif not callable(hook):
            raise TypeError(f"{spec.name} must be callable, not {type(hook).__name__}")
        if hook is None and spec.needed == "always":
            raise TypeError(
                f"{spec.name} must be callable, not None: pass {spec.name}= ({spec.signature}: "
                f"{spec.answers}), or give the cache a {spec.name}() method"
            )
        found[spec.name] = hook
    found["free_bytes"] = found["free_bytes"] or default_free_bytes
    return PoolHooks(**found)
