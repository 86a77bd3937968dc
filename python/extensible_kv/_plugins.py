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


_ABSENT = object()


class Patches:
    """Attributes an integration replaced on another package's modules and classes, each with
    the object it held there, so that `restore` puts back the very object.

    Invariants: an attribute is recorded once, with the object found before the first `set`
    (setting it again keeps that original); `restore` puts an original back only where our
    object is still in place (a later patch by someone else is theirs to undo), and forgets
    every record either way."""

    def __init__(self) -> None:
        # (target, name) -> (the original, or _ABSENT when `target` had no own attribute; ours)
        self._entries: dict[tuple[Any, str], tuple[Any, Any]] = {}

    def set(self, target: Any, name: str, value: Any) -> None:
        key = (target, name)
        original = (
            self._entries[key][0] if key in self._entries else vars(target).get(name, _ABSENT)
        )
        self._entries[key] = (original, value)
        setattr(target, name, value)

    def restore(self) -> None:
        for (target, name), (original, ours) in list(self._entries.items()):
            if vars(target).get(name, _ABSENT) is ours:
                if original is _ABSENT:
                    delattr(target, name)
                else:
                    setattr(target, name, original)
            del self._entries[(target, name)]

    def items(self) -> Iterator[tuple[tuple[Any, str], Any]]:
        """`((target, name), original)` for every attribute replaced."""
        for key, (original, _) in self._entries.items():
            yield key, original

    def replacements(self) -> list[Any]:
        """The objects put in place."""
        return [ours for _, ours in self._entries.values()]

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
