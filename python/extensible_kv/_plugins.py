"""The one seam every stack integration (`extensible_kv.vllm`, `.sglang`, `.transformers`) is
built on: reading its switches, a declarative description of what the stack must provide
(`Stack`, `Provides`: paths, parameters, methods, versions) with the one recogniser that checks
it (`Stack.recognise`), patching attributes with the originals kept and every copy a
`from ... import` made found the same way (`Patches`, `bindings`), and its log lines.

Each integration keeps its own wording of what it supports and how it refuses (a warning from a
plugin a stack loads on its own, `UnsupportedError` from a seam the user enables), built from
the recogniser's findings. Imports nothing beyond the standard library, so a plugin entry point
stays cheap to load in every process the stack starts.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import pkgutil
import re
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "ABSENT",
    "Integration",
    "Patches",
    "Provides",
    "Recognised",
    "Stack",
    "bindings",
    "env_flag",
    "init_params",
    "missing_public",
    "version_in",
    "version_tuple",
]

ABSENT = object()  # where a target had no attribute of its own: `Patches.adopt` takes it too

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


# ---------------------------------------------------------------------------------------------
# what a stack must provide, and the one recogniser


@dataclass(frozen=True)
class Provides:
    """One object a stack must provide for an integration: at `path` (`"package.module.Name"`),
    a class or a function (`kind`), with these parameters (`params`: after `self` for a class's
    constructor; each a name, or `(name, default)` where the default must match too; `None`:
    not checked), all keyword-only where `keyword_only`, with these `methods` (attributes of
    the class), and, where `replaced_by` (`"package.module:Name"`) names our replacement,
    every public attribute of theirs on ours too: code written against theirs would fail on
    ours where it used one."""

    path: str
    kind: Literal["class", "function"] = "class"
    params: tuple[str | tuple[str, Any], ...] | None = None
    keyword_only: bool = False
    methods: tuple[str, ...] = ()
    replaced_by: str | None = None

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[1]

    def problems(self, obj: Any, tested: str) -> list[str]:
        """What of this `obj` (found at `path`) differs from the description, in words that
        name `tested`, the stack's version the description was written from."""
        name = self.name
        if self.kind == "class" and not inspect.isclass(obj):
            return [f"{self.path.rsplit('.', 1)[0]} has no {name} class"]
        if self.kind == "function" and not callable(obj):
            return [f"{self.path.rsplit('.', 1)[0]} has no {name} function"]
        if self.params is not None and not self._signature_matches(obj):
            signature = inspect.signature(obj.__init__ if self.kind == "class" else obj)
            return [f"{name}{signature} is not {tested}'s signature"]
        problems = []
        missing = [method for method in self.methods if not hasattr(obj, method)]
        if missing:
            problems.append(f"its {name} lacks {missing}")
        if self.replaced_by is not None:
            ours = pkgutil.resolve_name(self.replaced_by)
            extra = missing_public(obj, ours)
            if extra:
                problems.append(f"its {name} has {extra}, which extensible-kv's {name} lacks")
        return problems

    def _signature_matches(self, obj: Any) -> bool:
        assert self.params is not None
        if self.kind == "class":
            found = init_params(obj)
        else:
            found = list(inspect.signature(obj).parameters.values())
        if len(found) != len(self.params):
            return False
        for parameter, wanted in zip(found, self.params, strict=True):
            name, *default = wanted if isinstance(wanted, tuple) else (wanted,)
            if parameter.name != name or (default and parameter.default != default[0]):
                return False
            if self.keyword_only and parameter.kind is not parameter.KEYWORD_ONLY:
                return False
        return True


@dataclass(frozen=True)
class Recognised:
    """What `Stack.recognise` found: the stack's `version`, whether it is in the supported
    range (`supported`), each described object that resolved (`found`, by path) and what does
    not match the description, in words (`problems`; nothing is looked at out of range)."""

    version: str
    supported: bool
    found: dict[str, Any] = field(default_factory=dict)
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether the stack is one the integration supports: in range, nothing differs."""
        return self.supported and not self.problems

    def __getitem__(self, path: str) -> Any:
        return self.found[path]


@dataclass(frozen=True)
class Stack:
    """What an integration needs of its stack, declared once: its name as users write it, the
    package whose `__version__` is its version, the range it supports (`min_version` and
    `max_version`, inclusive in as many parts as they name; `None`: unbounded), the version
    the description was written from (`tested`), and every object it must provide."""

    name: str
    package: str
    provides: tuple[Provides, ...] = ()
    min_version: tuple[int, ...] | None = None
    max_version: tuple[int, ...] | None = None
    tested: str = ""

    def loaded(self) -> bool:
        """Whether the stack is imported in this process (an integration the stack loads
        itself imports nothing when it is not: the stack is the caller)."""
        return self.package in sys.modules

    def version(self) -> str:
        """The loaded stack's `__version__`, or `"unknown"`."""
        return str(getattr(sys.modules.get(self.package), "__version__", "unknown"))

    def supports(self, version: str) -> bool:
        """Whether `version` is in the supported range."""
        if self.min_version is None:
            return self.max_version is None or version_in(version, (0,), self.max_version)
        return version_in(version, self.min_version, self.max_version)

    def recognise(
        self, version: str | None = None, resolve: Callable[[str], Any] | None = None
    ) -> Recognised:
        """The one check of a stack: its version against the range, then every object it must
        provide, imported (`resolve(path)`, by default from its module) and compared with its
        description. All or nothing for the caller: an integration changes nothing unless
        `ok`."""
        version = self.version() if version is None else version
        if not self.supports(version):
            return Recognised(version, supported=False)
        found: dict[str, Any] = {}
        problems: list[str] = []
        for provided in self.provides:
            try:
                obj = (resolve or _resolve)(provided.path)
            except ImportError as error:
                module = provided.path.rsplit(".", 1)[0]
                problems.append(f"{module} does not import ({error})")
                continue
            found[provided.path] = obj
            problems += provided.problems(obj, self.tested or version)
        return Recognised(version, True, found, tuple(problems))


def _resolve(path: str) -> Any:
    """The object at `"package.module.Name"`; `ABSENT` where the module has no such name."""
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name, ABSENT)


def bindings(
    value: Any,
    *,
    packages: tuple[str, ...] | None = None,
    name: str | None = None,
    skip: tuple[Any, ...] = (),
) -> list[tuple[types.ModuleType, str]]:
    """The `(module, attribute)` pairs of the loaded modules that hold `value` itself: where a
    `from ... import` copied it. Only modules of `packages` (top-level names or dotted
    prefixes) and attribute `name` where given; never a module in `skip`. Reads only."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or module in skip:
            continue
        if packages is not None and not any(
            module_name == p or module_name.startswith(p + ".") for p in packages
        ):
            continue
        attrs = vars(module)
        names = (name,) if name is not None else list(attrs)
        found += [(module, attr) for attr in names if attrs.get(attr, ABSENT) is value]
    return found


# ---------------------------------------------------------------------------------------------
# replacements, recorded and undone exactly


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

    def set_bindings(
        self,
        original: Any,
        value: Any,
        *,
        packages: tuple[str, ...],
        name: str | None = None,
        skip: tuple[Any, ...] = (),
    ) -> None:
        """`set(module, attr, value)` wherever a module of `packages` binds `original` itself
        (`bindings`: the copies `from ... import` made); names bound elsewhere (a user's) stay."""
        for module, attr in bindings(original, packages=packages, name=name, skip=skip):
            self.set(module, attr, value)

    def adopt_bindings(
        self,
        original: Any,
        value: Any,
        *,
        packages: tuple[str, ...] | None = None,
        name: str | None = None,
        skip: tuple[Any, ...] = (),
    ) -> None:
        """`adopt(module, attr, original, value)` wherever a module (of `packages`, where
        given) binds `value` itself: copies someone else (SGLang's hook registry) rebound to
        `value` for us, or that modules imported after it was put in place. A binding some
        record holds already (a layer of this or another `Patches`) is that record's: not
        adopted (restoring it here would undo another record's replacement)."""
        for module, attr in bindings(value, packages=packages, name=name, skip=skip):
            if _stacks.get((module, attr)):
                continue
            self.adopt(module, attr, original, value)

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
