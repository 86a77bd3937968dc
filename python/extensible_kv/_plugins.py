"""What the stack plugins (`extensible_kv.vllm`, `extensible_kv.sglang`) share: reading their
switches and comparing the stack's version. Imports nothing beyond the standard library, so a
plugin entry point stays cheap to load in every process the stack starts."""

from __future__ import annotations

import os
import re

__all__ = ["env_flag", "version_tuple"]

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
