"""`extensible_kv._plugins`: the record of every replacement an integration makes (`Patches`),
its switches, the description of a stack and its recogniser (`Stack`), and what every plugin a
stack loads itself must do, one parametrised test per rule. Pure Python: no stack, no torch."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import types
from importlib.metadata import entry_points
from typing import Any

import pytest
from extensible_kv import _plugins
from extensible_kv._plugins import Patches, Provides, Stack, bindings, env_flag, version_in

# Each plugin a stack loads itself: its entry point group, and the modules that loading it
# without the stack must not import (the stack's, and SGLang's torch: its processes import
# torch later, on their own terms).
PLUGINS = {
    "vllm": ("vllm.general_plugins", ("vllm",)),
    "sglang": ("sglang.srt.plugins", ("sglang", "torch")),
}


def _stacked(target: object) -> bool:
    """Whether any record of any `Patches` is left on `target` (other integrations' records,
    on their stacks' modules, may be live in this process)."""
    return any(key[0] is target for key in _plugins._stacks)


def _module() -> types.ModuleType:
    module = types.ModuleType("stack_module")
    module.thing = "stack's"  # type: ignore[attr-defined]
    return module


def test_restore_puts_the_original_back_and_deletes_what_was_absent() -> None:
    module, patches = _module(), Patches()
    patches.set(module, "thing", "ours")
    patches.set(module, "extra", "ours too")
    assert (module.thing, module.extra) == ("ours", "ours too")  # type: ignore[attr-defined]
    assert sorted(patches.restore()) == [(module, "extra"), (module, "thing")]
    assert module.thing == "stack's"  # type: ignore[attr-defined]
    assert not hasattr(module, "extra")
    assert not patches and not _stacked(module)


def test_setting_again_keeps_the_first_original() -> None:
    module, patches = _module(), Patches()
    patches.set(module, "thing", "ours")
    patches.set(module, "thing", "ours, second")
    assert dict(patches.items()) == {(module, "thing"): "stack's"}
    assert patches.replacements() == ["ours, second"]
    patches.restore()
    assert module.thing == "stack's"  # type: ignore[attr-defined]


def test_a_replacement_made_over_ours_by_someone_else_is_theirs() -> None:
    module, patches = _module(), Patches()
    patches.set(module, "thing", "ours")
    module.thing = "theirs"  # type: ignore[attr-defined]
    assert patches.restore() == []
    assert module.thing == "theirs"  # type: ignore[attr-defined]
    assert not patches


@pytest.mark.parametrize("order", ["lower-first", "upper-first"])
def test_two_stacked_records_restore_to_the_stacks_object_in_any_order(order: str) -> None:
    """The lower layer's object must never come back once its record is restored: the upper
    record inherits the lower one's original."""
    module, lower, upper = _module(), Patches(), Patches()
    lower.set(module, "thing", "lower")
    upper.set(module, "thing", "upper")
    first, second = (lower, upper) if order == "lower-first" else (upper, lower)
    first.restore()
    assert module.thing == ("upper" if first is lower else "lower")  # type: ignore[attr-defined]
    second.restore()
    assert module.thing == "stack's"  # type: ignore[attr-defined]
    assert not _stacked(module)


def test_a_middle_layer_is_removed_exactly() -> None:
    module = _module()
    layers = [Patches() for _ in range(3)]
    for i, patches in enumerate(layers):
        patches.set(module, "thing", f"layer {i}")
    assert layers[1].restore() == []  # nothing set: layer 2 stays on top
    assert module.thing == "layer 2"  # type: ignore[attr-defined]
    assert dict(layers[2].items()) == {(module, "thing"): "layer 0"}
    assert layers[2].restore() == [(module, "thing")]
    assert module.thing == "layer 0"  # type: ignore[attr-defined]
    layers[0].restore()
    assert module.thing == "stack's"  # type: ignore[attr-defined]


def test_setting_again_from_under_another_layer_goes_on_top() -> None:
    module, lower, upper = _module(), Patches(), Patches()
    lower.set(module, "thing", "lower")
    upper.set(module, "thing", "upper")
    lower.set(module, "thing", "lower again")
    lower.restore()
    assert module.thing == "upper"  # type: ignore[attr-defined]
    upper.restore()
    assert module.thing == "stack's"  # type: ignore[attr-defined]


def test_adopt_records_a_replacement_made_for_us() -> None:
    module, patches = _module(), Patches()
    module.thing = "ours, set by a registry"  # type: ignore[attr-defined]
    patches.adopt(module, "thing", "stack's", "ours, set by a registry")
    assert patches.restore() == [(module, "thing")]
    assert module.thing == "stack's"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="does not hold"):
        patches.adopt(module, "thing", "stack's", "something else")
    assert not patches


def test_forget_drops_the_records_and_touches_nothing() -> None:
    module, lower, upper = _module(), Patches(), Patches()
    lower.set(module, "thing", "lower")
    upper.set(module, "thing", "upper")
    upper.forget()
    assert module.thing == "upper" and not upper  # type: ignore[attr-defined]
    assert lower.restore() == []  # no longer on top of a stack: someone else's is in place
    assert module.thing == "upper" and not _stacked(module)  # type: ignore[attr-defined]


def test_class_attributes_come_back_as_they_were_stored() -> None:
    class Stack:
        @classmethod
        def make(cls) -> str:
            return "stack's"

    raw = vars(Stack)["make"]
    patches = Patches()
    patches.set(Stack, "make", classmethod(lambda cls: "ours"))
    assert Stack.make() == "ours"
    patches.restore()
    assert vars(Stack)["make"] is raw and Stack.make() == "stack's"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        *[("0", False), ("false", False), ("Off", False), ("no", False), ("", True)],
        *[("maybe", True), ("1", True), ("TRUE", True), ("on", True), ("yes", True)],
    ],
)
def test_env_flag(value: str, expected: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLUGIN_SWITCH_UNDER_TEST", value)
    assert env_flag("PLUGIN_SWITCH_UNDER_TEST", True) is expected


def test_version_in() -> None:
    assert version_in("0.5.23.post1", (0, 5, 16))
    assert not version_in("0.5.15", (0, 5, 16))
    assert version_in("5.24.3", (5, 18), (5, 24)) and not version_in("5.25.0", (5, 18), (5, 24))
    assert not version_in("unknown", (0,))


# ---- every plugin a stack loads itself


@pytest.mark.parametrize("stack", PLUGINS)
def test_entry_point_is_declared(stack: str) -> None:
    group, _ = PLUGINS[stack]
    (ours,) = [e for e in entry_points(group=group) if e.name == "extensible_kv"]
    assert ours.value == f"extensible_kv.{stack}.plugin:register"
    plugin = __import__(f"extensible_kv.{stack}.plugin", fromlist=["register"])
    assert ours.load() is plugin.register


@pytest.mark.parametrize("stack", PLUGINS)
def test_without_the_stack_loaded_it_imports_nothing(stack: str) -> None:
    _, heavy = PLUGINS[stack]
    script = f"""
        import sys
        from extensible_kv.{stack} import plugin
        heavy = {heavy!r}
        print(plugin.register(), sorted(m for m in sys.modules if m.split(".")[0] in heavy))
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "[]"]


# ---- the description of a stack, and the recogniser


class _Theirs:
    def __init__(self, size: int, device: Any = None, *, flag: bool = False) -> None: ...
    def grow(self) -> None: ...
    def shrink(self) -> None: ...


class _Ours(_Theirs):
    pass


def _stack_module(monkeypatch: pytest.MonkeyPatch, version: str = "1.2.3") -> types.ModuleType:
    package = types.ModuleType("fake_stack")
    package.__version__ = version  # type: ignore[attr-defined]
    module = types.ModuleType("fake_stack.api")
    module.Theirs = _Theirs  # type: ignore[attr-defined]
    module.helper = lambda index: index  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_stack", package)
    monkeypatch.setitem(sys.modules, "fake_stack.api", module)
    return module


def _describe(**theirs: Any) -> Stack:
    return Stack(
        "Fake",
        "fake_stack",
        provides=(
            Provides("fake_stack.api.Theirs", **theirs),
            Provides("fake_stack.api.helper", "function", params=("index",)),
        ),
        min_version=(1, 2),
        max_version=(1, 2),
        tested="1.2",
    )


def test_a_stack_as_described_is_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _stack_module(monkeypatch)
    stack = _describe(
        params=(("size", inspect.Parameter.empty), ("device", None), "flag"),
        methods=("grow", "shrink"),
        replaced_by=f"{__name__}:_Ours",
    )
    assert stack.loaded() and stack.version() == "1.2.3"
    found = stack.recognise()
    assert found.ok and found.problems == ()
    assert found["fake_stack.api.Theirs"] is _Theirs and found["fake_stack.api.helper"] is (
        module.helper  # type: ignore[attr-defined]
    )


@pytest.mark.parametrize(
    ("theirs", "problem"),
    [
        ({"params": ("size", "device")}, "Theirs(self, size"),
        ({"params": ("size", "device", "flag"), "keyword_only": True}, "is not 1.2's signature"),
        ({"params": (("size", 0), "device", "flag")}, "is not 1.2's signature"),
        ({"methods": ("grow", "defragment")}, "its Theirs lacks ['defragment']"),
        ({"params": ("size", "device", "flag")}, None),
    ],
)
def test_what_differs_from_the_description_is_named(
    monkeypatch: pytest.MonkeyPatch, theirs: dict[str, Any], problem: str | None
) -> None:
    _stack_module(monkeypatch)
    found = _describe(**theirs).recognise()
    if problem is None:  # the names match, and keyword-only was not asked for
        assert found.ok
        return
    assert not found.ok and found.supported
    (words,) = found.problems
    assert problem in words


def test_a_replacement_must_cover_every_public_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _stack_module(monkeypatch)

    class Later(_Theirs):
        def defragment(self) -> None: ...

    module.Theirs = Later  # type: ignore[attr-defined]
    (words,) = _describe(replaced_by=f"{__name__}:_Ours").recognise().problems
    assert words == "its Theirs has ['defragment'], which extensible-kv's Theirs lacks"


def test_missing_objects_and_modules_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _stack_module(monkeypatch)
    del module.Theirs  # type: ignore[attr-defined]
    module.helper = 3  # type: ignore[attr-defined]
    assert _describe().recognise().problems == (
        "fake_stack.api has no Theirs class",
        "fake_stack.api has no helper function",
    )
    missing = Stack("Fake", "fake_stack", provides=(Provides("fake_stack.gone.Thing"),))
    (words,) = missing.recognise("1.2").problems
    assert words.startswith("fake_stack.gone does not import (")


@pytest.mark.parametrize("version", ["1.1.9", "1.3.0", "not-a-version"])
def test_outside_the_range_nothing_is_looked_at(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    _stack_module(monkeypatch, version)
    looked_at: list[str] = []
    found = _describe().recognise(resolve=looked_at.append)
    assert not found.supported and not found.ok and looked_at == [] and found.version == version
    assert _describe().supports("1.2.99") and not _describe().supports(version)


def test_bindings_are_the_copies_of_the_object_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `Patches.set_bindings` replaces: the stack's modules' copies of the very object,
    under the name asked, and nothing a module outside the packages bound."""
    module = _stack_module(monkeypatch)
    user = types.ModuleType("user_code")
    user.Theirs = _Theirs  # type: ignore[attr-defined]
    copy = types.ModuleType("fake_stack.copy")
    copy.Theirs = copy.Alias = _Theirs  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "user_code", user)
    monkeypatch.setitem(sys.modules, "fake_stack.copy", copy)
    held = bindings(_Theirs, packages=("fake_stack",), name="Theirs")
    assert sorted(m.__name__ for m, _ in held) == ["fake_stack.api", "fake_stack.copy"]
    patches = Patches()
    patches.set_bindings(_Theirs, _Ours, packages=("fake_stack",), skip=(module,))
    assert (copy.Theirs, copy.Alias, module.Theirs, user.Theirs) == (  # type: ignore[attr-defined]
        _Ours,
        _Ours,
        _Theirs,
        _Theirs,
    )
    later = types.ModuleType("fake_stack.later")
    later.Theirs = _Ours  # type: ignore[attr-defined]  # imported after: a copy of ours
    monkeypatch.setitem(sys.modules, "fake_stack.later", later)
    patches.adopt_bindings(_Theirs, _Ours, packages=("fake_stack",), name="Theirs")
    patches.restore()
    assert (copy.Theirs, copy.Alias, later.Theirs, user.Theirs) == (  # type: ignore[attr-defined]
        _Theirs,
        _Theirs,
        _Theirs,
        _Theirs,
    )


def test_adopting_bindings_leaves_those_another_record_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second record (the plugin's tests swap in a fresh one) adopts only copies of ours no
    record holds (modules imported after the replacement): restoring it must not put the
    original back where the first record's replacement still stands. Before, the fresh
    record adopted vLLM's coordinator's `BlockPool` from the real one, and its restore left
    vLLM's class there under our pool module's."""
    copy = types.ModuleType("fake_stack.held")
    copy.Theirs = _Theirs  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_stack.held", copy)
    first = Patches()
    first.set_bindings(_Theirs, _Ours, packages=("fake_stack",), name="Theirs")
    assert copy.Theirs is _Ours  # type: ignore[attr-defined]
    later = types.ModuleType("fake_stack.later2")
    later.Theirs = _Ours  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_stack.later2", later)
    second = Patches()
    second.adopt_bindings(_Theirs, _Ours, packages=("fake_stack",), name="Theirs")
    assert len(second) == 1  # the later copy only
    second.restore()
    assert copy.Theirs is _Ours and later.Theirs is _Theirs  # type: ignore[attr-defined]
    first.restore()
    assert copy.Theirs is _Theirs  # type: ignore[attr-defined]
