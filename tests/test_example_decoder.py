"""The seed's demo, now the example `examples/decoder` (`python -m decoder` from `examples/`):
greedy decoding on an extensible cache extended
after the decode step was captured gives the same tokens as on a legacy cache, for a K/V-split
layout, block-major layouts and the hybrid model, and uses blocks committed by the extension.

Host runs are in-process and small. On a GPU the decode step is a CUDA graph captured with one
block committed and replayed after the extension (capped at 65,536 blocks, to keep the suite
light: the command itself commits the fit).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from typing import Any

import extensible_kv
import pytest
import torch
from decoder import demo
from decoder.cli import main
from decoder.config import ModelConfig
from decoder.model import DecodeInputs

SMALL_MODEL = ModelConfig(hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=128)
SMALL = demo.DemoOptions(
    device="cpu",
    num_seqs=3,
    prompt_len=5,
    steps=28,
    model=SMALL_MODEL,
    budget_mib=1,
    granularity=4096,
)
CASES: dict[str, dict[str, Any]] = {
    "FLASH_ATTN": {},  # K/V split: 2 segments per buffer
    "FLASHINFER": {"layout": "FLASHINFER"},  # block-major (B, 2, N, H, D): 1 segment
    "LHBNC": {"layout": "LHBNC", "num_layers": 3},  # standard vocabulary: L x H segments
    "hybrid": {"hybrid": True, "num_layers": 4},  # attention + Mamba-like, pages shared
}


def test_updated_sends_the_models_names_to_the_model() -> None:
    options = demo.DemoOptions().updated(hidden_size=64, num_layers=3, steps=9, layout="LHBNC")
    assert (options.steps, options.layout) == (9, "LHBNC")
    assert (options.model.hidden_size, options.model.num_layers) == (64, 3)
    assert options.model.ffn_size == 128  # twice the hidden size, as the new hidden size
    assert SMALL.updated(num_layers=4).model == dataclasses.replace(SMALL_MODEL, num_layers=4)
    with pytest.raises(TypeError):
        SMALL.updated(no_such_option=1)


def _check(result: demo.DemoResult) -> None:
    assert result.identical, (result.extensible.tokens, result.legacy.tokens)
    assert result.used_new_blocks and result.ok
    ext, legacy = result.extensible, result.legacy
    assert ext.report.blocks_before == 1 and ext.report.blocks_after >= result.blocks_needed
    # Spread from block 1 to the last committed one; most in memory the extension mapped.
    assert len(ext.blocks_used) == result.blocks_needed - 1
    assert ext.blocks_used[0] == 1 and ext.blocks_used[-1] == ext.report.blocks_after - 1
    assert ext.blocks_in_new_memory > len(ext.blocks_used) // 2
    assert legacy.report.legacy and legacy.capacity_blocks == result.blocks_needed
    assert legacy.blocks_used == tuple(range(1, result.blocks_needed))
    assert all(len(seq) == result.options.prompt_len + result.options.steps for seq in ext.tokens)
    # The prompts were fed, not generated, and the model did not collapse to one token.
    assert len({token for seq in ext.tokens for token in seq[result.options.prompt_len :]}) > 4


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_host_decode_is_identical(overrides: dict[str, Any]) -> None:
    result = demo.run(SMALL.updated(**overrides))
    _check(result)
    assert not result.extensible.graph_captured
    if overrides.get("hybrid"):
        assert result.block_size == 16 and result.extensible.num_segments == (1, 1)


def test_layouts_give_their_segments() -> None:
    kv_split = demo.run(SMALL)
    assert kv_split.extensible.num_segments == (2, 2)
    assert kv_split.extensible.report.bytes_before == 4 * 4096  # a granule per segment


def test_command_prints_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--device", "cpu", "--num-seqs", "2", "--steps", "20", "--hidden", "64"]
    assert main([*args, "--budget-mib", "8", "--layout", "FLASHINFER"]) == 0
    out = capsys.readouterr().out
    for expected in (
        "device:    cpu (host backend",
        "layout:    FLASHINFER, 2 buffer(s), segments per buffer: 1, 1",
        "graph:     none: eager on the host",
        "of them in memory the extension mapped",
    ):
        assert expected in out
    assert out.rstrip().endswith("identical: yes")


def test_different_tokens_exit_non_zero(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The extensible run's sequences alias each other's blocks: their K/V clobber each other.
    real_run_path, real_load = demo._run_path, DecodeInputs.load

    def aliased_load(self: DecodeInputs, *args: Any) -> None:
        tokens, positions, tables, states, block_size = args
        real_load(self, tokens, positions, [tables[0]] * len(tables), states, block_size)

    def run_path(*args: Any, legacy: bool) -> demo.PathResult:
        with monkeypatch.context() as patch:
            if not legacy:
                patch.setattr(DecodeInputs, "load", aliased_load)
            return real_run_path(*args, legacy=legacy)

    monkeypatch.setattr(demo, "_run_path", run_path)
    assert main(["--device", "cpu", "--num-seqs", "3", "--steps", "20"]) == 1
    captured = capsys.readouterr()
    assert captured.out.rstrip().endswith("identical: no")
    assert captured.err.startswith("demo: the extensible cache's tokens differ"), captured.err


def test_the_library_namespace_holds_no_demo() -> None:
    # A serving stack imports the library: neither the demo nor torch come with it.
    code = (
        "import sys, extensible_kv; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' "
        "or m.startswith('extensible_kv._demo') or m.split('.')[0] == 'decoder'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert not {"demo", "model"} & set(dir(extensible_kv))


def test_too_small_a_budget_is_an_error() -> None:
    with pytest.raises(RuntimeError, match=r"the cache holds \d+ blocks; this decode needs"):
        demo.run(dataclasses.replace(SMALL, budget_mib=0))


# ---------------------------------------------------------------------------------------------
# CUDA: the graph is captured before the extension and replayed after it


GPU_CASES = {k: v for k, v in CASES.items() if k != "LHBNC"}


@pytest.mark.gpu
@pytest.mark.parametrize("overrides", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_cuda_graph_replays_into_extended_blocks(overrides: dict[str, Any]) -> None:
    options = demo.DemoOptions(device="cuda:0", max_blocks=1 << 16, steps=48).updated(**overrides)
    result = demo.run(options)
    _check(result)
    ext, legacy = result.extensible, result.legacy
    assert ext.graph_captured and legacy.graph_captured
    assert ext.backend == "cuda" and result.dtype == torch.bfloat16
    assert ext.report.blocks_after == 1 << 16 and ext.report.budget_source == "cuda mem_get_info"
    assert ext.replays == options.prompt_len + options.steps - 1


# ---------------------------------------------------------------------------------------------
# the command line: ranges, defaults, and a reason for every non-zero exit

FAST = ["--device", "cpu", "--num-seqs", "2", "--steps", "20", "--hidden", "64"]


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        (["--budget-mib", "1"], r"--budget-mib 1\b.*raise --budget-mib"),
        (["--budget-mib", "0"], r"--budget-mib 0\b.*raise --budget-mib"),
        (["--capacity-gib", "0.001"], r"capacity of \d+ blocks.*raise --capacity-gib"),
        (["--budget-mib", "64", "--max-blocks", "2"], r"this decode needs \d+"),
    ],
    ids=["budget-1", "budget-0", "capacity-0.001", "max-blocks-2"],
)
def test_every_non_zero_exit_says_why_on_stderr(
    options: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main([*FAST, *options])
    err = capsys.readouterr().err
    assert status != 0
    assert err.startswith("demo: "), err
    assert re.search(reason, err, re.S), err


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--budget-mib", "-5", "an integer >= 0"),
        ("--num-seqs", "0", "an integer >= 1"),
        ("--steps", "-1", "an integer >= 1"),
        ("--capacity-gib", "0", "a number > 0"),
        ("--capacity-gib", "nan", "a number > 0"),
        ("--max-blocks", "0", "an integer >= 1"),
        ("--block-size", "x", "an integer >= 1"),
    ],
)
def test_out_of_range_options_are_refused_with_the_range(
    option: str, value: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*FAST, option, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: must be {expected}, got {value!r}" in err, err


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    options = capsys.readouterr().out.split("options:")[1]
    entries = re.split(r"\n  (?=-)", options)[1:]  # one per option, wrapped lines included
    assert len(entries) == 18, entries
    for entry in entries:
        if not entry.startswith("-h"):
            assert "default" in entry, entry


def test_layout_takes_any_case(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*FAST, "--budget-mib", "8", "--layout", "flashinfer"]) == 0
    assert "layout:    FLASHINFER," in capsys.readouterr().out
