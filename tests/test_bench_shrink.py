"""benchmarks/bench_shrink.py runs end to end on the host backend (small sizes), with its
profile and scrub probe: it cannot rot between GPU runs. Nothing here is timed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_bench_shrink_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(BENCHMARKS))  # its `common`, as when it runs as a script
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_shrink", BENCHMARKS / "bench_shrink.py"
        )
        assert spec is not None and spec.loader is not None
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        argv = ["--out", str(tmp_path), "--device", "cpu", "--reps", "1", "--profile", "--scrub"]
        assert bench.main(argv) == 0
    finally:
        sys.path.remove(str(BENCHMARKS))
    res = json.loads((tmp_path / "bench_shrink.json").read_text())
    assert all(run["ok"] for step in ("plain", "exact", "consolidate") for run in res[step])
    (consolidated,) = res["consolidate"]
    assert consolidated["handles"][1] == 4 < consolidated["handles"][0]
    assert consolidated["ops"]["copy"][0] == 4  # one copy per segment, profiled
    scrub = res["scrub"]
    assert [row["delay_s"] for row in scrub] == [*bench.SCRUB_DELAYS_S, 0.0]
    assert scrub[-1]["created"] < scrub[0]["created"] == res["per_segment"]
    assert all(row["ops"]["create"][0] == 1 for row in scrub)  # one handle each
    out = capsys.readouterr().out
    assert "### The scrub:" in out and "### Where the time goes" in out
