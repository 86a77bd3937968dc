"""Checks of public arguments at the door: each bad one is a `TypeError` (wrong type) or a
`ValueError` (out of range) whose message names it, raised before anything changes.

A size is any integer `operator.index` takes (int, numpy and torch integer scalars), never a
bool or a float. A flag is a bool (numpy's too). A dtype is a `torch.dtype`: numpy dtypes and
strings are refused by name, with the torch dtype to pass instead, since torch itself takes no
aliases either (`tensor.view("float32")` fails).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _type_name(value: object) -> str:
    return type(value).__name__


def size(value: object, name: str, *, minimum: int = 0) -> int:
    """`value` as an int of at least `minimum`."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, not {_type_name(value)}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:  # numpy bools and arrays of more than one item refuse it
        raise TypeError(f"{name} must be an int, not {_type_name(value)}") from None
    if number < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {number}")
    return number


def optional_size(value: object, name: str, *, minimum: int = 0) -> int | None:
    return None if value is None else size(value, name, minimum=minimum)


def sizes(values: object, name: str, *, minimum: int | None = 0) -> tuple[int, ...]:
    """A sequence of ints, each at least `minimum` (any int where that is None)."""
    if isinstance(values, str | bytes) or not hasattr(type(values), "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, not {_type_name(values)}")
    low = -(2**63) if minimum is None else minimum
    items: Iterable[object] = values  # type: ignore[assignment]
    return tuple(size(v, f"{name}[{i}]", minimum=low) for i, v in enumerate(items))


def seconds(value: object, name: str = "timeout", *, optional: bool = True) -> float | None:
    """`value` as a duration in seconds: a real number of at least 0, or None (no limit)
    where `optional`."""
    if value is None and optional:
        return None
    either = "None or " if optional else ""
    is_real = isinstance(value, int | float) or hasattr(type(value), "__float__")
    if isinstance(value, bool) or not is_real:
        raise TypeError(f"{name} must be {either}a number of seconds, not {_type_name(value)}")
    number = float(value)  # type: ignore[arg-type]
    if not number >= 0:  # NaN too
        raise ValueError(f"{name} must be {either}>= 0 seconds, got {value}")
    return number


def flag(value: object, name: str) -> bool:
    """`value` as a bool: a bool or a numpy bool (an int here is likely a misplaced argument)."""
    if isinstance(value, bool):
        return value
    if _type_name(value) == "bool" and hasattr(value, "__bool__"):  # numpy.bool
        return bool(value)
    raise TypeError(f"{name} must be a bool, not {_type_name(value)}")


def torch_dtype(value: object, name: str = "dtype") -> torch.dtype:
    """`value` if it is a `torch.dtype`; else a TypeError naming the torch dtype meant."""
    import torch

    if isinstance(value, torch.dtype):
        return value
    alias = _alias_name(value)
    meant = getattr(torch, alias, None) if alias else None
    hint = f": pass torch.{alias}" if isinstance(meant, torch.dtype) else ""
    shown = repr(value) if isinstance(value, str) else f"{_type_name(value)} {value!r}"
    raise TypeError(f"{name} must be a torch.dtype, not {shown}{hint}")


def _alias_name(value: object) -> str | None:
    """The name a string, numpy dtype or numpy scalar type gives a dtype, if any."""
    if value is None:
        return None
    if isinstance(value, str):
        return value.removeprefix("torch.")
    try:
        import numpy as np

        return str(np.dtype(value))  # type: ignore[call-overload]
    except (ImportError, TypeError):
        return None
