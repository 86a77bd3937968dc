"""What `vendor_vllm.py` and `vendor_sglang.py` share: pip, downloading wheels for the GPU
machine's Python, and `--check`'s device-like Python that runs a stack's tests here as that
machine would (torch, numpy, transformers, pytest, hypothesis and extensible-kv only)."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What the GPU machine has (docs: torch, transformers, numpy, pytest, hypothesis), for --check.
DEVICE_HAS = ["torch", "numpy", "transformers", "pytest", "hypothesis"]


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def download(target: Path, python: str, platforms: list[str], *pins: str) -> None:
    """Binary wheels of `pins` (no dependencies) for CPython `python` on `platforms`."""
    tag = python.replace(".", "")
    pip(
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        "--abi",
        f"cp{tag}",
        *(arg for platform in platforms for arg in ("--platform", platform)),
        "-d",
        str(target),
        *pins,
    )


def write_wheels(target: Path, python: str, platforms: list[str], names: list[str]) -> None:
    """`target` holds exactly the wheels of `names`, at the versions installed here, for the
    GPU machine's Python (earlier wheels there are removed first)."""
    target.mkdir(parents=True, exist_ok=True)
    for old in target.glob("*.whl"):
        old.unlink()
    download(target, python, platforms, *(f"{name}=={md.version(name)}" for name in names))
    size = sum(p.stat().st_size for p in target.glob("*.whl"))
    log(f"{target}: {len(names)} wheels for Python {python}, {size / 2**20:.1f} MiB")


def _requirement_names(dist: str) -> list[str]:
    names = []
    for req in md.requires(dist) or []:
        if "extra ==" in req:
            continue
        names.append(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0])
    return names


def _closure(roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # a platform-specific requirement this machine does not have
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        todo.extend(_requirement_names(name))
    return seen


def device_like_site(root: Path) -> Path:
    """A site dir of symlinks to what the GPU machine has, plus extensible-kv's metadata."""
    site = root / "site"
    site.mkdir(parents=True)
    keep = _closure(DEVICE_HAS) | {"extensible-kv"}
    for dist in md.distributions():
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key not in keep or dist.files is None:
            continue
        tops = {f.parts[0] for f in dist.files if f.parts and f.parts[0] != ".."}
        for top in tops:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (site / top).exists() and not top.endswith(".pth"):
                (site / top).symlink_to(source)
    return site


def run_as_device(root: Path, vendor: Path, require_env: str, pytest_args: list[str]) -> int:
    """pytest `pytest_args` in the device-like Python (built under `root`), with the stack
    vendored in `vendor` and `require_env=1` (the stack missing fails, not skips)."""
    site = device_like_site(root)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO / "python"), str(REPO / "tests")]),
        "EKV_VENDOR": str(vendor),
        require_env: "1",
        "TMPDIR": str(root),
    }
    command = [sys.executable, "-S", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += pytest_args
    log("check:", " ".join(command))
    return subprocess.run(command, env=env, cwd=REPO).returncode
