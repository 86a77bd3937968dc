"""`python -m decoder` (run from `examples/`): its options, and running it."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import Any

from extensible_kv import _torch
from extensible_kv._demo.cli import at_least as _at_least
from extensible_kv.layouts import KV_LAYOUTS

from decoder.config import ModelConfig


def _budget_mib(text: str) -> int | None:
    """`--budget-mib`: an integer >= 0, or `free` (None: measure `host_free_bytes()`)."""
    return None if text.strip().lower() == "free" else _at_least(0)(text)


def _positive_number(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def _layout(text: str) -> str:
    """`--layout` in any case: the names are upper case."""
    return text.upper()


def parser() -> argparse.ArgumentParser:
    """The example's command line."""
    demo = argparse.ArgumentParser(
        prog="python -m decoder",
        description="Decodes on an extensible KV cache extended after the decode step was "
        "captured, and on a legacy one; exits 0 when the tokens are identical and the decode "
        "used memory the extension mapped, else says why on stderr (1: the check failed, "
        "2: the options cannot work).",
    )
    count = _at_least(1)
    add = demo.add_argument
    model = ModelConfig()
    add("--device", help="cpu, cuda or cuda:N (default: cuda:0 if usable, else cpu)")
    add(
        "--layout",
        default="FLASH_ATTN",
        type=_layout,
        choices=KV_LAYOUTS,
        metavar="LAYOUT",
        help=f"KV cache layout, any case: one of {', '.join(KV_LAYOUTS)} (default: "
        "%(default)s, K/V split)",
    )
    add(
        "--hybrid",
        action="store_true",
        default=model.hybrid,
        help="odd layers Mamba-like, their states in the blocks (default: attention only)",
    )
    add(
        "--num-seqs",
        type=count,
        default=4,
        help="sequences decoded together (default: %(default)s)",
    )
    add(
        "--prompt-len",
        type=count,
        default=8,
        help="prompt tokens per sequence (default: %(default)s)",
    )
    add(
        "--steps",
        type=count,
        default=40,
        help="tokens generated per sequence (default: %(default)s)",
    )
    # The model's options are ModelConfig's fields (`dest`), with its defaults.
    for flag, dest, kind, what in (
        ("--layers", "num_layers", count, "decoder layers"),
        ("--hidden", "hidden_size", count, "hidden size"),
        ("--heads", "num_heads", count, "attention heads"),
        ("--kv-heads", "num_kv_heads", count, "KV heads"),
        ("--vocab", "vocab_size", _at_least(2), "vocabulary size"),
        ("--block-size", "block_size", count, "tokens per block"),
    ):
        default = getattr(model, dest)
        add(flag, dest=dest, type=kind, default=default, help=f"{what} (default: {default})")
    add(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        help="model and cache dtype (default: bfloat16 on a GPU, float32 on the host)",
    )
    add(
        "--budget-mib",
        type=_budget_mib,
        default=64,
        help="host backend: the MiB the KV cache may hold in all, or 'free' for the host's free "
        "memory (MemAvailable and the memory cgroup's room) less the margin "
        "(default: %(default)s)",
    )
    add(
        "--max-blocks",
        type=count,
        help="cap the commit at this many blocks (default: no cap, commit the fit)",
    )
    add(
        "--capacity-gib",
        type=_positive_number,
        help="first estimate of KV memory, which sets the capacity (default: the GPU's memory, "
        "or 1 GiB on the host)",
    )
    add(
        "--seed",
        type=_at_least(0),
        default=model.seed,
        help="weights and prompts (default: %(default)s)",
    )
    return demo


def main(argv: list[str] | None = None) -> int:
    """Parses `argv` (the process's arguments by default) and runs the example."""
    return run(vars(parser().parse_args(argv)))


def run(options: dict[str, Any]) -> int:
    """Runs the demo with the parsed options; the exit status: 0 when the tokens match."""
    # The flow logs `Extended KV cache to N blocks (X GiB)`: show it with the report.
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s", stream=sys.stdout)

    try:
        _torch.require("the demo")
    except ModuleNotFoundError as error:
        print(f"demo: {error}", file=sys.stderr)
        return 2
    from decoder import demo  # torch, at run time only: `--help` needs none

    try:
        result = demo.run(demo.DemoOptions().updated(**options))
    except (ValueError, RuntimeError) as error:  # bad options, too small a budget
        print(f"demo: {error}", file=sys.stderr)
        return 2
    print(demo.format_report(result))
    failure = demo.failure_reason(result)
    if failure is not None:
        print(f"demo: {failure}", file=sys.stderr)
        return 1
    return 0
