"""``freetoken bench ROW [options]``: run one benchmark row of the harness (``evals/perf/harness.py``).

``freetoken bench list`` lists the rows; ``freetoken bench ROW --help`` shows a row's flags; every run is appended to
the history (``evals/perf/results.jsonl``, ``--no-record`` to skip) and ``LATEST.md`` beside it is regenerated;
``freetoken bench latest`` regenerates it alone. ``freetoken bench --quick`` is ``freetoken bench suite --quick``.

Registration stays cheap: the rows (and torch) are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from freetoken_agent.cli import CLIError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="performance benchmarks: `freetoken bench list`, `freetoken bench ROW`",
                       description=__doc__.splitlines()[0])
    p.add_argument("row", nargs="?", metavar="ROW", help="a row name, `list` or `latest`")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the row's flags (`freetoken bench ROW --help`)")
    p.add_argument("--quick", action="store_true", help="with no ROW: the suite in its quick form")
    p.add_argument("--json", action="store_true", help="with no ROW: print the suite's JSON report")
    p.add_argument("--trajectories", default=None, metavar="DIR", help="with no ROW: the suite's replay sessions")
    p.set_defaults(func=_bench)


def _list() -> int:
    from freetoken_agent.evals.perf import harness

    rows = harness.load_rows()
    width = max(map(len, rows))
    for name, r in rows.items():
        print(f"{name:<{width}}  {r.description}")
    return 0


def _latest(rest: list[str]) -> int:
    from freetoken_agent.evals.perf import history

    p = argparse.ArgumentParser(prog="freetoken bench latest", description="regenerate LATEST.md from the history")
    p.add_argument("--history", type=Path, default=None, help="history file (default: evals/perf/results.jsonl)")
    p.add_argument("--out", type=Path, default=None, help="where the table goes (default: LATEST.md beside it)")
    args = p.parse_args(rest)
    try:
        print(history.write_latest(args.history, args.out))
    except (OSError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    return 0


def _bench(args: argparse.Namespace) -> int:
    from freetoken_agent.evals.perf import harness

    if args.row is None:
        if not args.quick:
            raise CLIError("choose a row: `freetoken bench list` shows them (or --quick for the suite)")
        name, rest = "suite", ["--quick"] + (["--json"] if args.json else []) + (
            ["--trajectories", args.trajectories] if args.trajectories else [])
    else:
        name, rest = args.row, list(args.rest)
    if name == "list":
        return _list()
    if name == "latest":
        return _latest(rest)
    try:
        return harness.cli(name, rest, f"freetoken bench {name}", record_default=True)
    except harness.BenchError as exc:
        raise CLIError(str(exc)) from None
    except KeyboardInterrupt:
        print("interrupted: nothing recorded", file=sys.stderr)
        return 130
