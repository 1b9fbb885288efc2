"""``freetoken acp``: serve the coding agent to an editor over the Agent Client Protocol (v1) on stdin/stdout."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from freetoken_agent.cli.flags import count, sampling, seconds


def _default_sessions_dir() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "freetoken" / "acp-sessions"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "acp", help="serve the agent to an editor (Agent Client Protocol over stdio)",
        description="Serve the coding agent over the Agent Client Protocol (JSON-RPC 2.0 on stdin/stdout, one "
                    "message per line). Editors such as Zed launch this command as a subprocess. stdout carries "
                    "only protocol messages; logs go to stderr.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None,
                     help="model folder, 'builtin' or 'synthetic:ARCH' (default: the built-in model); loads after "
                          "the editor's initialize")
    src.add_argument("--url", default=None, help="an OpenAI-compatible server instead, e.g. http://localhost:8000/v1")
    src.add_argument("--scripted", default=None, metavar="FILE.json",
                     help="play prepared model outputs instead of a model: a JSON list of turns, {\"turns\": [...], "
                          "\"delay_s\": 0.05, \"tool_format\": \"hermes\"}, or a trajectory .jsonl to replay")
    p.add_argument("--remote-model", default=None, help="model id on the --url server (default: its first)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=count(), default=None, help="CPU threads for the engine")
    p.add_argument("--mode", choices=["ask", "auto", "read-only"], default="ask",
                   help="ask before tools that write or execute (default), run them without asking, or refuse them")
    p.add_argument("--sessions", default=None, metavar="DIR",
                   help=f"where sessions are saved for session/load (default: {_default_sessions_dir()})")
    p.add_argument("--no-sessions", action="store_true", help="keep sessions in memory only")
    p.add_argument("--trajectory", default=None, metavar="DIR", help="write one trajectory JSONL per prompt here")
    p.add_argument("--max-steps", type=count(), default=30, help="model calls per prompt (default: 30)")
    p.add_argument("--max-tokens", type=count(), default=200_000, help="tokens generated per prompt")
    p.add_argument("--max-step-tokens", type=count(), default=4096, help="tokens generated per model call")
    p.add_argument("--max-wall", type=seconds(), default=None, help="seconds per prompt")
    p.add_argument("--temperature", type=sampling("temperature"), default=0.0)
    p.add_argument("--seed", type=sampling("seed"), default=None)
    p.add_argument("--tool-timeout", type=seconds(), default=120.0, help="default timeout of shell/test tools (s)")
    p.add_argument("--max-message-bytes", type=int, default=16 * 2**20, help=argparse.SUPPRESS)
    from freetoken_agent.cli.budget import add_budget_flags

    add_budget_flags(p)
    p.set_defaults(func=run)


def _scripted(path: str) -> Any:
    from freetoken_agent.backends.scripted import ScriptedBackend
    from freetoken_agent.cli import CLIError

    if path.endswith(".jsonl"):  # a recorded run: replay its assistant messages
        from freetoken_agent.trajectory import TrajectoryError

        try:
            backend = ScriptedBackend.from_trajectory(path)
        except TrajectoryError as exc:
            raise CLIError(str(exc)) from None
        if not backend.turns:
            raise CLIError(f"trajectory {path} holds no assistant messages to replay")
        return backend
    try:
        spec = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise CLIError(f"cannot read script {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CLIError(f"script {path} is not valid JSON: {exc}") from None
    options: dict[str, Any] = {}
    if isinstance(spec, dict):
        turns = spec.get("turns")
        delay, fmt = spec.get("delay_s", 0.0), spec.get("tool_format", "hermes")
        if not isinstance(delay, (int, float)) or isinstance(delay, bool) or delay < 0:
            raise CLIError(f"script {path}: delay_s must be a number >= 0")
        if not isinstance(fmt, str):
            raise CLIError(f"script {path}: tool_format must be a string")
        options = {"delay_s": float(delay), "tool_format": fmt}
    else:
        turns = spec
    if not isinstance(turns, list) or not all(isinstance(t, (str, dict)) for t in turns):
        raise CLIError(f"script {path}: expected a list of turns (strings or assistant-message objects)")
    return ScriptedBackend(turns, **options)


def _backend_factory(args: argparse.Namespace) -> Any:
    from freetoken_agent.cli import CLIError

    if args.scripted:
        backend = _scripted(args.scripted)
        return lambda: (backend, 0)
    if args.url:
        from freetoken_agent.backends.openai_compat import OpenAICompatible

        remote = OpenAICompatible(args.url, model=args.remote_model)
        return lambda: (remote, 0)
    name = args.model
    if name and name != "builtin" and not name.startswith("synthetic:") and not Path(name).expanduser().is_dir():
        raise CLIError(f"model folder {name!r} does not exist")

    def load() -> tuple[Any, int]:
        from freetoken_agent.backends.local import LocalEngine
        from freetoken_agent.runtime.models import resolve_model

        from freetoken_agent.cli.run import agent_engine_kwargs
        backend = LocalEngine.from_pretrained(resolve_model(name), device=args.device, dtype=args.dtype,
                                               **agent_engine_kwargs(args))
        return backend, int(getattr(backend.engine.spec, "max_position", 0) or 0)

    return load


def run(args: argparse.Namespace) -> int:
    from freetoken_agent.acp.stdio import reserve_stdout

    protocol_fd = reserve_stdout()  # first: nothing loaded from here on can write to the protocol stream
    import anyio

    from freetoken_agent.acp.server import AcpOptions, AcpServer
    from freetoken_agent.agent import Limits, Sampling
    from freetoken_agent.cli import CLIError

    for name in ("max_steps", "max_tokens", "max_step_tokens", "max_message_bytes"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_wall is not None and args.max_wall <= 0:
        raise CLIError("--max-wall must be positive")
    if args.threads is not None and args.threads < 1:
        raise CLIError("--threads must be at least 1")
    sessions = None if args.no_sessions else Path(args.sessions) if args.sessions else _default_sessions_dir()
    trajectory = Path(args.trajectory) if args.trajectory else None
    if trajectory is not None:
        try:
            trajectory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CLIError(f"cannot create the trajectory folder {trajectory}: {exc.strerror or exc}") from None
    options = AcpOptions(
        backend_factory=_backend_factory(args),
        limits=Limits(max_steps=args.max_steps, max_tokens=args.max_tokens, max_tokens_per_step=args.max_step_tokens,
                      max_wall_s=args.max_wall),
        sampling=Sampling(temperature=args.temperature, seed=args.seed),
        mode=args.mode, sessions_dir=sessions,
        trajectory_dir=trajectory,
        tool_timeout_s=args.tool_timeout, max_message_bytes=args.max_message_bytes)
    server = AcpServer(options, read_fd=0, write_fd=protocol_fd)
    anyio.run(server.run)
    return 0
