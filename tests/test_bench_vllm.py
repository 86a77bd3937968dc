"""benchmarks/bench_vllm.py runs end to end (on the host backend, ours alone): it cannot rot
between GPU runs. Nothing here is timed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support import bench_scripts

pytestmark = pytest.mark.vllm


def test_bench_vllm_smoke(vllm: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = bench_scripts.load("bench_vllm")
    argv = ["--out", str(tmp_path), "--device", "cpu", "--quick", "--pause", "0", "--profile"]
    assert bench.main(argv) == 0
    results = json.loads((tmp_path / "bench_vllm.json").read_text())
    assert len(results["cases"]) == 2
    for entry in results["cases"].values():
        assert entry["blocks"] > 0
        for kind in ("ours", "ours_runs"):
            assert entry[kind]["one_chunk_per_segment"] is True
            assert entry[kind]["chunks_after_defragment"] <= entry["segments"]
            assert all(entry[kind][step] > 0 for step in bench.STEPS)
        for run in entry["runs"]["ours"]:  # --profile: our driver calls, per step
            assert {"reserve", "create", "map"} <= set(run["ops"]["allocate"])
            assert run["ops"]["free"]["release"][0] == entry["ours"]["chunks_after_defragment"]
    out = capsys.readouterr().out
    assert "| extend |" in out and "Driver calls (calls/host ms):" in out


def test_bench_vllm_cases_picks_by_name(vllm: Any, tmp_path: Path) -> None:
    bench = bench_scripts.load("bench_vllm")
    argv = ["--out", str(tmp_path), "--device", "cpu", "--reps", "1", "--pause", "0"]
    argv += ["--budget-gib", "0.25", "--cases", "BLNHC"]
    assert bench.main(argv) == 0
    results = json.loads((tmp_path / "bench_vllm.json").read_text())
    assert list(results["cases"]) == ["Llama-3-8B, BLNHC (block-outermost: one segment)"]
    with pytest.raises(SystemExit):
        bench.main([*argv[:-1], "no such case"])


def test_bench_vllm_steps_smoke(
    vllm: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench_vllm_steps.py runs both pools on vLLM's manager (the plugin switched between
    them, and left registered), both prefix-caching modes, the hook's costs and a grow."""
    from extensible_kv.vllm.block_pool import ResizableBlockPool
    from vllm.v1.core import kv_cache_coordinator

    bench = bench_scripts.load("bench_vllm_steps")
    assert bench.main(["--out", str(tmp_path), "--quick"]) == 0
    results = json.loads((tmp_path / "bench_vllm_steps.json").read_text())
    for key in ("no prefix caching", "prefix caching"):
        entry = results[key]
        assert len(entry["runs_us"]["vllm"]) == len(entry["runs_us"]["ours"]) == 2
        assert all(t > 0 for runs in entry["runs_us"].values() for t in runs)
        assert entry["ratio"] == entry["step_us"]["ours"] / entry["step_us"]["vllm"]
    assert results["hook"]["pool_quiet_serve_us"] > 0 and results["grow"]["pool_grow_us"] > 0
    assert kv_cache_coordinator.BlockPool is ResizableBlockPool
    assert "| prefix caching |" in capsys.readouterr().out
