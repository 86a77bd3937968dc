"""What `vllm_env` and `sglang_env` share: finding a stack installed, unpacking its vendored copy
once per machine, stubbing the packages it imports but the tests never call, and reporting where
it came from."""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import tempfile
import types
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def installed(package: str) -> bool:
    """Whether `package` is installed in this Python (without importing it)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _stamp(code_zip: Path, wheels: Path) -> str:
    digest = hashlib.sha256()
    for path in [code_zip, *sorted(wheels.glob("*.whl"))]:
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def extract(code_zip: Path, wheels: Path, name: str) -> tuple[Path, Path]:
    """`(code, site)`: the vendored stack's code and its wheels, unpacked once per machine (and
    again when either changes) under the temp dir as `extensible-kv-{name}-{stamp}`."""
    root = Path(tempfile.gettempdir()) / f"extensible-kv-{name}-{_stamp(code_zip, wheels)}"
    if not (root / "done").exists():
        tmp = Path(tempfile.mkdtemp(prefix=f"extensible-kv-{name}-"))
        with zipfile.ZipFile(code_zip) as archive:
            archive.extractall(tmp / "code")
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(tmp / "site")
        (tmp / "site").mkdir(exist_ok=True)
        (tmp / "done").touch()
        try:
            tmp.rename(root)
        except OSError:  # another process won the race: use its copy
            pass
    return root / "code", root / "site"


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports every module of `packages` as a `module_type` (a stub package, version
    `0+stub`); what its attributes are is the module type's business."""

    def __init__(self, packages: set[str], module_type: type[types.ModuleType]) -> None:
        self.packages = packages
        self.module_type = module_type

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] not in self.packages:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.module_type(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        module.__version__ = "0+stub"


@contextmanager
def torch_jit_deprecation_ignored() -> Iterator[None]:
    """torch 2.11 (the GPU machine's) deprecates the `torch.jit` decorators that vLLM's and
    SGLang's modules apply at import (`torch.jit.script_method`); pytest makes warnings errors."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`torch\.jit\.\w+` is deprecated", category=DeprecationWarning
        )
        yield


def source(state: dict[str, Any]) -> str:
    """Where the stack came from (after `load()`) and what was stubbed, for logs."""
    stubbed = state.get("stubbed")
    suffix = f"; stubbed: {', '.join(stubbed)}" if stubbed else ""
    return f"{state.get('source', 'not loaded')}{suffix}"


def required(env_var: str) -> bool:
    """Whether CI set `env_var` (`EKV_REQUIRE_VLLM=1`, ...): there, the stack missing is a
    failure, not a skip."""
    return os.environ.get(env_var, "") not in ("", "0")


def skip_or_fail(reason: str | None, env_var: str) -> None:
    """Nothing when the stack loaded (`reason` None); else the test skips with the reason, or
    fails where CI set `env_var`."""
    if reason is None:
        return
    import pytest

    if required(env_var):
        pytest.fail(f"{env_var} is set, but {reason}")
    pytest.skip(reason)


def transformers_reason() -> str | None:
    """Why transformers' continuous batching cannot run on extensible_kv.transformers here
    (absent, or outside the supported range), or None."""
    try:
        import transformers
    except ImportError as error:
        return f"transformers is not installed ({error}); scripts/setup installs it"
    from extensible_kv.transformers import SUPPORTED, patch

    if not patch._supports(transformers.__version__):
        return f"transformers {transformers.__version__} is installed; these tests need {SUPPORTED}"
    return None


def require_transformers() -> None:
    """Skips (fails where CI set EKV_REQUIRE_TRANSFORMERS) unless `transformers_reason()` is
    None."""
    skip_or_fail(transformers_reason(), "EKV_REQUIRE_TRANSFORMERS")
