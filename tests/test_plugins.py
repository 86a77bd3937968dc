"""`extensible_kv._plugins`: the record of every replacement an integration makes (`Patches`),
its switches and version gates. Pure Python: no stack, no torch."""

from __future__ import annotations

import types

import pytest
from extensible_kv import _plugins
from extensible_kv._plugins import Patches, env_flag, version_in


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
