"""The vLLM plugin: the entry point, what `register()` replaces, and when it stays out.

Most tests run against stand-in `vllm` modules (no vLLM needed); those marked `vllm` run
vLLM 0.34.0's own plugin loader in a fresh process.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from extensible_kv._plugins import Patches
from extensible_kv.vllm import ENV_VAR, ExtensibleTensor, granule_size, plugin, register

TESTS = Path(__file__).resolve().parent


class Vllm034Tensor:
    """Stand-in for vLLM 0.34's class: its constructor, its public attributes."""

    def __init__(
        self,
        max_num_bytes: int,
        device: Any = None,
        num_segments: int = 1,
        segment_capacities: Any = None,
        export_handle_types: int = 0,
    ) -> None:
        pass


for _name in (n for n in dir(ExtensibleTensor) if not n.startswith("_")):
    setattr(Vllm034Tensor, _name, None)


def vllm034_granule_size(device_index: int) -> int:
    return 2 << 20


class FakeVllm:
    """`vllm`, `vllm.utils.extensible_tensor` and the two modules that bind its names."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, version: str = "0.34.0") -> None:
        self.modules: dict[str, types.ModuleType] = {}
        for name in ("vllm", "vllm.utils", "vllm.v1", "vllm.v1.worker"):
            self.add(monkeypatch, name)
        self.modules["vllm"].__version__ = version  # type: ignore[attr-defined]
        self.tensor = self.add(monkeypatch, "vllm.utils.extensible_tensor")
        self.tensor.ExtensibleTensor = Vllm034Tensor  # type: ignore[attr-defined]
        self.tensor.granule_size = vllm034_granule_size  # type: ignore[attr-defined]
        self.cache = self.add(monkeypatch, "vllm.v1.worker.extensible_kv_cache")
        self.cache.ExtensibleTensor = Vllm034Tensor  # type: ignore[attr-defined]
        self.worker = self.add(monkeypatch, "vllm.v1.worker.gpu_worker")
        self.worker.granule_size = vllm034_granule_size  # type: ignore[attr-defined]

    def add(self, monkeypatch: pytest.MonkeyPatch, name: str) -> types.ModuleType:
        module = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, module)
        self.modules[name] = module
        return module

    def bound(self) -> tuple[Any, Any, Any, Any]:
        return (
            self.tensor.ExtensibleTensor,  # type: ignore[attr-defined]
            self.tensor.granule_size,  # type: ignore[attr-defined]
            self.cache.ExtensibleTensor,  # type: ignore[attr-defined]
            self.worker.granule_size,  # type: ignore[attr-defined]
        )


ORIGINAL = (Vllm034Tensor, vllm034_granule_size, Vllm034Tensor, vllm034_granule_size)
REPLACED = (ExtensibleTensor, granule_size, ExtensibleTensor, granule_size)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@pytest.fixture
def records() -> Iterator[Records]:
    """What the plugin logs (vLLM's "vllm" logger does not propagate to pytest's handler)."""
    handler = Records()
    plugin.logger.addHandler(handler)
    level = plugin.logger.level
    plugin.logger.setLevel(logging.DEBUG)
    yield handler
    plugin.logger.removeHandler(handler)
    plugin.logger.setLevel(level)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeVllm]:
    monkeypatch.delenv(ENV_VAR, raising=False)
    # The real plugin state (another test may have installed it into the real vLLM) stays aside.
    monkeypatch.setattr(plugin, "_patches", Patches())
    yield FakeVllm(monkeypatch)


def test_register_replaces_every_binding_and_logs_one_line(
    fake: FakeVllm, records: Records
) -> None:
    assert fake.bound() == ORIGINAL
    assert register() is True
    assert fake.bound() == REPLACED
    (line,) = records.lines(logging.INFO)
    assert "vLLM 0.34.0's extensible KV cache runs on extensible-kv" in line
    assert f"{ENV_VAR}=0 turns this off" in line
    assert register() is True  # vLLM may load plugins more than once: no second line
    assert len(records.records) == 1
    plugin.unregister()
    assert fake.bound() == ORIGINAL


def test_names_bound_later_come_from_the_patched_module(fake: FakeVllm) -> None:
    """Modules imported after the plugin (vLLM loads it before the worker module) bind ours."""
    del sys.modules["vllm.v1.worker.gpu_worker"]
    assert register() is True
    assert fake.tensor.granule_size is granule_size  # type: ignore[attr-defined]
    assert fake.worker.granule_size is vllm034_granule_size  # type: ignore[attr-defined]
    plugin.unregister()


def test_switched_off(fake: FakeVllm, records: Records, monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("0", "false", "off"):
        monkeypatch.setenv(ENV_VAR, value)
        assert register() is False
        assert fake.bound() == ORIGINAL
    assert all(f"{ENV_VAR}=0" in line for line in records.lines(logging.INFO))
    monkeypatch.setenv(ENV_VAR, "1")
    assert register() is True
    plugin.unregister()


def _different_constructor(
    self: Any, max_num_bytes: int, device: Any = None, num_segments: int = 1
) -> None:
    pass


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda cls: setattr(cls, "__init__", _different_constructor), "not 0.34's signature"),
        (lambda cls: setattr(cls, "defragment_", None), "['defragment_']"),
    ],
)
def test_unrecognised_vllm_is_left_alone(
    fake: FakeVllm, records: Records, monkeypatch: pytest.MonkeyPatch, change: Any, reason: str
) -> None:
    class Later(Vllm034Tensor):
        pass

    change(Later)
    monkeypatch.setattr(fake.tensor, "ExtensibleTensor", Later)
    fake.modules["vllm"].__version__ = "0.35.0"  # type: ignore[attr-defined]
    assert register() is False
    assert fake.tensor.ExtensibleTensor is Later  # type: ignore[attr-defined]
    assert fake.cache.ExtensibleTensor is Vllm034Tensor  # type: ignore[attr-defined]
    (line,) = records.lines(logging.WARNING)
    assert "vLLM 0.35.0" in line and reason in line


def test_rocm_is_left_alone(
    fake: FakeVllm, records: Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    assert register() is False
    assert fake.bound() == ORIGINAL
    (line,) = records.lines(logging.WARNING)
    assert "vLLM 0.34.0" in line and "ROCm is not supported" in line


def test_unrecognised_granule_size_is_left_alone(
    fake: FakeVllm, records: Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fake.tensor, "granule_size", lambda device: 1)
    assert register() is False
    assert "granule_size(device)" in records.lines(logging.WARNING)[0]


def test_the_drop_in_matches_the_constructor_it_checks() -> None:
    params = list(inspect.signature(ExtensibleTensor.__init__).parameters.values())[1:]
    assert tuple((p.name, p.default) for p in params) == plugin._SIGNATURE


# ---- vLLM 0.34.0's own loader, in fresh processes


def _run_vllm(body: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs `body` after loading vLLM (installed or vendored) in a fresh process; returns the
    JSON it prints last, with the process's stderr under "stderr"."""
    script = textwrap.dedent(f"""
        import json, logging, os, sys
        sys.path.insert(0, {str(TESTS)!r})
        from support import vllm_env
        reason = vllm_env.load()
        assert reason is None, reason
        logging.basicConfig(level=logging.INFO)
    """) + textwrap.dedent(body)
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    out["stderr"] = result.stderr
    return out


LOAD_AND_REPORT = """
    import vllm.v1.worker.extensible_kv_cache as cache
    try:
        import vllm.v1.worker.gpu_worker as worker
    except Exception as exc:  # the vendored copy on the GPU machine may lack its imports
        worker = None
        print("gpu_worker does not import:", repr(exc), file=sys.stderr)
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.utils import extensible_tensor
    bound = [
        ("extensible_tensor.ExtensibleTensor", extensible_tensor.ExtensibleTensor),
        ("extensible_tensor.granule_size", extensible_tensor.granule_size),
        ("extensible_kv_cache.ExtensibleTensor", cache.ExtensibleTensor),
    ]
    if worker is not None:
        bound.append(("gpu_worker.granule_size", worker.granule_size))
    out = {name: f"{obj.__module__}.{obj.__qualname__}" for name, obj in bound}
    out["source"] = vllm_env.source()
    print(json.dumps(out))
"""

DROP_IN = "extensible_kv.vllm.tensor.ExtensibleTensor"
GRANULE_SIZE = "extensible_kv.vllm.tensor.granule_size"


@pytest.mark.vllm
def test_vllms_loader_installs_the_drop_in(vllm: Any) -> None:
    """Every binding, including those of modules imported before the plugins load."""
    out = _run_vllm(LOAD_AND_REPORT)
    assert out["extensible_tensor.ExtensibleTensor"] == DROP_IN
    assert out["extensible_kv_cache.ExtensibleTensor"] == DROP_IN
    assert out["extensible_tensor.granule_size"] == GRANULE_SIZE
    if out["source"] == "installed" or "gpu_worker.granule_size" in out:
        assert out["gpu_worker.granule_size"] == GRANULE_SIZE
    info = [line for line in out["stderr"].splitlines() if "extensible-kv:" in line]
    assert len(info) == 1 and "INFO" in info[0], out["stderr"]
    assert "vLLM 0.34.0's extensible KV cache runs on extensible-kv" in info[0]


@pytest.mark.vllm
def test_vllms_loader_with_the_plugin_switched_off(vllm: Any) -> None:
    out = _run_vllm(LOAD_AND_REPORT, env={ENV_VAR: "0"})
    assert out["extensible_kv_cache.ExtensibleTensor"] == (
        "vllm.utils.extensible_tensor.ExtensibleTensor"
    )
    if "gpu_worker.granule_size" in out:
        assert out["gpu_worker.granule_size"] == "vllm.utils.extensible_tensor.granule_size"
    else:
        assert out["source"] != "installed"


@pytest.mark.vllm
def test_vllm_034_is_recognised(vllm: Any) -> None:
    from vllm.utils import extensible_tensor

    module = extensible_tensor
    resolve = None
    if module.ExtensibleTensor is ExtensibleTensor:  # the plugin already ran here
        originals = {
            name: obj for (target, name), obj in plugin._patches.items() if target is module
        }
        resolve = lambda path: originals[path.rsplit(".", 1)[1]]  # noqa: E731
    assert plugin.VLLM.recognise(resolve=resolve).ok
