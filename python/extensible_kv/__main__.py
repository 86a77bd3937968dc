"""`python -m extensible_kv demo`: see `extensible_kv.demo`."""

from __future__ import annotations

import argparse
import logging
import sys


def _parser() -> argparse.ArgumentParser:
    from extensible_kv.model import KV_LAYOUTS

    parser = argparse.ArgumentParser(prog="python -m extensible_kv")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="decode on an extensible KV cache extended after graph capture; compare to legacy",
    )
    demo.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda:0 if usable, else cpu)")
    demo.add_argument(
        "--layout",
        default="FLASH_ATTN",
        choices=KV_LAYOUTS,
        metavar="LAYOUT",
        help=f"KV cache layout, one of {', '.join(KV_LAYOUTS)} (default FLASH_ATTN, K/V split)",
    )
    demo.add_argument("--hybrid", action="store_true", help="odd layers Mamba-like (state pages)")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    args.pop("command")
    # The flow logs `Extended KV cache to N blocks (X GiB)`: show it with the report.
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s", stream=sys.stdout)

    from extensible_kv import demo

    try:
        result = demo.run(demo.DemoOptions(**args))
    except (ValueError, RuntimeError) as error:  # bad options, too small a budget
        print(f"demo: {error}", file=sys.stderr)
        return 2
    print(demo.format_report(result))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
