"""Builds `.vendor/` (git-ignored): vLLM 0.34.0's code for the GPU machine, where vLLM cannot
be installed (no network; its wheel pins torch 2.14). Run by `scripts/vendor-vllm`; needs
network access to PyPI and the `.venv` of `scripts/setup` (with vLLM's light dependencies).

    scripts/vendor-vllm [--python 3.12] [--check]

Writes:
  .vendor/vllm034/            vLLM's `extensible_tensor.py` and `vmm_driver.py` alone, under a
                              stub `vllm` package (benchmarks/bench_cuda.py's baseline)
  .vendor/vllm034-py.zip      every `.py` file of the vLLM 0.34.0 wheel (tests/support/vllm_env.py
                              extracts it on the machine)
  .vendor/vllm034-wheels/     wheels, for the machine's Python (`--python`, default 3.12), of
                              the packages vLLM's modules import beyond torch, numpy and
                              transformers (and their dependencies, which the machine has),
                              at the versions installed in .venv

`--check` then runs the `vllm` tests here as the GPU machine would: a Python that sees only
torch, numpy, transformers, pytest, hypothesis (and their dependencies) and extensible-kv,
with the vendored copy built for this machine's Python.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from vendor_common import REPO, log, pip, run_as_device, write_wheels

VERSION = "0.34.0"
# Distributions vLLM's modules import (tests/support/vllm_env.py's imports, measured on a CPU
# machine) that a bare torch + transformers machine lacks. The three stubbed there instead (Pillow,
# uvloop, llguidance: big, and never called by the code under test) are not in the list.
WHEELS = [
    "aiohappyeyeballs",
    "aiohttp",
    "aiosignal",
    "annotated-types",
    "apache-tvm-ffi",
    "attrs",
    "cachetools",
    "cbor2",
    "certifi",
    "charset-normalizer",
    "cloudpickle",
    "einops",
    "frozenlist",
    "idna",
    "msgspec",
    "multidict",
    "prometheus_client",
    "propcache",
    "psutil",
    "py-cpuinfo",
    "pybase64",
    "pydantic",
    "pydantic_core",
    "pyzmq",
    "requests",
    "typing-inspection",
    "urllib3",
    "xgrammar",
    "yarl",
]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
# vLLM's modules that benchmarks/bench_cuda.py imports, and the stubs it needs around them.
BASELINE_FILES = ["vllm/utils/extensible_tensor.py", "vllm/utils/vmm_driver.py"]
BASELINE_STUBS = {
    "vllm/__init__.py": "",
    "vllm/utils/__init__.py": "",
    "vllm/logger.py": (
        "import logging\n\n\ndef init_logger(name):\n    return logging.getLogger(name)\n"
    ),
    "extensible_tensor.py": (
        "# vLLM 0.34.0 ExtensibleTensor, vendored for benchmarks only (git-ignored)\n"
        "from vllm.utils.extensible_tensor import ExtensibleTensor, granule_size  # noqa\n"
    ),
}


def vllm_wheel(cache: Path) -> Path:
    """The vLLM 0.34.0 wheel: $EKV_VLLM_WHEEL, or downloaded from PyPI (no dependencies)."""
    local = os.environ.get("EKV_VLLM_WHEEL")
    if local:
        return Path(local)
    pip("download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(cache), f"vllm=={VERSION}")
    (wheel,) = cache.glob(f"vllm-{VERSION}-*.whl")
    return wheel


def write_code(wheel: Path, vendor: Path) -> None:
    baseline = vendor / "vllm034"
    shutil.rmtree(baseline, ignore_errors=True)
    with zipfile.ZipFile(wheel) as source:
        names = [n for n in source.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        target = vendor / "vllm034-py.zip"
        with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
            for name in names:
                out.writestr(name, source.read(name))
        log(f"{target}: {len(names)} files, {target.stat().st_size / 2**20:.1f} MiB")
        for name in BASELINE_FILES:
            path = baseline / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(source.read(name))
    for name, text in BASELINE_STUBS.items():
        path = baseline / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    log(f"{baseline}: vLLM's ExtensibleTensor for benchmarks/bench_cuda.py")


def check() -> int:
    with tempfile.TemporaryDirectory(prefix="ekv-vendor-check-") as tmp:
        root = Path(tmp)
        vendor = root / "vendor"
        vendor.mkdir()
        shutil.copy2(REPO / ".vendor" / "vllm034-py.zip", vendor)
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        write_wheels(vendor / "vllm034-wheels", here, PLATFORMS, WHEELS)
        return run_as_device(root, vendor, "EKV_REQUIRE_VLLM", ["-m", "vllm", str(REPO / "tests")])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python (3.12)")
    parser.add_argument("--check", action="store_true", help="then run the vllm tests as there")
    args = parser.parse_args()
    vendor = REPO / ".vendor"
    vendor.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ekv-vllm-wheel-") as cache:
        write_code(vllm_wheel(Path(cache)), vendor)
    write_wheels(vendor / "vllm034-wheels", args.python, PLATFORMS, WHEELS)
    total = sum(p.stat().st_size for p in vendor.rglob("*") if p.is_file())
    log(f"{vendor}: {total / 2**20:.1f} MiB in all (a device call carries 64 MiB, with dist)")
    return check() if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
