"""vLLM 0.34.0's own v1 core tests (`tests/v1/core/test_scheduler.py`,
`test_prefix_caching.py`, `test_kv_cache_utils.py`, `test_single_type_kv_cache_manager.py`,
from its PyPI sdist: `scripts/vendor_vllm_tests.py`), run twice in subprocesses: on vLLM's
own `BlockPool`, and with the extensible-kv plugin registered and `ResizableBlockPool` in
place (`support.vllm_core_plugin` asserts which before any test runs). Every test must end
the same way in both runs, and the run with our pool adds the cases that resize the
scheduler between its steps (`support/vllm_core_resize_cases.py`).

Some of vLLM's tests build a `ModelConfig` for a hub model (llava, Mamba models): this
machine reaches no hub, so those fail alike in both runs with pydantic's `ValidationError`
for `ModelConfig`; the test asserts that this is the only way any of them fails, and that at
least `MIN_PASSED` pass. facebook/opt-125m's `config.json` (`support/hf/`) serves the default
model of vLLM's `create_scheduler` from an offline hub cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support import stack_env

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
VENDORED = REPO / ".vendor" / "vllm034-tests"
SUPPORT = Path(__file__).resolve().parent / "support"
FILES = [
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
]
CASES = SUPPORT / "vllm_core_resize_cases.py"
MIN_PASSED = 600  # of 701 here (0.34.0); the rest need hub models
OPT = "facebook/opt-125m"
OPT_REVISION = "27dcfa74d334bc871f3234de431e71c6eeba5dd6"


def _hub(root: Path) -> Path:
    """An offline hub cache holding `OPT`'s config.json."""
    repo = root / "hub" / ("models--" + OPT.replace("/", "--"))
    snapshot = repo / "snapshots" / OPT_REVISION
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(OPT_REVISION)
    (snapshot / "config.json").write_bytes(
        (SUPPORT / "hf" / "facebook--opt-125m.json").read_bytes()
    )
    return root


def _run(tmp: Path, hf_home: Path, pool: bool) -> dict[str, tuple[str, str]]:
    """Runs the files (and, with the pool, the resize cases); {test id: (outcome, message)}."""
    junit = tmp / f"junit-{int(pool)}.xml"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SUPPORT.parent), str(VENDORED)]),
        "EKV_VLLM_CORE_POOL": "1" if pool else "0",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_PLUGINS": "",  # vLLM loads no plugin by itself: the pool run registers ours
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    args = [*FILES, str(CASES)] if pool else FILES
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "support.vllm_core_plugin",
        f"--confcutdir={VENDORED / 'tests' / 'v1' / 'core'}",
        f"--rootdir={VENDORED}",
        "-W",
        "ignore::pytest.PytestUnknownMarkWarning",
        f"--junitxml={junit}",
        *args,
    ]
    done = subprocess.run(
        command, cwd=VENDORED, env=env, capture_output=True, text=True, timeout=1800
    )
    assert junit.exists(), done.stdout[-4000:] + done.stderr[-4000:]
    outcomes: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = child.tag, (child.get("message") or "") + (child.text or "")
        outcomes[key] = (outcome, message)
    return outcomes


@pytest.fixture(scope="module")
def vendored(vllm: Any) -> Path:
    stack_env.skip_or_fail(
        None
        if (VENDORED / "SOURCE").exists()
        else (f"{VENDORED} is missing: run scripts/vendor_vllm_tests.py (scripts/setup does)"),
        "EKV_REQUIRE_VLLM",
    )
    return VENDORED


def test_vllms_core_tests_end_alike_on_its_pool_and_ours_and_resize_between_steps(
    vendored: Path, tmp_path: Path
) -> None:
    hf_home = _hub(tmp_path / "hf")
    theirs = _run(tmp_path, hf_home, pool=False)
    ours = _run(tmp_path, hf_home, pool=True)
    # vLLM's tests are named by their module under tests.v1.core; the cases, outside the
    # rootdir, by none.
    cases = {key: value for key, value in ours.items() if not key.startswith("tests.v1.core.")}
    ours = {key: value for key, value in ours.items() if key not in cases}

    assert set(ours) == set(theirs)
    differ = {key: (theirs[key][0], ours[key][0]) for key in ours if ours[key][0] != theirs[key][0]}
    assert differ == {}, differ
    counts = Counter(outcome for outcome, _ in ours.values())
    assert counts["passed"] >= MIN_PASSED, counts
    for key, (outcome, message) in ours.items():
        if outcome != "passed":
            # Only for want of a hub here: a ModelConfig that cannot resolve its model.
            assert outcome in ("failure", "error"), (key, outcome)
            assert "ValidationError" in message and "ModelConfig" in message, (key, message[:500])

    assert len(cases) >= 5, sorted(cases)
    failed = {
        key: message[:2000] for key, (outcome, message) in cases.items() if outcome != "passed"
    }
    assert failed == {}, failed
