"""What every stack integration (`extensible_kv.vllm`, `.sglang`, `.transformers`) repeats, in
one place: reading its switches, gating on the stack's version, checking that a class it replaces
has the API it expects, patching attributes with the originals kept, and its log lines.

Each integration keeps its own wording of what it supports and how it refuses (a warning from a
plugin a stack loads on its own, `UnsupportedError` from a seam the user enables). Imports
nothing beyond the standard library, so a plugin entry point stays cheap to load in every
process the stack starts.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ABSENT",
    "Integration",
    "Patches",
    "env_flag",
    "init_params",
    "missing_public",
    "version_in",
    "version_tuple",
]

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def env_flag(name: str, default: bool) -> bool:
    """The boolean switch `name` (`1/true/yes/on`, `0/false/no/off`, any case); `default`
    when unset or anything else."""
    value = os.environ.get(name, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    return default


def version_tuple(version: str) -> tuple[int, ...] | None:
    """`"0.5.23"` -> `(0, 5, 23)`; local and pre-release tails (`"0.5.23.post1"`,
    `"0.5.24rc0+g12ab"`) are ignored; None when `version` does not start with a number."""
    match = re.match(r"(\d+(?:\.\d+)*)", version.strip())
    if match is None:
        return None
    return tuple(int(part) for part in match.group(1).split("."))


def version_in(
    version: str, min_version: tuple[int, ...], max_version: tuple[int, ...] | None = None
) -> bool:
    """Whether `version` is at least `min_version` and, when given, at most `max_version` in
    as many parts as it names (`(5, 24)` admits every 5.24.x); False when it does not parse."""
    parsed = version_tuple(version)
    if parsed is None or parsed < min_version:
        return False
    return max_version is None or parsed[: len(max_version)] <= max_version


def init_params(cls: Any) -> list[inspect.Parameter]:
    """The parameters of `cls`'s constructor after `self`."""
    return list(inspect.signature(cls.__init__).parameters.values())[1:]


def missing_public(theirs: type, ours: type) -> list[str]:
    """The public attributes of the stack's class `theirs` that our replacement `ours` lacks,
    sorted: code written against theirs would fail on ours where it used one."""
    public = (name for name in dir(theirs) if not name.startswith("_"))
    return sorted(name for name in public if not hasattr(ours, name))


ABSENT = object()  # where a target had no attribute of its own: `Patches.adopt` takes it too


class _Layer:
    """One replacement of an attribute: the object it held before (`original`, `ABSENT` when
    the target had no own attribute) and the one put there (`ours`)."""

    __slots__ = ("original", "ours")

    def __init__(self, original: Any, ours: Any) -> None:
        self.original = original
        self.ours = ours


# (target, name) -> the layers every `Patches` holds there, bottom first: each layer's
# `original` is the `ours` of the layer below it (the bottom's, the stack's own object).
_stacks: dict[tuple[Any, str], list[_Layer]] = {}


class Patches:
    """Attributes an integration replaced on another package's modules and classes, each with
    the object it held there, so that `restore` puts back the very object.

    Invariants: an attribute is recorded once, with the object found before the first `set`
    (setting it again keeps that original). Replacements of one attribute by several `Patches`
    (our integrations, or an integration and SGLang's registry acting for it) form a stack, and
    `restore` removes exactly this record's layer wherever it sits: on top, the original goes
    back where our object is still in place; in the middle, nothing is set and the layer above
    now records our original as its own, so that its restore puts back the stack's object, not
    ours. A replacement made outside any `Patches` over ours is someone else's to undo: ours is
    left under it (the attribute is not touched). `restore` forgets every record either way."""

    def __init__(self) -> None:
        self._entries: dict[tuple[Any, str], _Layer] = {}

    def set(self, target: Any, name: str, value: Any) -> None:
        """Put `value` at `target.name`, on top of whatever is there."""
        self._push(target, name, vars(target).get(name, ABSENT), value)
        setattr(target, name, value)

    def adopt(self, target: Any, name: str, original: Any, value: Any) -> None:
        """Record that `value`, which someone else put at `target.name` for us (SGLang's hook
        registry), replaced `original` there; `restore` undoes it as if `set` had."""
        if vars(target).get(name, ABSENT) is not value:
            raise ValueError(f"{name} on {target!r} does not hold the object to adopt")
        self._push(target, name, original, value)

    def _push(self, target: Any, name: str, original: Any, value: Any) -> None:
        key = (target, name)
        stack = _stacks.setdefault(key, [])
        layer = self._entries.get(key)
        if layer is not None:
            if stack and stack[-1] is layer:
                layer.ours = value  # setting again on top keeps the original
                return
            original = self._unlink(key, layer)  # set again over another layer: on top now
        layer = _Layer(original, value)
        self._entries[key] = layer
        stack.append(layer)

    def _unlink(self, key: tuple[Any, str], layer: _Layer) -> Any:
        """Take `layer` out of its stack without touching the attribute; the layer above (if
        any) inherits its original. The object in place afterwards."""
        stack = _stacks[key]
        index = stack.index(layer)
        del stack[index]
        if index < len(stack):
            stack[index].original = layer.original
        if not stack:
            del _stacks[key]
        return vars(key[0]).get(key[1], ABSENT)

    def restore(self) -> list[tuple[Any, str]]:
        """Remove every layer this records (see the class's invariants); the `(target, name)`
        pairs where an original went back."""
        put_back: list[tuple[Any, str]] = []
        for key, layer in list(self._entries.items()):
            target, name = key
            on_top = _stacks[key][-1] is layer
            self._unlink(key, layer)
            del self._entries[key]
            if not on_top or vars(target).get(name, ABSENT) is not layer.ours:
                continue
            if layer.original is ABSENT:
                delattr(target, name)
            else:
                setattr(target, name, layer.original)
            put_back.append(key)
        return put_back

    def forget(self) -> None:
        """Drop every record without touching any attribute (what is in place stays)."""
        for key, layer in list(self._entries.items()):
            self._unlink(key, layer)
            del self._entries[key]

    def items(self) -> Iterator[tuple[tuple[Any, str], Any]]:
        """`((target, name), original)` for every attribute replaced."""
        for key, layer in self._entries.items():
            yield key, layer.original

    def replacements(self) -> list[Any]:
        """The objects put in place."""
        return [layer.ours for layer in self._entries.values()]

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class Integration:
    """A plugin that a stack loads itself and that replaces one of its classes (`replaces`): its
    switch-off variable and the lines it logs on the stack's logger."""

    stack: str  # as users write it: "vLLM", "SGLang"
    replaces: str  # the stack's class the plugin replaces
    env_var: str  # `=0` switches the plugin off
    logger: logging.Logger

    def switched_off(self) -> bool:
        """Whether `env_var` switches the plugin off; says so in one INFO line when it does."""
        if env_flag(self.env_var, True):
            return False
        self.logger.info(
            "extensible-kv: %s=0, %s keeps its own %s.", self.env_var, self.stack, self.replaces
        )
        return True

    def log_enabled(self, version: str, feature: str, detail: str) -> None:
        """The one INFO line of a plugin that is in place."""
        self.logger.info(
            "extensible-kv: %s %s's %s runs on extensible-kv's Rust core (%s; %s=0 turns this "
            "off).",
            self.stack,
            version,
            feature,
            detail,
            self.env_var,
        )

    def warn_not_replacing(self, version: str, reason: str, supported: str | None = None) -> None:
        """The warning of a plugin that leaves this stack alone, and why (`supported`: what the
        plugin supports instead, in words)."""
        head = "extensible-kv: not replacing %s %s's %s: %s"
        args: tuple[Any, ...] = (self.stack, version, self.replaces, reason)
        if supported is not None:
            head += ". The plugin supports %s"
            args += (supported,)
        self.logger.warning(head + "; set %s=0 to silence this.", *args, self.env_var)
