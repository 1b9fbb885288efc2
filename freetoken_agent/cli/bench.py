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
    p.add_argument("--markdown", action="store_true", help="print markdown tables (for evals/perf/RESULTS.md)")
    p.add_argument("--quick", action="store_true", help="one shape (768x2048), M=1 and 16, short timing")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and all CPUs)")
    p.add_argument("--no-ggml", action="store_true", help="skip the ggml peer rows even if llama-cpp-python is here")
    p.add_argument("--shapes", default=None,
                   help="comma-separated NxK weight shapes (default: 768x2048,2048x768,1536x4096)")
    p.add_argument("--m", default=None, help="comma-separated token counts M (default: 1,4,16,64,256)")
    p.add_argument("--working-set-mb", type=int, default=256, help="MiB of weight copies cycled per path (default 256)")
    p.add_argument("--no-moe-layer", action="store_true", help="skip the whole-MoE-layer rows")
    p.add_argument("--pages", choices=("2m", "4k"), default="2m",
                   help="page size of every path's weight copies, ours and ggml's alike (default 2m: the engine "
                        "keeps its weights in 2 MiB pages; 4k: ordinary allocations)")


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


def _parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    shapes = []
    for item in text.split(","):
        parts = item.lower().strip().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise CLIError(f"--shapes wants NxK pairs like 768x2048, got {item!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    return tuple(shapes)


def _kernels(args: argparse.Namespace) -> int:
    from freetoken_agent.evals.perf import bench_kernels as bk

    kwargs: dict[str, object] = {"thread_counts": _parse_ints(args.threads, "threads"), "with_ggml": not args.no_ggml}
    if args.quick:
        kwargs.update(shapes=((768, 2048),), m_values=(1, 16), reps=20, budget_s=1.0)
    if args.shapes:
        kwargs["shapes"] = _parse_shapes(args.shapes)
    if args.m:
        kwargs["m_values"] = _parse_ints(args.m, "m")
    if args.working_set_mb < 1:
        raise CLIError(f"--working-set-mb must be at least 1, got {args.working_set_mb}")
    kwargs["working_set"] = args.working_set_mb << 20
    kwargs["moe_layer"] = not args.no_moe_layer
    kwargs["huge_pages"] = args.pages == "2m"
    try:
        report = bk.run(progress=None if args.json else lambda s: print(s, file=sys.stderr), **kwargs)  # type: ignore[arg-type]
    except RuntimeError as exc:
        raise CLIError(str(exc)) from None
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(bk.format_markdown(report) if args.markdown else bk.format_table(report))
    return 0


TARGETS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "kernels": ("CPU expert kernels (ours, torch, ggml) on real expert shapes", _kernels_args, _kernels),
    "suite": ("ours vs llama.cpp and transformers on the same weights (ratios, bandwidth fraction)",
              lambda p: _suite().add_cli_args(p), lambda a: _suite().cli_run(a)),
}


def _suite():  # type: ignore[no-untyped-def]
    from freetoken_agent.evals.perf import suite

    return suite


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="performance benchmarks (kernels, ...)")
    targets = p.add_subparsers(dest="target", metavar="TARGET")
    for name, (help_text, add_args, fn) in TARGETS.items():
        t = targets.add_parser(name, help=help_text)
        add_args(t)
        t.set_defaults(func=fn)
    p.add_argument("--quick", action="store_true", help="with no TARGET: run the suite in its quick form")
    p.add_argument("--json", action="store_true", help="with no TARGET: print the suite's JSON report")
    _suite().add_trajectories_arg(p)
    p.set_defaults(func=lambda args: _missing_target(p, args))


def _missing_target(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.quick:  # ``freetoken bench --quick`` is the suite
        return _suite().cli_run(args)
    raise CLIError(f"choose a target: {', '.join(TARGETS)} (or --quick for the suite)")
