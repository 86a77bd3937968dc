"""`python -m extensible_kv COMMAND`: the one command is `demo` (`extensible_kv._demo`)."""

from __future__ import annotations

import argparse
import sys

from extensible_kv._demo import cli as demo_cli


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m extensible_kv")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_cli.add_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    del args["command"]
    run = args.pop("run")
    return int(run(args))


if __name__ == "__main__":
    sys.exit(main())
