"""The scripts a new user runs first say what they are doing, and test output is honest and
quiet: skips for one reason fold into one line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_setup_says_what_it_is_doing(tmp_path: Path) -> None:
    """scripts/setup against stand-ins for cargo and the venv's python, which only log."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup", tmp_path / "scripts" / "setup")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir, venv_bin = tmp_path / "bin", tmp_path / ".venv" / "bin"
    bin_dir.mkdir()
    venv_bin.mkdir(parents=True)
    log = tmp_path / "calls.log"
    for stand_in in (bin_dir / "cargo", venv_bin / "python"):
        stand_in.write_text(f'#!/bin/sh\necho "$0 $*" >> {log}\n')
        stand_in.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "setup")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    steps = [line for line in result.stdout.splitlines() if line.startswith("== setup:")]
    assert len(steps) >= 3, result.stdout
    assert any("pip" in step for step in steps), steps
    assert any("Rust" in step and "native module" in step for step in steps), steps
    assert steps[-1].startswith("== setup: done in "), steps
    assert "-e .[test]" in log.read_text().replace("'", "")  # it still installs the package


SKIPS = """
import pytest

REASON = "no device here"

@pytest.mark.skipif(True, reason=REASON)
def test_a(): pass

@pytest.mark.skipif(True, reason=REASON)
@pytest.mark.parametrize("x", [1, 2, 3])
def test_b(x): pass

def test_c():
    pytest.skip(REASON)

@pytest.mark.skipif(True, reason="another reason")
def test_d(): pass
"""


def test_skips_for_one_reason_fold_into_one_line(pytester: pytest.Pytester) -> None:
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_skips=SKIPS)
    result = pytester.runpytest("-ra", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=6)
    lines = [line for line in result.outlines if line.startswith("SKIPPED")]
    assert len(lines) == 2, lines
    assert any(line.startswith("SKIPPED [5] ") and "no device here" in line for line in lines)
    assert any(line.startswith("SKIPPED [1] ") and "another reason" in line for line in lines)


def _cargo_test_list(*args: str) -> str:
    """What `cargo test ARGS` prints (skips where there is no cargo: the device machine runs
    the built test executables instead)."""
    cargo = shutil.which("cargo")
    if cargo is None:
        pytest.skip("cargo not found (the device machine runs the built test executables)")
    return subprocess.run(
        [cargo, "test", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        check=True,
    ).stdout


def test_rust_gpu_tests_are_reported_ignored_not_ok() -> None:
    """`cargo test` on a machine without a GPU lists the GPU tests as ignored (scripts/gpu-check
    runs them with --include-ignored), instead of passing them after an early return."""
    listing = _cargo_test_list("--features", "cuda", "-q", "--", "--list", "--ignored")
    ignored = {line.split(": ")[0].rsplit("::", 1)[-1] for line in listing.splitlines()}
    expected = {
        "gpu_round_trip_of_two_granules",
        "gpu_refuses_what_it_did_not_hand_out",
        "gpu_absurd_create_is_out_of_memory",
        "gpu_leaves_other_threads_contexts_alone",
        "gpu_drop_gives_back_what_owners_leaked",
    }
    assert expected <= ignored, sorted(ignored)


MODEL = ["--nocapture", "--exact", "matches_the_model"]


def test_ekv_proptest_cases_sets_the_model_s_case_count() -> None:
    """The long mode of tests/tensor_model.rs (10,000 cases in CI and on the device) really
    runs that many: proptest's `PROPTEST_CASES` was silently overridden by the config."""
    cargo = shutil.which("cargo")
    if cargo is None:
        pytest.skip("cargo not found (the device machine runs the built test executables)")
    result = subprocess.run(
        [cargo, "test", "-q", "--features", "cuda", "--test", "tensor_model", "--", *MODEL],
        cwd=ROOT,
        # The model holds the host backend's events itself: no delay under it.
        env={
            **{k: v for k, v in os.environ.items() if k != "EXTENSIBLE_KV_HOST_EVENT_DELAY_US"},
            "EKV_PROPTEST_CASES": "7",
        },
        capture_output=True,
        text=True,
        timeout=1200,
        check=True,
    )
    match = re.search(r"tensor model: (\d+) cases configured, (\d+) run", result.stdout)
    assert match, result.stdout[-2000:]
    configured, ran = int(match[1]), int(match[2])
    assert configured == 7 and 7 <= ran < 50, (configured, ran)


def test_the_crate_has_a_runnable_example_and_documents_its_public_items() -> None:
    """`cargo test` runs the crate-level example, and an undocumented public item fails
    scripts/test (missing_docs warns; clippy's -D warnings makes it an error)."""
    import tomllib

    lints = tomllib.loads((ROOT / "Cargo.toml").read_text())["lints"]["rust"]
    assert lints.get("missing_docs") in ("warn", "deny"), lints
    assert "-D warnings" in (ROOT / "scripts" / "test").read_text()
    listing = _cargo_test_list("-q", "--doc", "--features", "cuda", "--", "--list")
    runnable = [line for line in listing.splitlines() if line.startswith("src/lib.rs - (line")]
    assert runnable, listing
