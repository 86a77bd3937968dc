"""The `demo` command of `python -m extensible_kv`: its options, and running it."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from extensible_kv.layouts import KV_LAYOUTS


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds `demo` and its options to the subcommands of `python -m extensible_kv`."""
    demo = commands.add_parser(
        "demo",
        help="decode on an extensible KV cache extended after graph capture; compare to legacy",
    )
    demo.set_defaults(run=run)
    demo.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda:0 if usable, else cpu)")
    demo.add_argument(
        "--layout",
        default="FLASH_ATTN",
        choices=KV_LAYOUTS,
        metavar="LAYOUT",
        help=f"KV cache layout, one of {', '.join(KV_LAYOUTS)} (default FLASH_ATTN, K/V split)",
    )
    demo.add_argument("--hybrid", action="store_true", help="odd layers Mamba-like (in blocks)")
    demo.add_argument("--num-seqs", type=int, default=4, help="sequences decoded together")
    demo.add_argument("--prompt-len", type=int, default=8, help="prompt tokens per sequence")
    demo.add_argument("--steps", type=int, default=40, help="tokens generated per sequence")
    demo.add_argument("--layers", type=int, default=2)
    demo.add_argument("--hidden", type=int, default=128)
    demo.add_argument("--heads", type=int, default=4)
    demo.add_argument("--kv-heads", type=int, default=2)
    demo.add_argument("--vocab", type=int, default=512)
    demo.add_argument("--block-size", type=int, default=16, help="tokens per block")
    demo.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    demo.add_argument("--budget-mib", type=int, default=64, help="host backend: the KV budget")
    demo.add_argument("--max-blocks", type=int, help="cap the commit (default: commit the fit)")
    demo.add_argument("--capacity-gib", type=float, help="first estimate of KV memory")
    demo.add_argument("--seed", type=int, default=0)


def run(options: dict[str, Any]) -> int:
    """Runs the demo with the parsed options; the exit status: 0 when the tokens match."""
    # The flow logs `Extended KV cache to N blocks (X GiB)`: show it with the report.
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s", stream=sys.stdout)

    from extensible_kv._demo import demo  # torch, at run time only: `--help` stays light

    try:
        result = demo.run(demo.DemoOptions(**options))
    except (ValueError, RuntimeError) as error:  # bad options, too small a budget
        print(f"demo: {error}", file=sys.stderr)
        return 2
    print(demo.format_report(result))
    return 0 if result.ok else 1
