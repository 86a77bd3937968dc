"""Where vLLM 0.34.0's code comes from in the tests and benchmarks.

`load()` makes `import vllm` work, or says why it cannot:

1. vLLM installed in this Python (CI, `scripts/setup`): imported as is.
2. Otherwise the copy `scripts/vendor-vllm` leaves in `.vendor/` (git-ignored; carried to the
   GPU machine, where vLLM cannot be installed: no network, and its wheel pins torch 2.14):
   - `vllm034-py.zip`: every `.py` file of the vLLM 0.34.0 wheel, extracted once per machine
     into a temp dir that goes first on `sys.path`;
   - `vllm034-wheels/*.whl`: the light packages vLLM's modules import (pydantic, msgspec,
     pyzmq, ...) for the device's Python, extracted beside it and put next on `sys.path`:
     none of them is torch's, numpy's or transformers', so they shadow nothing those use;
   - the few heavy packages that are imported but never called here (`STUBBED`: Pillow,
     uvloop, llguidance) become empty stub modules when absent;
   - vLLM's platform is pinned to `UnspecifiedPlatform` (what it resolves to on a CPU
     machine): resolving it on a GPU machine imports the CUDA platform's compiled modules
     (`vllm._C_stable_libtorch`, built for torch 2.14). The code under test only asks the
     platform `is_rocm()`.

vLLM's own modules run unchanged either way.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

from support import stack_env

REPO = Path(__file__).resolve().parents[2]
VENDOR = Path(os.environ.get("EKV_VENDOR") or REPO / ".vendor")  # `scripts/vendor-vllm --check`
VLLM_ZIP = VENDOR / "vllm034-py.zip"
WHEELS = VENDOR / "vllm034-wheels"
VLLM_VERSION = "0.34.0"
# Imported at module level by vLLM, never called by the code these tests run: stubbed only
# where absent (big binary wheels, or none for the device's Python).
STUBBED = ("PIL", "uvloop", "llguidance")

_state: dict[str, Any] = {}


class _StubModule(types.ModuleType):
    """Any attribute is a fresh empty class: importable, subclassable, usable in annotations
    and `isinstance`, and loud if anything calls into it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


def _use_vendored() -> None:
    code, site = stack_env.extract(VLLM_ZIP, WHEELS, "vllm034")
    sys.path[:0] = [str(code), str(site)]
    absent = {name for name in STUBBED if importlib.util.find_spec(name) is None}
    if absent:
        sys.meta_path.append(stack_env.StubFinder(absent, _StubModule))
    _state["stubbed"] = sorted(absent)
    import vllm.platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    vllm.platforms._current_platform = UnspecifiedPlatform()  # type: ignore[attr-defined]


def load() -> str | None:
    """Make vLLM 0.34.0 importable; None on success, else why not (a skip reason)."""
    if "reason" in _state:
        return _state["reason"]  # type: ignore[no-any-return]
    reason: str | None = None
    try:
        if stack_env.installed("vllm"):
            _state["source"] = "installed"
        elif VLLM_ZIP.exists():
            _state["source"] = f"vendored ({VLLM_ZIP})"
            _use_vendored()
        else:
            reason = (
                f"vLLM {VLLM_VERSION} is not installed (scripts/setup installs it) and "
                f"{VLLM_ZIP} is absent (scripts/vendor-vllm makes it)"
            )
        if reason is None:
            with stack_env.torch_jit_deprecation_ignored():
                import vllm

                if vllm.__version__ != VLLM_VERSION:
                    reason = (
                        f"vLLM {vllm.__version__} is installed; these tests need {VLLM_VERSION}"
                    )
                else:
                    importlib.import_module("vllm.v1.worker.extensible_kv_cache")
    except Exception as exc:  # a broken vLLM environment is a reason, not a crash
        reason = f"vLLM {VLLM_VERSION} does not import: {type(exc).__name__}: {exc}"
    _state["reason"] = reason
    return reason


def source() -> str:
    """Where vLLM came from (after `load()`), for logs."""
    return stack_env.source(_state)
