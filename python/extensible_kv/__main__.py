"""`python -m extensible_kv demo`: see `extensible_kv.demo`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m extensible_kv")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="grow a segmented tensor in lockstep and check it")
    demo.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda:0 if usable, else cpu)")
    demo.add_argument("--capacity-gib", type=float, default=2.0, help="address space to reserve")
    demo.add_argument("--grow-mib", type=int, default=256, help="bytes per segment to commit")
    args = parser.parse_args(argv)

    from extensible_kv import demo as demo_module

    return demo_module.run(
        args.device, int(args.capacity_gib * (1 << 30)), args.grow_mib * (1 << 20)
    )


if __name__ == "__main__":
    sys.exit(main())
