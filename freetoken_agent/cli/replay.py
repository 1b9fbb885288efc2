"""``freetoken replay FILE``: print a run's trajectory (JSONL) as a readable transcript."""

from __future__ import annotations

import argparse
import json
import warnings


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("replay", help="print a run trajectory (JSONL) as a transcript",
                              description="Print the trajectory file of an agent run, message by message.")
    p.add_argument("file", help="a trajectory .jsonl file")
    p.add_argument("--full", action="store_true", help="do not shorten long tool outputs")
    p.set_defaults(func=replay)


def _clip(text: str, full: bool, limit: int = 1500) -> str:
    return text if full or len(text) <= limit else text[:limit] + f"\n… ({len(text) - limit} more characters)"


def replay(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from freetoken_agent.cli import CLIError
    from freetoken_agent.trajectory import TrajectoryError, TrajectoryWarning, read_trajectory

    console = Console(highlight=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TrajectoryWarning)
        try:
            records = list(read_trajectory(args.file))
        except TrajectoryError as exc:
            raise CLIError(str(exc)) from None
    errors = Console(stderr=True, highlight=False, soft_wrap=True)
    for warning in caught:  # skipped torn lines: one line each on stderr, the transcript stays on stdout
        if issubclass(warning.category, TrajectoryWarning):
            errors.print(f"[yellow]warning[/]: {escape(str(warning.message))}")
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    if not records:
        raise CLIError(f"{args.file} holds no records")
    for previous, record in zip([None, *records], records):
        kind = record["type"]
        if kind == "run_started" and previous is not None and previous["type"] != "run_finished":
            console.print("[yellow]the run above ends without run_finished: it was killed[/]")
        if kind == "run_started":
            console.rule(f"[bold]task[/]: {escape(str(record.get('task', '')))}")
            console.print(f"[dim]tools: {', '.join(record.get('tools', []))}  backend: {record.get('backend')}[/]")
        elif kind == "message":
            message = record.get("message") or {}
            role = message.get("role", "?")
            if role == "system":
                continue
            style = {"user": "bold green", "assistant": "bold cyan", "tool": "bold yellow"}.get(role, "bold")
            label = role if role != "tool" else f"tool {message.get('name', '')} ({message.get('tool_call_id', '')})"
            console.print(f"[{style}]{escape(label)}[/] [dim]step {record.get('step', 0)}[/]")
            if message.get("content"):
                console.print(escape(_clip(str(message["content"]), args.full)))
            for call in message.get("tool_calls") or []:
                fn = call.get("function", {})
                arguments = _clip(fn.get("arguments", ""), args.full, 300)
                console.print(f"  → [bold]{escape(fn.get('name', '?'))}[/] {escape(arguments)}")
        elif kind == "phase_changed":
            console.print(f"[dim]· phase {record.get('phase')}"
                          + (f" (expected {record['expected_s']} s)" if record.get("expected_s") else "") + "[/]")
        elif kind == "invalid_output":
            console.print(f"[red]unreadable tool call[/]: {escape(str(record.get('message')))}")
        elif kind == "run_finished":
            usage = record.get("usage") or {}
            console.rule(f"[bold]{record.get('stop_reason')}[/] after {record.get('steps')} steps, "
                         f"{usage.get('completion_tokens', 0)} tokens, {record.get('duration_s')} s")
            if record.get("error"):
                console.print(f"[yellow]{escape(str(record['error']))}[/]")
            if record.get("engine_stats"):
                console.print(f"[dim]engine: {escape(json.dumps(record['engine_stats']))}[/]")
    if records[-1]["type"] != "run_finished":
        console.print("[yellow]the trajectory ends without run_finished: the run was killed[/]")
    return 0
