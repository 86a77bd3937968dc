"""The devices the backend-parametrised tests run on, and why CUDA cannot be used here.

One list (`DEVICES`): `"cpu"`, the host backend, always; `"cuda:0"`, marked `gpu`. One marker:
`conftest.py` skips every test marked `gpu` (`gpu(devices=N)` for N devices) with
`cuda_reason`'s words where CUDA is unusable, so a GPU-only test says `@pytest.mark.gpu` and
nothing else.
"""

from __future__ import annotations

import functools
from typing import Any

import extensible_kv
import pytest

# The host backend's granularity in tests: the driver's default, small to keep tests small.
CPU_GRANULARITY = 4096

DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]


@functools.cache
def cuda_reason(num_devices: int = 1) -> str | None:
    """Why `num_devices` CUDA devices (0 to N - 1) cannot run the tests here, or None: the
    library's probe first, then torch's view (torch is imported only where libcuda is)."""
    for index in range(num_devices):
        reason = extensible_kv.vmm_unavailable_reason(f"cuda:{index}")
        if reason is not None:
            return reason
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    if torch.cuda.device_count() < num_devices:
        return f"needs {num_devices} CUDA devices, {torch.cuda.device_count()} visible"
    return None


def device_kwargs(device: str) -> dict[str, Any]:
    """Constructor kwargs for a tensor on `device` (and the small granularity on cpu)."""
    if device == "cpu":
        return {"device": "cpu", "granularity": CPU_GRANULARITY}
    return {"device": device}
