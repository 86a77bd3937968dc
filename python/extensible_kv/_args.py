"""Checks of public arguments at the door: each bad one is a `TypeError` (wrong type) or a
`ValueError` (out of range) whose message names it, raised before anything changes.

A size is any integer `operator.index` takes (int, numpy and torch integer scalars), never a
bool or a float. A flag is a bool (numpy's too). A dtype is a `torch.dtype`: numpy dtypes and
strings are refused by name, with the torch dtype to pass instead, since torch itself takes no
aliases either (`tensor.view("float32")` fails). A duration is a finite number of seconds
within a bound (`duration`); `seconds` also takes None (no limit) where a wait may be endless.
A policy's settings may come from an environment variable (`env_settings`).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

_Settings = TypeVar("_Settings")
_OFF = ("", "0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


def _type_name(value: object) -> str:
    return type(value).__name__


def size(value: object, name: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    """`value` as an int of at least `minimum` (and at most `maximum`, if given)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, not {_type_name(value)}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:  # numpy bools and arrays of more than one item refuse it
        raise TypeError(f"{name} must be an int, not {_type_name(value)}") from None
    if number < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {number}")
    return number


# The lowest int `integer` takes: the core's integers are 64-bit, and one below this is a
# `ValueError` here rather than an `OverflowError` from the conversion.
MIN_INTEGER = -(2**63)


def integer(value: object, name: str) -> int:
    """`value` as a plain int, whatever its value (from `MIN_INTEGER` up): for an argument
    whose range the callee checks itself (the core names what is wrong with it)."""
    return size(value, name, minimum=MIN_INTEGER)


def optional_size(
    value: object, name: str, *, minimum: int = 0, maximum: int | None = None
) -> int | None:
    return None if value is None else size(value, name, minimum=minimum, maximum=maximum)


def sizes(values: object, name: str, *, minimum: int | None = 0) -> tuple[int, ...]:
    """A sequence of ints, each at least `minimum` (any int, as `integer`, where that is
    None)."""
    if isinstance(values, str | bytes) or not hasattr(type(values), "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, not {_type_name(values)}")
    low = MIN_INTEGER if minimum is None else minimum
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


# The longest wait or bound a caller may give in seconds (`duration`): about 11.6 days. Far
# past anything a pool or a loan waits for, and small enough that a deadline computed from it
# stays a finite time every reader accepts (the pool's ledger refuses times of 1e12 s or more).
MAX_SECONDS = 1e6


def duration(
    value: object, name: str, *, zero: bool = False, maximum: float = MAX_SECONDS
) -> float:
    """`value` as a finite number of seconds, more than 0 (at least 0 where `zero`) and at
    most `maximum`: a bound that ends. None, NaN and infinities are refused: a wait "for ever"
    is never what a bound means, and NaN compares false with every deadline."""
    is_real = isinstance(value, int | float) or hasattr(type(value), "__float__")
    if isinstance(value, bool) or not is_real:
        raise TypeError(f"{name} must be a number of seconds, not {_type_name(value)}")
    number = float(value)  # type: ignore[arg-type]
    low_ok = number >= 0 if zero else number > 0
    if not (low_ok and number <= maximum):  # NaN fails both
        low = ">= 0" if zero else "> 0"
        raise ValueError(
            f"{name} must be a finite number of seconds {low} and <= {maximum:g}, got {value}"
        )
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


def env_settings(cls: type[_Settings], text: str, variable: str) -> _Settings | None:
    """The settings dataclass `cls` from environment variable `variable`'s value `text`:
    empty, `0`, `false`, `off` or `no`: None (off); `1`, `true`, `on` or `yes`: the
    defaults; else `key=value` pairs of `cls`'s fields separated by commas (integers, or
    seconds for a `float` field). A `ValueError` naming the variable otherwise, the field's
    own checks (`cls`'s) included."""
    value = text.strip()
    if value.lower() in _OFF:
        return None
    if value.lower() in _ON:
        return cls()
    kinds = {field.name: field.type for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    fields: dict[str, Any] = {}
    for item in value.split(","):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in kinds:
            raise ValueError(
                f"{variable}={text!r}: expected 1, or key=value pairs of {', '.join(kinds)} "
                f"separated by commas, not {item!r}"
            )
        try:
            fields[key] = float(raw) if kinds[key] == "float" else int(raw)
        except ValueError:
            raise ValueError(f"{variable}={text!r}: {key} is not a number") from None
    try:
        return cls(**fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{variable}={text!r}: {error}") from None
