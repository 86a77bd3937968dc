"""The main job (`python -m extensible_kv demo`): transformers' continuous batching served on
its own KV cache and on ours gives identical tokens, before and after release + resume, for
the Llama- and Qwen3-shaped models and with sliding-window layers; the report has every figure;
each non-zero exit says why. Host runs are small and in-process; `test_readme.py` runs the
command as the README gives it, and on a GPU the defaults use CUDA graphs.

Skipped, with the reason, where transformers >=5.18,<5.26 is absent; CI sets
EKV_REQUIRE_TRANSFORMERS=1, which turns the skip into a failure.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
from support import transformers_fixtures

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("tf")]

# transformers, or the skip that says why not (`support.transformers_fixtures`).
tf = transformers_fixtures.tf

FAST = ["demo", "--device", "cpu", "--prompts", "3", "--new-tokens", "6", "--max-prompt", "20"]


def demo(*args: str) -> int:
    from extensible_kv.__main__ import main

    return main([*FAST, *args])


@pytest.mark.parametrize(
    "options",
    [[], ["--model", "qwen3"], ["--sliding-window", "8"], ["--model", "qwen3", "--attn", "eager"]],
    ids=["llama", "qwen3", "sliding", "qwen3-eager"],
)
def test_the_demo_serves_identical_tokens(
    options: list[str], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="extensible_kv")
    assert demo(*options) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("identical: yes")
    # In a process of its own the line is on stdout (test_readme.py); here pytest holds it.
    assert any(r.getMessage().startswith("Extended KV cache to ") for r in caplog.records)
    for row in (
        "KV cache blocks",
        "KV cache (GiB)",
        "free memory after start-up (GiB)",
        "start-up (ms)",
        "tokens/s",
        "give the KV memory back and take it again (ms)",
    ):
        line = next(line for line in out.splitlines() if line.startswith(row))
        assert len(re.findall(r"\d", line)) >= 2, line  # both caches have a figure
    assert re.search(r"\d+ blocks after the warm-up, extended to \d+", out)
    model = (
        "Qwen3" if "qwen3" in options else ("Qwen2" if "--sliding-window" in options else "Llama")
    )
    assert f"model: {model} 2 layers" in out


def test_the_demo_runs_the_transformers_integration() -> None:
    from extensible_kv._demo import serve

    result = serve.run(serve.DemoOptions(device="cpu", prompts=3, new_tokens=4, progress=False))
    assert result.identical
    assert result.options.num_blocks == 64  # the host's cap, for both caches
    assert result.ours.blocks == result.own.blocks == 64
    assert result.ours.extra["budget_asked_bytes"] == 64 << 20
    assert result.ours.extra["released_gib"] < result.ours.gib or result.ours.gib <= 2 / 1024
    assert len(result.own.tokens) == 3 and all(len(t) == 4 for t in result.own.tokens)


def test_different_tokens_exit_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from extensible_kv._demo import serve

    real = serve.run_extensible

    def clobbered(*args: Any) -> serve.Contender:
        row = real(*args)
        row.tokens = [[t + 1 for t in tokens] for tokens in row.tokens]
        return row

    monkeypatch.setattr(serve, "run_extensible", clobbered)
    assert demo() == 1
    assert capsys.readouterr().out.rstrip().endswith("identical: no")


def test_a_budget_that_holds_no_block_exits_two(capsys: pytest.CaptureFixture[str]) -> None:
    # The host's granule is 2 MiB: 1 MiB cannot hold the trash sectors and one block.
    assert demo("--budget-mib", "1") == 2
    err = capsys.readouterr().err
    assert err.startswith("demo: the KV cache would hold no block: budget_bytes=1048576"), err


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--prompts", "0", "an integer >= 1"),
        ("--budget-mib", "0", "an integer >= 1"),
        ("--sliding-window", "x", "an integer >= 1"),
        ("--seed", "-1", "an integer >= 0"),
    ],
)
def test_out_of_range_options_are_refused_with_the_range(
    option: str, value: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        demo(option, value)
    assert exit_info.value.code == 2
    assert f"argument {option}: must be {expected}, got {value!r}" in capsys.readouterr().err


def test_help_shows_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    from extensible_kv.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--model", "--sliding-window", "--budget-mib", "--num-blocks", "--device"):
        assert option in out
