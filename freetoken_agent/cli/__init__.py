"""The ``freetoken`` command line: the front door above everything.

Each sub-command lives in its own module of this package and exposes ``register(subparsers)``; the module
adds its parser and sets ``func`` (``(args) -> int``) as the default. Registration must stay cheap: heavy
imports (torch, the engine) happen inside ``func``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

# Sub-command modules, in the order ``freetoken --help`` lists them.
COMMANDS = ["inspect", "generate", "eval", "run", "serve", "launch", "replay", "bench", "acp", "doctor", "plan"]


class CLIError(Exception):
    """An error the CLI reports as one clear line (exit status 2), never a traceback."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line like every other CLI error (sub-command parsers inherit it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="freetoken", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"freetoken_agent.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a usage error (its one line already printed) or --help: main returns the status
        return exc.code if isinstance(exc.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from freetoken_agent.runtime.errors import FreeTokenError

    try:
        return int(args.func(args) or 0)
    except (CLIError, FreeTokenError) as exc:
        print(f"freetoken {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
