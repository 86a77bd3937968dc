"""The suite runs strict (issue 22): a warning is an error, an unexpected pass of an xfail is
a failure, and a test that hangs fails by itself. Checked by running pytest, with the
project's own settings, on small tests that break each rule."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _ini_toml() -> str:
    """The project's `[tool.pytest.ini_options]`, as TOML for a pytester project."""
    options = PYPROJECT["tool"]["pytest"]["ini_options"]
    lines = ["[tool.pytest.ini_options]"]
    for key, value in options.items():
        if key in ("testpaths", "addopts"):
            continue
        if isinstance(value, list):
            items = ", ".join(_toml_string(v) for v in value)
            lines.append(f"{key} = [{items}]")
        elif isinstance(value, bool):
            lines.append(f"{key} = {str(value).lower()}")
        elif isinstance(value, int):
            lines.append(f"{key} = {value}")
        else:
            lines.append(f"{key} = {_toml_string(value)}")
    return "\n".join(lines) + "\n"


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def test_the_settings_are_strict() -> None:
    options = PYPROJECT["tool"]["pytest"]["ini_options"]
    assert options["filterwarnings"][0] == "error"
    assert options["xfail_strict"] is True
    assert 60 <= options["timeout"] <= 600
    assert any(
        r.startswith("pytest-timeout")
        for r in PYPROJECT["project"]["optional-dependencies"]["test"]
    )


def test_warnings_xpasses_and_hangs_fail(pytester: pytest.Pytester) -> None:
    pytest.importorskip("pytest_timeout")
    pytester.makefile(".toml", pyproject=_ini_toml())
    pytester.makepyfile(
        """
        import time
        import warnings

        import pytest

        def test_warns():
            warnings.warn("something is off", DeprecationWarning)

        @pytest.mark.xfail(reason="expected to fail")
        def test_passes_unexpectedly():
            pass

        @pytest.mark.timeout(1)
        def test_hangs():
            time.sleep(30)

        def test_fine():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines(["*DeprecationWarning*", "*XPASS(strict)*", "*Timeout*"])
