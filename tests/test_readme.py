"""The README's commands and example are executed, so they cannot rot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import stack_env

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_first_lines_are_the_two_commands() -> None:
    setup_and_demo, run_tests = _blocks("sh")[0].strip().splitlines()
    assert setup_and_demo == "scripts/setup && .venv/bin/python -m extensible_kv demo"
    assert run_tests == "scripts/test"
    assert README.index("```sh") < README.index("\n## ")
    # CI runs exactly the README's test command after the setup.
    ci = (ROOT / ".ci" / "run").read_text().split()
    assert ci[-2:] == ["scripts/setup", "scripts/test"]


def test_the_torch_extra_is_documented_and_exists() -> None:
    import tomllib

    from extensible_kv import _torch

    assert _torch.INSTALL_HINT in README
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert any(dep.startswith("torch") for dep in extras["torch"])
    assert not any(dep.startswith("torch") for dep in pyproject["project"]["dependencies"])


@pytest.mark.transformers
def test_demo_command_runs() -> None:
    # The README's command as is: defaults, a fresh process (on the GPU when there is one).
    stack_env.require_transformers()
    result = subprocess.run(
        [sys.executable, "-m", "extensible_kv", "demo"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("identical: yes")
    assert "Extended KV cache to " in result.stdout
    for row in ("KV cache blocks", "free memory after start-up", "start-up (ms)", "tokens/s"):
        assert row in result.stdout
    assert re.search(r"release [\d.]+ ms .* \+ resume [\d.]+ ms", result.stdout)


def test_the_seed_decoder_example_runs() -> None:
    # The seed's own path (KVCacheFlow on our layouts), an example outside the package.
    result = subprocess.run(
        [sys.executable, "-m", "decoder", "--num-seqs", "2", "--steps", "20"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT / "examples",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("identical: yes")
    assert "of them in memory the extension mapped" in result.stdout


def test_example_runs() -> None:
    (example,) = _blocks("python")
    result = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    physical, handles = map(int, result.stdout.split())
    assert physical == 128 << 20
    assert handles <= 4


def test_share_example_runs() -> None:
    (example,) = _blocks("python share")
    result = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[7, 7, 7, 7]"


def test_what_a_failed_consolidate_keeps_is_stated() -> None:
    # A consolidate is all or nothing per step, not per call (test_shrink.py's
    # test_a_consolidate_failing_past_its_first_step_keeps_every_byte_not_the_handles): the
    # README must not promise more, and must say what racing writes risk.
    text = " ".join(README.split())
    assert "Both are all or nothing" not in text
    assert "a consolidate that fails part-way keeps every committed byte" in text
    assert "leaves the steps it did before the failure consolidated" in text
    racing = "A write issued meanwhile, from another thread or on any stream, may be lost"
    assert racing in text


@pytest.mark.transformers
def test_transformers_example_runs() -> None:
    # As written, in a process of its own: it builds its model, prompts and configs itself.
    stack_env.require_transformers()
    (example,) = _blocks("py transformers")
    result = subprocess.run(
        [sys.executable, "-c", example], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = re.search(r"ExtendReport\(blocks_before=(\d+), blocks_after=(\d+),", result.stdout)
    assert report is not None, result.stdout[-3000:]
    before, after = map(int, report.groups())
    import torch

    if torch.cuda.is_available():
        # Sized from the device's free memory after the warm-up: more than the warm-up's.
        assert after > before, report.group(0)
    else:
        assert (before, after) == (0, 64), report.group(0)  # the example's cap on the CPU
