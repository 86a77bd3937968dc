"""Builds `.vendor/sglang0523-*` (git-ignored): SGLang 0.5.23's code for the GPU machine, where
SGLang cannot be installed (no network; its wheel pins torch 2.14). Run by
`scripts/vendor-sglang`; needs PyPI and the `.venv` of `scripts/setup`.

    scripts/vendor-sglang [--python 3.12] [--check]

Writes:
  .vendor/sglang0523-py.zip   the 0.5.23 wheel for the machine's Python without any compiled
                              module (`srt/rust_extensions/*.so`, the radix tree's `.so`: the
                              KV pools import neither) and without `multimodal_gen`
                              (tests/support/sglang_env.py extracts it on the machine)
  .vendor/sglang0523-wheels/  wheels, for the machine's Python, of the packages SGLang's pool
                              modules import beyond what the machine has (torch 2.11, numpy,
                              transformers, pytest), at the versions installed in .venv; and
                              cuda-bindings, which SGLang's own arena drives the driver with,
                              and torch_memory_saver, its memory saver (the baselines of
                              benchmarks/bench_sglang.py)

`--check` then runs the `sglang` tests here as the GPU machine would (vendor_common's device-like
Python: torch, numpy, transformers, pytest, hypothesis and extensible-kv only). The vLLM and
SGLang copies are separate: a device call carries one of them (64 MiB per call).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from vendor_common import download, log, run_as_device, write_wheels  # noqa: E402  (a sibling script)

VERSION = "0.5.23"
# Distributions SGLang 0.5.23's pool modules import (tests/support/sglang_env.py's MODULES,
# measured on a CPU machine) that the device lacks. torchvision and Pillow are stubbed there
# instead.
WHEELS = [
    "aiohappyeyeballs",
    "aiohttp",
    "aiosignal",
    "annotated-types",
    "anyio",
    "apache-tvm-ffi",
    "attrs",
    "certifi",
    "charset-normalizer",
    "compressed-tensors",
    "cuda-bindings",
    "cuda-pathfinder",
    "dill",
    "frozenlist",
    "gguf",
    "ipython",
    "loguru",
    "msgspec",
    "multidict",
    "orjson",
    "propcache",
    "psutil",
    "pybase64",
    "pydantic",
    "pydantic_core",
    "pyzmq",
    "requests",
    "sentencepiece",
    "starlette",
    "torch-memory-saver",
    "traitlets",
    "typing-inspection",
    "urllib3",
    "yarl",
]
PLATFORMS = ["manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64"]
PLATFORMS += ["manylinux2014_x86_64", "manylinux_2_24_x86_64"]


def write_code(vendor: Path, python: str) -> None:
    with tempfile.TemporaryDirectory(prefix="ekv-sglang-wheel-") as cache:
        local = os.environ.get("EKV_SGLANG_WHEEL")
        if local:
            wheel = Path(local)
        else:
            download(Path(cache), python, PLATFORMS, f"sglang=={VERSION}")
            (wheel,) = Path(cache).glob(f"sglang-{VERSION}-*.whl")
        target = vendor / "sglang0523-py.zip"
        kept = 0
        with (
            zipfile.ZipFile(wheel) as source,
            zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out,
        ):
            for name in source.namelist():
                if not name.startswith("sglang/") or name.startswith("sglang/multimodal_gen/"):
                    continue
                if name.endswith(".so"):
                    continue
                out.writestr(name, source.read(name))
                kept += 1
    log(f"{target}: {kept} files, {target.stat().st_size / 2**20:.1f} MiB")


def check() -> int:
    with tempfile.TemporaryDirectory(prefix="ekv-vendor-check-") as tmp:
        root = Path(tmp)
        vendor = root / "vendor"
        vendor.mkdir()
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        write_code(vendor, here)
        write_wheels(vendor / "sglang0523-wheels", here, PLATFORMS, WHEELS)
        tests = ["-m", "sglang", str(REPO / "tests" / "test_sglang.py")]
        return run_as_device(root, vendor, "EKV_REQUIRE_SGLANG", tests)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python (3.12)")
    parser.add_argument("--check", action="store_true", help="then run the sglang tests as there")
    args = parser.parse_args()
    vendor = REPO / ".vendor"
    vendor.mkdir(exist_ok=True)
    write_code(vendor, args.python)
    write_wheels(vendor / "sglang0523-wheels", args.python, PLATFORMS, WHEELS)
    ours = [vendor / "sglang0523-py.zip", *(vendor / "sglang0523-wheels").glob("*.whl")]
    total = sum(p.stat().st_size for p in ours)
    log(f"SGLang's copy: {total / 2**20:.1f} MiB (a device call carries 64 MiB, with dist)")
    return check() if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
