"""``freetoken bench TARGET``: performance benchmarks; ``kernels`` measures the CPU expert kernels vs ggml.

Targets register in ``TARGETS`` (name → (help, add_arguments, run)), so other benchmarks join as one entry.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from freetoken_agent.cli import CLIError


def _kernels_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quick", action="store_true", help="one shape (768x2048), M=1 and 16, short timing")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and all CPUs)")
    p.add_argument("--no-ggml", action="store_true", help="skip the ggml peer rows even if llama-cpp-python is here")


def _parse_ints(text: str | None, what: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise CLIError(f"--{what} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise CLIError(f"--{what} needs positive integers, got {text!r}")
    return vals


def _kernels(args: argparse.Namespace) -> int:
    from freetoken_agent.evals.perf import bench_kernels as bk

    kwargs: dict[str, object] = {"thread_counts": _parse_ints(args.threads, "threads"), "with_ggml": not args.no_ggml}
    if args.quick:
        kwargs.update(shapes=((768, 2048),), m_values=(1, 16), reps=20, budget_s=1.0)
    try:
        report = bk.run(progress=None if args.json else lambda s: print(s, file=sys.stderr), **kwargs)  # type: ignore[arg-type]
    except RuntimeError as exc:
        raise CLIError(str(exc)) from None
    print(json.dumps(report.to_json(), indent=1) if args.json else bk.format_table(report))
    return 0


TARGETS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "kernels": ("CPU expert kernels (ours, torch, ggml) on real expert shapes", _kernels_args, _kernels),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="performance benchmarks (kernels, ...)")
    targets = p.add_subparsers(dest="target", metavar="TARGET")
    for name, (help_text, add_args, fn) in TARGETS.items():
        t = targets.add_parser(name, help=help_text)
        add_args(t)
        t.set_defaults(func=fn)
    p.set_defaults(func=lambda args: _missing_target(p))


def _missing_target(p: argparse.ArgumentParser) -> int:
    raise CLIError(f"choose a target: {', '.join(TARGETS)}")
