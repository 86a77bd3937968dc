"""`python -m extensible_kv COMMAND`: `demo` (`extensible_kv._demo`) and `pool`
(`extensible_kv.pool.cli`); `--version` prints the installed version."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from extensible_kv._demo import cli as demo_cli
from extensible_kv.pool import cli as pool_cli


class _Parser(argparse.ArgumentParser):
    """Refuses a bad command line in one line on stderr, exit status 2 (argparse's own adds
    the usage, which `--help` shows)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (--help shows the usage)\n")


def _parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("extensible-kv")
    except PackageNotFoundError:  # imported from a source tree, not installed
        installed = "unknown (not installed)"
    parser: argparse.ArgumentParser = _Parser(prog="python -m extensible_kv")
    parser.add_argument("--version", action="version", version=f"extensible-kv {installed}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_cli.add_command(commands)
    pool_cli.add_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    del args["command"]
    run = args.pop("run")
    return int(run(args))


if __name__ == "__main__":
    sys.exit(main())
