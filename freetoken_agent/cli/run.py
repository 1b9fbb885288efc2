"""``freetoken run "TASK" --model DIR``: run the coding agent on a workspace with a live view."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from freetoken_agent.cli.flags import count, sampling, seconds


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="run the coding agent on a task, with a live view",
                              description="Run the coding agent on TASK inside a workspace folder.")
    p.add_argument("task", help="what the agent should do")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="model folder, 'builtin' (default) or 'synthetic:ARCH' (runs in this process)")
    src.add_argument("--url", help="an OpenAI-compatible server instead, e.g. http://localhost:8000/v1")
    p.add_argument("--remote-model", default=None, help="model id on the server (default: its first)")
    p.add_argument("--workspace", default=".", help="folder the tools may read and change (default: .)")
    p.add_argument("--max-steps", type=count(), default=30, help="model calls per run (default: 30)")
    p.add_argument("--max-tokens", type=count(), default=200_000, help="tokens generated per run")
    p.add_argument("--max-step-tokens", type=count(), default=4096, help="tokens generated per model call")
    p.add_argument("--max-wall", type=seconds(), default=None, help="seconds for the whole run")
    p.add_argument("--temperature", type=sampling("temperature"), default=0.0)
    p.add_argument("--seed", type=sampling("seed"), default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=count(), default=None, help="CPU threads for the engine (default: $FREETOKEN_THREADS, else the free cores)")
    p.add_argument("--trajectory", default=None, help="append the run to this JSONL file (or folder)")
    p.add_argument("--json", action="store_true", help="print events as JSON lines instead of the live view")
    p.add_argument("--sandbox", choices=["read-only", "workspace-write", "full-access"], default="workspace-write",
                   help="what commands run by the tools may do (default: workspace-write: write the workspace but "
                        "not .git, no network); full-access turns the OS sandbox off")
    p.add_argument("--allow-network", action="store_true", help="let sandboxed commands use the network")
    from freetoken_agent.cli.budget import add_budget_flags

    add_budget_flags(p)
    p.set_defaults(func=run)


def _limits_ok(args: argparse.Namespace) -> None:
    from freetoken_agent.cli import CLIError

    for name in ("max_steps", "max_tokens", "max_step_tokens"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_wall is not None and args.max_wall <= 0:
        raise CLIError("--max-wall must be positive")
    if not Path(args.workspace).is_dir():
        raise CLIError(f"workspace {args.workspace!r} is not a folder")


def agent_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``engine_kwargs`` for the agent commands (``run``, ``acp``): under a memory budget the residency policy
    defaults to ``phase``, so the agent's phase hints drive expert staging (``LocalEngine`` attaches the
    ``PhaseScheduler``); ``--residency-policy lru``/``heat`` still choose a phase-agnostic one."""
    from freetoken_agent.cli.budget import engine_kwargs

    if getattr(args, "residency_policy", None) is None and (args.device_memory or args.host_memory):
        args.residency_policy = "phase"
    return engine_kwargs(args)


def run(args: argparse.Namespace) -> int:
    import anyio
    from rich.console import Console
    from rich.live import Live

    from freetoken_agent.agent import Agent, Limits, Sampling
    from freetoken_agent.cli.live import LiveView, summary
    from freetoken_agent.events import event_record
    from freetoken_agent.tools.sandbox import SandboxMode, SandboxPolicy

    _limits_ok(args)
    console = Console(stderr=False)
    if not args.url:
        from freetoken_agent.backends.local import LocalEngine
        from freetoken_agent.runtime.models import resolve_model

        folder = resolve_model(args.model)
        with console.status(f"loading {folder.name}"):
            backend = LocalEngine.from_pretrained(folder, device=args.device, dtype=args.dtype,
                                                  **agent_engine_kwargs(args))
    else:
        from freetoken_agent.backends.openai_compat import OpenAICompatible

        backend = OpenAICompatible(args.url, model=args.remote_model)
    agent = Agent.coding(
        backend, workspace=args.workspace, trajectory=args.trajectory,
        limits=Limits(max_steps=args.max_steps, max_tokens=args.max_tokens, max_tokens_per_step=args.max_step_tokens,
                      max_wall_s=args.max_wall),
        sampling=Sampling(temperature=args.temperature, seed=args.seed),
        sandbox=SandboxPolicy(SandboxMode(args.sandbox), network=args.allow_network))
    view = LiveView(args.task)
    agent.on_tool_output = view.on_tool_output

    async def consume() -> None:
        async for event in agent.stream(args.task):
            view.update(event)
            if args.json:
                print(json.dumps(event_record(event), ensure_ascii=False, default=str), flush=True)

    if args.json:
        anyio.run(consume)
    else:
        with Live(view, console=console, refresh_per_second=8):
            anyio.run(consume)
    result = view.result
    if not args.json:
        console.print(summary(result))
        if result.final_message and result.ok:
            console.print(result.final_message)
    if result.stop_reason == "backend_error":
        print(f"freetoken run: error: {result.error}", file=sys.stderr)
        return 2
    return 0 if result.ok else 1
