"""The `demo` command of `python -m extensible_kv`: its options, and running it. Imports
neither torch nor transformers, so that `--help` works without them."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

from extensible_kv import _torch

DEMO_EXTRA = "pip install '.[demo]'"


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`, else an error naming the range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


def _budget_mib(text: str) -> int | None:
    """`--budget-mib`: an integer >= 1, or `free` (None: measure `host_free_bytes()`)."""
    return None if text.strip().lower() == "free" else at_least(1)(text)


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds `demo` and its options to the subcommands of `python -m extensible_kv`."""
    demo = commands.add_parser(
        "demo",
        help="serve a model with transformers' continuous batching on its own KV cache and on "
        "extensible-kv's; compare",
        description="Serves the same greedy requests with transformers' continuous batching "
        "on its own KV cache and on extensible-kv's (sized after the warm-up, released and "
        "resumed in place), prints blocks, memory, start-up, tokens/s and release + resume "
        "against re-creating the manager; exits 0 when the tokens are identical (1: they are "
        "not, 2: the options or the environment cannot work). A model built from a config "
        "with random weights: an 8B shape on a GPU (CUDA graphs), a tiny one on the host "
        "backend.",
    )
    demo.set_defaults(run=run)
    count = at_least(1)
    add = demo.add_argument
    add("--device", help="cpu, cuda or cuda:N (default: cuda:0 if usable, else cpu)")
    add("--model", choices=["llama", "qwen3"], default="llama", help="shape (default: llama)")
    add(
        "--sliding-window",
        type=count,
        metavar="TOKENS",
        help="every other layer a sliding window of this many tokens (default: none)",
    )
    add("--layers", type=count, help="decoder layers (default: the shape's; 2 on the host)")
    add("--attn", choices=["sdpa", "eager"], default="sdpa", help="attention (default: sdpa)")
    add("--prompts", type=count, help="requests (default: 64 on a GPU, 8 on the host)")
    add("--new-tokens", type=count, help="greedy tokens per request (default: 128 / 16)")
    add("--min-prompt", type=count, help="shortest prompt, tokens (default: 64 / 5)")
    add("--max-prompt", type=count, help="longest prompt, tokens (default: 512 / 40)")
    add("--max-batch-tokens", type=count, help="transformers' (default: its own / 64)")
    add(
        "--num-blocks",
        type=count,
        help="cap both caches at this many blocks (default: none on a GPU, 64 on the host, "
        "where transformers' own sizing would take 60%% of the host's memory)",
    )
    add(
        "--budget-mib",
        type=_budget_mib,
        default=64,
        help="host backend: the MiB extensible-kv's cache may hold in all, or 'free' for the "
        "host's free memory less the margin (default: %(default)s)",
    )
    add("--seed", type=at_least(0), default=0, help="weights and prompts (default: 0)")
    add("--no-progress", dest="progress", action="store_false", help="no progress line")


def run(options: dict[str, Any]) -> int:
    """Runs the demo with the parsed options; the exit status: 0 when the tokens match."""
    # Our integration logs `Extended KV cache to N blocks (X GiB)`: show it with the report
    # (ours alone: transformers' INFO lines are its own). Only in a program that configured no
    # logging, as `python -m` is: one that did (pytest, an application) keeps its settings.
    if not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        ours = logging.getLogger("extensible_kv")
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False
    try:
        _torch.require("the demo")
        import transformers  # noqa: F401
    except ModuleNotFoundError as error:
        needs = f"the demo needs torch and transformers: {DEMO_EXTRA}"
        print(f"demo: {error}; {needs}", file=sys.stderr)
        return 2
    from extensible_kv._demo import serve  # torch and transformers, at run time only

    try:
        result = serve.run(serve.DemoOptions(**options))
    except (ValueError, RuntimeError, MemoryError) as error:  # bad options, too small a budget
        print(f"demo: {error}", file=sys.stderr)
        return 2
    print(serve.format_report(result))
    return 0 if result.identical else 1
