"""benchmarks/bench_shrink.py and bench_layouts.py run end to end on the host backend (small
sizes): they cannot rot between GPU runs. Nothing here is timed. (bench_vllm's and
bench_sglang's smoke tests live with their stack's tests: they need the stack.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support import bench_scripts


def test_bench_shrink_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = bench_scripts.load("bench_shrink")
    argv = ["--out", str(tmp_path), "--device", "cpu", "--reps", "1", "--profile", "--scrub"]
    argv.append("--steps")
    assert bench.main(argv) == 0
    res = json.loads((tmp_path / "bench_shrink.json").read_text())
    assert all(run["ok"] for step in ("plain", "exact", "consolidate") for run in res[step])
    (consolidated,) = res["consolidate"]
    assert consolidated["handles"][1] == 4 < consolidated["handles"][0]
    assert consolidated["ops"]["copy"][0] == 4  # one copy per segment, profiled
    # The old handles' teardown alone: every one of them unmapped and released, nothing copied.
    teardown = consolidated["old_teardown_ops"]
    assert teardown["release"][0] == consolidated["handles"][0] and "copy" not in teardown
    assert consolidated["old_teardown_ms"] > 0
    scrub = res["scrub"]
    assert [row["delay_s"] for row in scrub] == [*bench.SCRUB_DELAYS_S, 0.0]
    assert scrub[-1]["created"] < scrub[0]["created"] == res["per_segment"]
    assert all(row["ops"]["create"][0] == 1 for row in scrub)  # one handle each
    steps = res["steps"]
    assert [run["gap_s"] for run in steps] == [0.0, 0.01]
    assert all(len(run["steps"]) == res["segments"] for run in steps)
    assert all(row["create_ms"] > 0 and row["copy_ms"] > 0 for run in steps for row in run["steps"])
    out = capsys.readouterr().out
    assert "### The scrub:" in out and "### Where the time goes" in out
    assert "### Consolidate's steps one at a time" in out


def only_shape(out: Path) -> dict[str, Any]:
    """The one shape's results bench_layouts wrote to `out`."""
    (shape,) = (
        v
        for k, v in json.loads((out / "bench_layouts.json").read_text()).items()
        if k != "settings"
    )
    return dict(shape)


def test_bench_layouts_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = bench_scripts.load("bench_layouts")
    argv = ["--out", str(tmp_path), "--device", "cpu", "--reps", "1", "--no-read"]
    argv += ["--shapes", "llama3_70b_tp8", "--contenders", "ours,ours:whole_runs,floor,pages"]
    assert bench.main(argv) == 0
    shape = only_shape(tmp_path)
    runs = shape["contenders"]
    assert shape["segments"] == 80
    # One handle per segment's run for whole runs and pages; the default cut makes no fewer.
    assert runs["pages"]["handles"] == runs["ours:whole_runs"]["handles"] <= runs["ours"]["handles"]
    for name in ("ours", "ours:whole_runs", "pages"):
        assert runs[name]["create_ms"][0] > 0 and "create" in runs[name]["ops"]
        assert "memset" in runs[name]["ops"] or name == "pages"  # pages are not zeroed
    assert runs["floor"]["steady_ms"][0] > 0
    assert "| it / (pages + floor) |" in capsys.readouterr().out


def test_bench_layouts_fresh_runs_each_repetition_in_a_child(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--fresh`: every repetition comes back from a process of its own (its driver calls
    counted there), with the parent's geometry, and no just-freed repetition follows."""
    bench = bench_scripts.load("bench_layouts")
    argv = ["--out", str(tmp_path), "--device", "cpu", "--reps", "2", "--no-read", "--fresh"]
    argv += ["--shapes", "llama3_70b_tp8_blnhc", "--contenders", "ours,floor,pages"]
    assert bench.main(argv) == 0
    shape = only_shape(tmp_path)
    assert shape["fresh"] is True
    runs = shape["contenders"]
    for name in ("ours", "pages"):
        assert len(runs[name]["steady_ms"]) == 2 and "just_freed_ms" not in runs[name]
        assert 0 < runs[name]["ops"]["create"][0] <= runs[name]["handles"]  # the extend's
    assert "memset" in runs["ours"]["ops"] and "memset" not in runs["pages"]["ops"]
    assert len(runs["floor"]["steady_ms"]) == 2
    assert "; a fresh process per repetition" in capsys.readouterr().out


def test_bench_layouts_fresh_child_reports_its_failure(tmp_path: Path) -> None:
    """A child that fails is that contender's error in the report, not a lost run."""
    bench = bench_scripts.load("bench_layouts")
    argv = ["--out", str(tmp_path), "--device", "cpu", "--reps", "1", "--no-read", "--fresh"]
    argv += ["--shapes", "llama3_70b_tp8_blnhc", "--contenders", "ours:no_such_cut"]
    assert bench.main(argv) == 0
    shape = only_shape(tmp_path)
    error = shape["contenders"]["ours:no_such_cut"]["error"]
    assert error.startswith("RuntimeError: ours:no_such_cut's fresh process failed")
    assert "no_such_cut" in error.partition("failed")[2]


def test_bench_lend_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Process A hands memory to process B five ways (fresh processes per repetition): B
    reads A's bytes after every hand-off that keeps them, zeros after a zeroed one."""
    bench = bench_scripts.load("bench_lend")
    argv = ["--out", str(tmp_path), "--device", "cpu", "--sizes-mib", "4", "--reps", "1"]
    assert bench.main(argv) == 0
    res = json.loads((tmp_path / "bench_lend.json").read_text())
    assert list(res["sizes"]) == [str(4 << 20)]
    for ways in res["sizes"].values():
        assert list(ways) == bench.WAYS  # no decode loop on the host backend
        for way in ("handoff_first", "handoff_cached", "handoff_zeroed"):
            assert ways[way]["checksum_ok"] == [True], way
        assert all(ways[w]["median_wall_ms"] > 0 for w in bench.WAYS)
    assert "### " in capsys.readouterr().out


def test_bench_elastic_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The decode loop runs through all three phases with the resizer cycling, every shrink's
    memory is released, and the bursty trace serves identical tokens on both caches."""
    pytest.importorskip("transformers")
    bench = bench_scripts.load("bench_elastic")
    argv = [
        "--out", str(tmp_path), "--device", "cpu", "--phase-s", "0.3", "--resize-gib", "8",
        "--bursts", "2", "--gap-s", "0.5", "--idle-s", "0.2", "--min-blocks", "2",
    ]  # fmt: skip
    assert bench.main(argv) == 0
    res = json.loads((tmp_path / "bench_elastic.json").read_text())
    decode = res["decode"]
    assert {"quiet", "ours", "synchronize"} <= set(decode["steps"])
    assert all(decode["steps"][p]["n"] > 0 for p in ("quiet", "ours", "synchronize"))
    for phase in ("ours", "synchronize"):
        calls = decode[f"{phase}_calls"]
        assert calls["grow_ms"]["n"] > 0 and calls["shrink_ms"]["n"] > 0
        assert calls["released_after_ms"]["n"] == calls["shrink_ms"]["n"]
    assert decode["release_physical"]["bytes"] == 8 << 20
    serve = res["serve"]
    assert serve["identical"] is True
    assert serve["auto"]["blocks_seen"][0] < serve["fixed"]["blocks_seen"][0]
    assert "### Bursty trace" in capsys.readouterr().out
