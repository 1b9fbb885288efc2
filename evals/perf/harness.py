"""The benchmark harness: every benchmark in ``evals/perf`` is a row, run as ``freetoken bench ROW [options]``.

A row is a function ``(args) -> report`` (a JSON-able dict) registered with ``@row(name, description, options)``
in the module that owns the benchmark; ``options`` adds the row's flags to its parser. ``load_rows`` imports the
modules in ``ROW_MODULES`` (registration happens at import) and returns the registry.

``cli`` parses a row's flags; ``run_row`` records the machine (``machine.facts``: CPU, flags, cores, memory, load
average, and the read bandwidth measured in the same run), runs the row and returns a ``Record``; ``freetoken bench`` appends
every record to the history (``history.py``: ``results.jsonl``, and the generated ``LATEST.md`` beside it). A row's
module keeps its ``python -m`` entry point through ``module_main``, which prints the same report and records only with
``--record``.

Rows whose module owns a command line of its own (``passthrough=True``) receive the flags they do not declare in
``args.passthrough`` and hand them to that parser.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

Report = dict[str, Any]

ROW_MODULES = (
    "bench_kernels", "bench_decode", "suite_prefill", "suite_replay", "suite_budget", "suite", "bench_concurrent",
    "agent_replay", "residency_bench", "bench_kv_dtype", "phase_replay", "phase_live", "bench_speculative",
    "bench_constrained", "bench_overhead", "bench_batch", "load_memory", "quantize_rate", "bench_triton", "gpu_check",
    "routing_report", "agent_session", "moe_layer", "attn_builds", "amx_epilogue", "weight_builds", "bench_stored16",
)  # fmt: skip
"""Modules of ``freetoken_agent.evals.perf`` that register rows."""


class BenchError(Exception):
    """Bad input to a row (a flag out of range, a missing model or peer): one line for the user."""


@dataclass(frozen=True)
class Row:
    """One registered benchmark."""

    name: str
    description: str
    """One line: what the row measures (``freetoken bench list``)."""
    run: Callable[[argparse.Namespace], Report]
    options: Callable[[argparse.ArgumentParser], None] | None = None
    """Adds the row's flags to its parser."""
    format: Callable[[Report, argparse.Namespace], str] | None = None
    """The report as text (the default output), given the row's flags; None prints the JSON."""
    headline: Callable[[Report], dict[str, Any]] | None = None
    """The few numbers the generated table shows; None: the report's top-level numbers and strings."""
    passthrough: bool = False
    """Flags the row does not declare go to ``args.passthrough`` (for a module's own parser)."""
    check: Callable[[Report], bool] | None = None
    """A property every good run has (e.g. budgets respected); a run without it exits with status 1."""
    module: str = ""


ROWS: dict[str, Row] = {}


def row(name: str, description: str, options: Callable[[argparse.ArgumentParser], None] | None = None, *,
        format: Callable[[Report, argparse.Namespace], str] | None = None, headline: Callable[[Report], dict[str, Any]] | None = None,
        passthrough: bool = False, check: Callable[[Report], bool] | None = None) -> Callable[[Callable[[argparse.Namespace], Report]], Callable[..., Report]]:
    """Register the decorated ``(args) -> report`` function as row ``name``."""

    def register(fn: Callable[[argparse.Namespace], Report]) -> Callable[[argparse.Namespace], Report]:
        if fn.__module__ == "__main__":  # ``python -m``: the row registers from the package's own import
            return fn
        existing = ROWS.get(name)
        if existing is not None and existing.module != fn.__module__:
            raise ValueError(f"row {name!r} is registered twice: {existing.module} and {fn.__module__}")
        ROWS[name] = Row(name, description, fn, options, format, headline, passthrough, check, fn.__module__)
        return fn

    return register


def load_rows() -> dict[str, Row]:
    """Every registered row (importing the modules of ``ROW_MODULES``), in registration order."""
    for module in ROW_MODULES:
        importlib.import_module(f"freetoken_agent.evals.perf.{module}")
    return ROWS


def get(name: str) -> Row:
    rows = load_rows()
    if name not in rows:
        raise BenchError(f"no benchmark row {name!r}; rows: {', '.join(rows)}")
    return rows[name]


@dataclass
class Record:
    """One run of one row, as the history keeps it."""

    row: str
    command: str
    date: str
    machine: dict[str, Any]
    options: dict[str, Any]
    headline: dict[str, Any]
    report: Report
    wall_s: float
    version: int = 1
    tags: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def default_headline(report: Report, limit: int = 8) -> dict[str, Any]:
    """The report's top-level numbers and short strings, at most ``limit``."""
    out: dict[str, Any] = {}
    for k, v in report.items():
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, (int, float)) or (isinstance(v, str) and len(v) <= 60):
            out[k] = v
        if len(out) >= limit:
            break
    return out


def parser_for(r: Row, prog: str, record_default: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=r.description)
    if r.options:
        r.options(p)
    if not any("--json" in a.option_strings for a in p._actions):
        p.add_argument("--json", action="store_true", help="print the report as JSON")
    if record_default:
        p.add_argument("--no-record", dest="record", action="store_false",
                       help="do not append the result to the history")
    else:
        p.add_argument("--record", action="store_true", help="append the result to the history (results.jsonl)")
    p.add_argument("--history", type=Path, default=None,
                   help="history file (default: $FREETOKEN_BENCH_HISTORY or evals/perf/results.jsonl)")
    p.set_defaults(record=record_default)
    return p


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def parse(r: Row, argv: list[str], prog: str, record_default: bool) -> argparse.Namespace:
    p = parser_for(r, prog, record_default)
    if r.passthrough:
        args, rest = p.parse_known_args(argv)
        args.passthrough = rest
    else:
        args = p.parse_args(argv)
    return args


LOCATION_SETTINGS = frozenset({"FREETOKEN_CACHE", "FREETOKEN_BENCH_HISTORY"})
"""``FREETOKEN_*`` variables that only say where files are kept: they change no result, so they tag no run."""


def run_row(r: Row, args: argparse.Namespace, command: str,
            bandwidth: Callable[[], dict[str, Any]] | None = None) -> Record:
    """Run the row and return its record (not yet written anywhere). The machine's facts and load average are read
    before the row runs; its read bandwidth (``bandwidth``, default ``machine.bandwidth``) is measured after it, in
    the same process, and only for a run that will be recorded (or when ``bandwidth`` is given)."""
    from freetoken_agent.evals.perf import machine

    facts = machine.facts(None)
    t0 = time.perf_counter()
    report = r.run(args)
    wall = time.perf_counter() - t0
    if bandwidth is not None or getattr(args, "record", True):
        facts.update((bandwidth or machine.bandwidth)())
    options = {k: _jsonable(v) for k, v in vars(args).items() if k not in ("json", "record", "history", "func")}
    env = {k: v for k, v in sorted(os.environ.items())  # e.g. a pinned ISA path; not where files are kept
           if k.startswith("FREETOKEN_") and k not in LOCATION_SETTINGS}
    return Record(r.name, command, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), facts, options,
                  _jsonable((r.headline or default_headline)(report)), _jsonable(report), round(wall, 2),
                  tags={"env": env} if env else {})


def run_json_main(main: Callable[[list[str]], int | None], argv: list[str]) -> Report:
    """Run a module's own ``main(argv)`` (one that prints its report as JSON with ``--json``) and return that report:
    how a passthrough row runs a module whose command line is its own. Its other output goes to stderr."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*argv, "--json"])
    if code:
        raise BenchError(f"exited with status {code}")
    text = out.getvalue()
    start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
    if start < 0:
        raise BenchError("printed no JSON report")
    if start:
        sys.stderr.write(text[:start])
    report = json.loads(text[start:])
    return report if isinstance(report, dict) else {"rows": report}


def show(r: Row, report: Report, args: argparse.Namespace) -> str:
    if args.json or r.format is None:
        return json.dumps(report, indent=1)
    return r.format(report, args)


def cli(name: str, argv: list[str], prog: str, record_default: bool,
        bandwidth: Callable[[], dict[str, Any]] | None = None) -> int:
    """Parse, run, print and (when recording) append to the history. Raises ``BenchError`` for bad input."""
    from freetoken_agent.evals.perf import history

    r = get(name)
    args = parse(r, argv, prog, record_default)
    command = " ".join([prog, *map(shlex.quote, argv)])
    rec = run_row(r, args, command, bandwidth)
    print(show(r, rec.report, args))
    if args.record:
        path = history.append(rec, args.history)
        print(f"recorded in {path}; latest table: {history.write_latest(path)}", file=sys.stderr)
    return 0 if r.check is None or r.check(rec.report) else 1


def module_main(name: str, argv: list[str] | None = None) -> int:
    """The ``python -m`` entry point of a row's module: the row's flags, its report printed, no history unless
    ``--record``; bad input ends with its message."""
    module = ROWS[name].module if name in ROWS else name
    try:
        return cli(name, sys.argv[1:] if argv is None else argv, f"python -m {module}", record_default=False)
    except BenchError as exc:
        raise SystemExit(f"{name}: {exc}") from None
