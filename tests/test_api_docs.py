"""What `help()` shows: every public class the package exports says what each of its public
methods and properties does, and `ExtensibleTensor`'s constructor names its arguments (no bare
`**kwargs`), as the `.pyi` does."""

from __future__ import annotations

import inspect

import extensible_kv
import pytest


def _public_classes() -> list[type]:
    classes = []
    for name in extensible_kv.__all__:
        obj = getattr(extensible_kv, name)
        if inspect.isclass(obj) and obj.__module__.startswith("extensible_kv"):
            if not issubclass(obj, BaseException):
                classes.append(obj)
    return classes


@pytest.mark.parametrize("cls", _public_classes(), ids=lambda c: c.__name__)
def test_every_public_member_says_what_it_does(cls: type) -> None:
    undocumented = []
    for name, member in inspect.getmembers(cls):
        if name.startswith("_"):
            continue
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is None or not owner.__module__.startswith("extensible_kv"):
            continue  # inherited from object, a dataclass or an enum
        raw = vars(owner)[name]
        if not (callable(raw) or isinstance(raw, (property, classmethod, staticmethod))):
            if type(raw).__name__ not in ("getset_descriptor", "member_descriptor"):
                continue  # plain class attributes (constants, enum members)
        if not (getattr(member, "__doc__", None) or getattr(raw, "__doc__", None) or "").strip():
            undocumented.append(name)
    assert not undocumented, f"{cls.__name__}: no docstring on {undocumented}"


def test_the_constructor_names_its_arguments() -> None:
    signature = inspect.signature(extensible_kv.ExtensibleTensor.__new__)
    names = list(signature.parameters)
    assert names[:4] == ["cls", "max_bytes", "num_segments", "device"]
    for keyword in ("segment_capacities", "granularity", "handle_sizing", "export_handle_types"):
        assert signature.parameters[keyword].kind is inspect.Parameter.KEYWORD_ONLY
    assert "kwargs" not in names
    assert (extensible_kv.ExtensibleTensor.__new__.__doc__ or "").strip()


def test_an_unknown_keyword_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="'max_handle_bytes'"):
        extensible_kv.ExtensibleTensor(1 << 20, device="cpu", max_handle_bytes=1 << 20)  # type: ignore[call-arg]
