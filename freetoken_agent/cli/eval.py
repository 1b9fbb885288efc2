"""Run SWE-style tasks locally (no Docker) and report resolved rate, time, tokens and engine stats.

    freetoken eval builtin --agent gold                       # validate the harness (must be 100%)
    freetoken eval builtin --agent agent --model DIR --out runs/a
    freetoken eval swe-bench.jsonl --repos ~/clones --agent pkg.mod:make_agent --workers 4
    freetoken eval --compare runs/a runs/b
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from freetoken_agent.cli import CLIError
from freetoken_agent.cli.flags import count, seconds


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("eval", help="run SWE-style evals locally (no Docker) and report",
                              description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("target", nargs="?", metavar="SUITE_OR_JSONL",
                   help="a built-in suite name (builtin) or a SWE-bench-style JSONL file")
    p.add_argument("--agent", default="agent",
                   help="gold (applies the gold patch), empty (changes nothing), agent (a coding Agent on --model), "
                        "or MODULE:FUNCTION / FILE.py:FUNCTION returning an Agent for (task, workspace)")
    p.add_argument("--model", help="for --agent agent: model folder, 'builtin' (default) or 'synthetic:ARCH'")
    p.add_argument("--url", help="for --agent agent: an OpenAI-compatible server instead of a local model")
    p.add_argument("--remote-model", help="model id on the --url server (default: its first)")
    p.add_argument("--workers", type=count(), default=1, help="tasks run at the same time (default 1)")
    p.add_argument("--out", type=Path, help="run folder (default: freetoken-evals/<tasks>-<agent>-<time>); with "
                                            "--compare: where compare.md and compare.json are written")
    p.add_argument("--resume", action="store_true", help="continue the run in --out: run only tasks without a result")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (resolved, total, ...)")
    p.add_argument("--tasks", help="comma-separated instance ids (or substrings) to run")
    p.add_argument("--repos", type=Path, help="folder with local clones for SWE-bench owner/name repositories")
    p.add_argument("--python", help="interpreter for setup commands and tests (default: this one)")
    p.add_argument("--test-timeout", type=seconds(), help="seconds per test before it is killed (default: per task)")
    p.add_argument("--sandbox", choices=["read-only", "workspace-write", "full-access"], default="workspace-write",
                   help="the OS sandbox the tests (the agent's code) and the agent's commands run under (default "
                        "workspace-write: the workspace writable, not .git, no network); full-access turns it off")
    p.add_argument("--agent-timeout", type=seconds(), help="seconds the agent may work on one task (default: per task)")
    p.add_argument("--max-steps", type=count(), default=30, help="model calls per task for --agent agent (default 30)")
    p.add_argument("--max-step-tokens", type=count(), default=1024,
                   help="tokens one model call may generate, for --agent agent (default 1024)")
    p.add_argument("--device", default="cpu", help="device of the local engine (default cpu)")
    p.add_argument("--dtype", default="float32", help="dtype of the local engine (default float32)")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("RUN_A", "RUN_B"), help="show two run folders side by side")
    from freetoken_agent.cli.budget import add_budget_flags

    add_budget_flags(p)
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> str | None:
    """Validate the options before anything is written or loaded; return the model label for run.json."""
    if args.workers < 1:
        raise CLIError("--workers must be at least 1")
    if args.resume and args.out is None:
        raise CLIError("--resume needs --out (the run folder to continue)")
    if args.agent != "agent":
        if args.model or args.url:
            raise CLIError("--model and --url are for --agent agent")
        return None
    if args.max_steps < 1 or args.max_step_tokens < 1:
        raise CLIError("--max-steps and --max-step-tokens must be at least 1")
    if args.url and args.model:
        raise CLIError("give --model (a local engine) or --url (a server), not both")
    return args.url or args.model or "builtin"


def _make_agent(args: argparse.Namespace) -> Any:
    from freetoken_agent.evals.swe.agents import EmptyAgent, GoldAgent
    from freetoken_agent.evals.swe.sdk_agent import SDKAgent, coding_agent_factory, load_factory

    if args.agent == "gold":
        return GoldAgent()
    if args.agent == "empty":
        return EmptyAgent()
    if args.agent == "agent":
        from freetoken_agent.agent import Limits

        backend = _backend(args)
        limits = Limits(max_steps=args.max_steps, max_tokens_per_step=args.max_step_tokens)
        from freetoken_agent.tools.sandbox import SandboxMode, SandboxPolicy

        sandbox = SandboxPolicy(SandboxMode(args.sandbox))
        return SDKAgent(coding_agent_factory(lambda: backend, limits=limits, sandbox=sandbox), name="agent")
    return SDKAgent(load_factory(args.agent), name=args.agent)


def _backend(args: argparse.Namespace) -> Any:
    """One backend shared by every task: the local engine (model loaded once) or a remote server."""
    if args.url:
        from freetoken_agent.backends.openai_compat import OpenAICompatible

        return OpenAICompatible(args.url, model=args.remote_model)
    from freetoken_agent.backends.local import LocalEngine
    from freetoken_agent.runtime.models import resolve_model

    path = resolve_model(args.model)
    from freetoken_agent.cli.budget import engine_kwargs
    return LocalEngine.from_pretrained(path, device=args.device, dtype=args.dtype, **engine_kwargs(args))


def _resolve_target(target: str) -> tuple[str, Path | None]:
    """(label recorded in run.json, task file or None for a built-in suite)."""
    from freetoken_agent.evals.suites import SUITES

    if target in SUITES:
        return target, None
    path = Path(target)
    if not path.is_file():
        raise CLIError(f"{target!r} is neither a built-in suite ({', '.join(SUITES)}) nor a task file")
    return str(path.resolve()), path


def _console() -> Any:
    """A rich console as wide as the terminal, or wide enough for the table when output is redirected."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


def run(args: argparse.Namespace) -> int:
    import anyio

    from freetoken_agent.evals.swe.harness import HarnessConfig, run_pending
    from freetoken_agent.evals.swe.report import (
        compare,
        comparison_markdown,
        ordered,
        print_comparison,
        print_table,
        write_reports,
    )
    from freetoken_agent.evals.swe.results import RunStore, TaskResult
    from freetoken_agent.evals.swe.task import load_tasks

    if args.compare:
        cmp = compare(*args.compare)
        if args.out is not None:  # keep the comparison next to the runs
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "compare.json").write_text(json.dumps(cmp, indent=2) + "\n", encoding="utf-8")
            (args.out / "compare.md").write_text(comparison_markdown(cmp), encoding="utf-8")
        if args.json:
            print(json.dumps(cmp, indent=2))
        else:
            print_comparison(cmp, _console())
        return 0
    if not args.target:
        raise CLIError("give a suite name or a task file (or --compare RUN_A RUN_B)")
    model = _check(args)
    label, tasks_file = _resolve_target(args.target)
    wanted = [w.strip() for w in (args.tasks or "").split(",") if w.strip()]

    def selected(instance_id: str) -> bool:
        return not wanted or any(w == instance_id or w in instance_id for w in wanted)

    if tasks_file is None:
        from freetoken_agent.evals.suites import materialize_suite, suite_tasks

        ids = [f"{label}__{spec.name}" for spec in suite_tasks(label)]
    else:
        file_tasks = load_tasks(tasks_file)
        ids = [t.instance_id for t in file_tasks]
    if not any(map(selected, ids)):
        raise CLIError(f"--tasks {args.tasks!r} matches no task")
    safe_agent = "".join(c if c.isalnum() or c in "-_." else "_" for c in args.agent)
    out: Path = args.out or Path("freetoken-evals") / f"{Path(args.target).stem}-{safe_agent}-" \
                                                      f"{time.strftime('%Y%m%d-%H%M%S')}"
    store = RunStore(out)
    meta = {"tasks": label, "agent": args.agent, "model": model, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    store.check(meta, args.resume)  # bad input is reported before a model is loaded or a file written
    agent = _make_agent(args)
    done = store.start(meta, args.resume)
    if tasks_file is None:  # a built-in suite: (re)build its repositories; commits are deterministic
        file_tasks = load_tasks(materialize_suite(label, out / "suite", selected))
    tasks = [t for t in file_tasks if selected(t.instance_id)]
    todo = [t for t in tasks if t.instance_id not in done]
    if done:
        print(f"resuming {out}: {len(tasks) - len(todo)} of {len(tasks)} tasks already have results", file=sys.stderr)
    finished = [len(tasks) - len(todo)]

    def progress(result: TaskResult) -> None:
        finished[0] += 1
        print(f"[{finished[0]}/{len(tasks)}] {result.instance_id}: {result.status} ({result.wall_s:.1f}s)"
              + (f" - {result.reason}" if result.reason else ""), file=sys.stderr, flush=True)

    from freetoken_agent.tools.sandbox import SandboxMode, SandboxPolicy

    config = HarnessConfig(workers=args.workers, repos_dir=args.repos, python=args.python,
                           test_timeout_s=args.test_timeout, agent_timeout_s=args.agent_timeout,
                           model_name=model or agent.name, sandbox=SandboxPolicy(SandboxMode(args.sandbox)))
    anyio.run(run_pending, tasks, agent, store, config, progress)
    ids = [t.instance_id for t in tasks]
    summary = write_reports(store, ids)
    if args.json:
        print(json.dumps({**summary, "out": str(out)}))
    else:
        print_table(ordered(store, ids), _console(), title=f"{label} - {agent.name}")
        print(f"report: {out / 'report.md'} and {out / 'report.json'}", file=sys.stdout)
    return 0
