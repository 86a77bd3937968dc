"""A pytest plugin (`-p support.vllm_core_plugin`) for vLLM 0.34.0's own v1 core tests, run
by `tests/test_vllm_core_suite.py` in a subprocess on this machine.

- **The platform.** vLLM's CUDA wheel resolves no platform without a GPU, and its CPU
  platform refuses x86 without triton-cpu in `check_and_update_config`. The scheduler and
  block-pool code under test asks the platform for a device type only: vLLM's CPU platform
  with that check a no-op serves both runs alike.
- **The pool.** With `EKV_VLLM_CORE_POOL=1`, the extensible-kv plugin is registered, and
  `ResizableBlockPool` must then be the `BlockPool` every vLLM module builds (asserted here,
  before any test runs); with `0`, vLLM's own `BlockPool` must be.
- **`caplog_vllm`**, the one fixture of vLLM's root conftest the core tests use.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

POOL_ENV = "EKV_VLLM_CORE_POOL"


def pytest_configure(config: Any) -> None:
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    class CoreTestPlatform(CpuPlatform):
        @classmethod
        def check_and_update_config(cls, vllm_config: Any) -> None:
            return None

    platforms._current_platform = CoreTestPlatform()  # type: ignore[attr-defined]
    for marker in ("cpu_test", "skip_global_cleanup", "core_model", "slow_test"):
        config.addinivalue_line("markers", f"{marker}: vLLM's own marker")

    from extensible_kv.vllm.block_pool import VLLM_BLOCK_POOL, ResizableBlockPool
    from vllm.v1.core import block_pool, kv_cache_coordinator

    if os.environ.get(POOL_ENV) == "1":
        from extensible_kv.vllm import plugin

        assert plugin.register(), "the extensible-kv vLLM plugin did not register"
        want: type = ResizableBlockPool
    else:
        want = VLLM_BLOCK_POOL
    for module in (block_pool, kv_cache_coordinator):
        assert module.BlockPool is want, (module.__name__, module.BlockPool, want)


# vLLM's root conftest (cut off by --confcutdir: it imports vLLM's whole test environment)
# gives the core tests one fixture: caplog with vLLM's logger propagating, as there.
@pytest.fixture()
def caplog_vllm(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Any:
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    monkeypatch.setitem(DEFAULT_LOGGING_CONFIG["loggers"]["vllm"], "propagate", True)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    with caplog.at_level(logging.INFO):
        yield caplog
