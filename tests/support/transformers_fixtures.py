"""The fixtures of every test module that runs transformers' continuous batching, written once.
A module takes them by importing them (pytest finds a fixture in the module's namespace):

    from support.transformers_fixtures import disabled_after, tf  # noqa: F401

- `tf`: transformers, supported by extensible_kv.transformers (>=5.18,<5.26); a skip, with
  the reason, otherwise (a failure where CI set EKV_REQUIRE_TRANSFORMERS);
- `disabled_after` (autouse): `extensible_kv.transformers.disable()` after each test, so no
  test leaves transformers patched for the next;
- `padded`: transformers' padded warm-up on the CPU too (its CUDA-graph path without the
  graphs), for both caches.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest

from support import stack_env


@pytest.fixture(scope="module")
def tf() -> Any:
    """transformers, supported by extensible_kv.transformers; a skip (a failure where
    EKV_REQUIRE_TRANSFORMERS is set) otherwise."""
    stack_env.require_transformers()
    import transformers

    return transformers


@pytest.fixture(autouse=True)
def disabled_after() -> Iterator[None]:
    yield
    from extensible_kv import transformers as ekt

    ekt.disable()


@pytest.fixture(params=[False, True], ids=["plain", "padded"])
def padded(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tf: Any) -> bool:
    """`padded`: transformers' padded warm-up runs on CPU too (its CUDA-graph path without the
    graphs), for both caches."""
    if request.param:
        module = importlib.import_module("transformers.generation.continuous_batching.model_runner")
        init = module.ModelRunner.__init__

        def padded_init(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.pad_inputs = True

        monkeypatch.setattr(module.ModelRunner, "__init__", padded_init)
    return bool(request.param)
