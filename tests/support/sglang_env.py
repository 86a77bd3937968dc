"""Where SGLang 0.5.23's code comes from in the tests and benchmarks.

`load()` makes SGLang's KV pool modules importable, or says why it cannot:

1. SGLang installed in this Python (CI, `scripts/setup`: `pip install --no-deps` plus
   scripts/sglang-requirements.txt): imported as is.
2. Otherwise the copy `scripts/vendor-sglang` leaves in `.vendor/` (git-ignored; carried to the
   GPU machine, where SGLang cannot be installed: no network, and its wheel pins torch 2.14):
   - `sglang0523-py.zip`: the 0.5.23 wheel's Python files (no `srt/rust_extensions/*.so`, no
     `multimodal_gen`), extracted once per machine into a temp dir first on `sys.path`;
   - `sglang0523-wheels/*.whl`: the light packages its modules import, for the device's
     Python, extracted beside it and put LAST on `sys.path`: they fill gaps, and never shadow
     what the machine has (its torch's own `cuda-bindings`, say).
   - where absent, `torchvision` and `PIL` (imported at module level, never called here) become
     stubs.

On CUDA, SGLang's modules import `sgl_kernel` (its compiled kernels) under a module-level
`if _is_cuda:`; the pool code under test never calls them (the tests write K/V through plain
tensor ops, never `set_kv_buffer`), so where `sgl_kernel` is absent it becomes a stub. A stub's
attributes chain (`scalar_types.uint4b8`) and raise only when called. On import, off CUDA,
SGLang's AWQ and GGUF modules warn that only CUDA (and others) support them: those warnings are
ignored, by their text and module, during the import only, as torch 2.11's deprecation of the
`torch.jit` decorators SGLang applies at import.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
import warnings
from pathlib import Path
from typing import Any

from support import stack_env

REPO = Path(__file__).resolve().parents[2]
VENDOR = Path(os.environ.get("EKV_VENDOR") or REPO / ".vendor")
SGLANG_ZIP = VENDOR / "sglang0523-py.zip"
WHEELS = VENDOR / "sglang0523-wheels"
SGLANG_VERSION = "0.5.23"
# The modules the tests use: the pools, the plugin framework, the memory saver seams.
MODULES = (
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.swa_memory_pool",
    "sglang.srt.mem_cache.unified_memory_pool",
    "sglang.srt.mem_cache.kv_vmm_backing",
    "sglang.srt.plugins",
    "sglang.srt.plugins.hook_registry",
    "sglang.srt.arg_groups.overrides",
    "sglang.srt.utils.torch_memory_saver_adapter",
)
KERNEL_PACKAGES = {"sgl_kernel"}
# Imported at module level by SGLang's multimodal and config code, never called by the code under
# test: stubbed where absent (binary wheels that must match the machine's torch, or big).
STUBBED = ("torchvision", "PIL")

_state: dict[str, Any] = {}


class _Kernel:
    """A stand-in for anything `sgl_kernel` exports: attributes chain, calls raise."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> _Kernel:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Kernel(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is a test stub: sgl_kernel is not installed here")


class _KernelModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Kernel(f"{self.__name__}.{name}")


def _stub_what_is_absent() -> None:
    import torch

    absent = {name for name in STUBBED if importlib.util.find_spec(name) is None}
    if torch.cuda.is_available():
        absent |= {name for name in KERNEL_PACKAGES if importlib.util.find_spec(name) is None}
    if absent:
        sys.meta_path.append(stack_env.StubFinder(absent, _KernelModule))
    _state["stubbed"] = sorted(absent)


def load() -> str | None:
    """Make SGLang 0.5.23's pool modules importable; None on success, else why not."""
    if "reason" in _state:
        return _state["reason"]  # type: ignore[no-any-return]
    reason: str | None = None
    try:
        if stack_env.installed("sglang"):
            _state["source"] = "installed"
        elif SGLANG_ZIP.exists():
            _state["source"] = f"vendored ({SGLANG_ZIP})"
            code, site = stack_env.extract(SGLANG_ZIP, WHEELS, "sglang0523")
            # The machine's own packages win over the vendored wheels, which fill gaps only.
            sys.path.insert(0, str(code))
            sys.path.append(str(site))
        else:
            reason = (
                f"SGLang {SGLANG_VERSION} is not installed (scripts/setup installs it) and "
                f"{SGLANG_ZIP} is absent (scripts/vendor-sglang makes it)"
            )
        if reason is None:
            _stub_what_is_absent()
            import sglang

            if sglang.__version__ != SGLANG_VERSION:
                reason = f"SGLang {sglang.__version__} is here; these tests need {SGLANG_VERSION}"
            else:
                with warnings.catch_warnings():
                    warnings.filterwarnings(
                        "ignore",
                        message="Only CUDA, .* support .* currently",
                        category=UserWarning,
                        module=r"sglang\.srt\.layers\.quantization\.",
                    )
                    with stack_env.torch_jit_deprecation_ignored():
                        for name in MODULES:
                            importlib.import_module(name)
    except Exception as exc:  # a broken SGLang environment is a reason, not a crash
        reason = f"SGLang {SGLANG_VERSION} does not import: {type(exc).__name__}: {exc}"
    _state["reason"] = reason
    return reason


def source() -> str:
    """Where SGLang came from (after `load()`), for logs."""
    return stack_env.source(_state)
