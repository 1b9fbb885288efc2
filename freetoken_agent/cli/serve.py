"""``freetoken serve --model DIR``: an OpenAI-compatible HTTP server over the local engine."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from freetoken_agent.cli.flags import count, port


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a local model over an OpenAI-compatible HTTP API",
                              description="Serve a local model over HTTP: OpenAI /v1/chat/completions, "
                                          "/v1/completions and /v1/responses, Anthropic /v1/messages.")
    p.add_argument("--model", default=None, help="model folder, 'builtin' (default) or 'synthetic:ARCH'")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=port(), default=8000, help="port (default: 8000)")
    p.add_argument("--name", default=None, help="model id clients use (default: the folder name)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=count(), default=None, help="CPU threads for the engine (default: $FREETOKEN_THREADS, else the free cores)")
    p.add_argument("--default-max-tokens", type=count(), default=1024,
                   help="completion length when a request gives none (default: 1024)")
    p.add_argument("--api-key", default=None,
                   help="require this key on every route (Authorization: Bearer KEY or x-api-key: KEY; "
                        "default: $FREETOKEN_API_KEY, else none)")
    p.add_argument("--script", default=None, metavar="FILE",
                   help="serve scripted answers instead of a model: a JSON list of turns (model text, or "
                        '{"content": ..., "tool_calls": [{"name": ..., "arguments": {...}}]}), one per request')
    from freetoken_agent.cli.budget import add_budget_flags

    add_budget_flags(p)
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    from freetoken_agent.cli import CLIError

    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {args.port}")
    if args.default_max_tokens < 1:
        raise CLIError("--default-max-tokens must be at least 1")
    from freetoken_agent.server import is_loopback
    from freetoken_agent.server import serve as run_server

    api_key = args.api_key if args.api_key is not None else os.environ.get("FREETOKEN_API_KEY") or None
    backend, name = load_backend(args)
    if not api_key and not is_loopback(args.host):
        print(f"freetoken serve: warning: listening on {args.host} without an API key: anyone who can reach this "
              "address can use the model (set --api-key or FREETOKEN_API_KEY)", file=sys.stderr, flush=True)
    print(f"serving {name} ({backend.tool_format} tool calls) on http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    try:
        run_server(backend, name, host=args.host, port=args.port, log_level="warning",
                   default_max_tokens=args.default_max_tokens, api_key=api_key)
    except OSError as exc:
        raise CLIError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    return 0


def load_backend(args: argparse.Namespace) -> tuple[Any, str]:
    """The backend ``args`` ask for (a model, or ``--script``'s scripted answers) and the model id to serve."""
    from freetoken_agent.cli import CLIError

    if args.script is not None:
        from freetoken_agent.backends.scripted import ScriptedBackend

        try:
            turns = json.loads(Path(args.script).read_text())
        except (OSError, ValueError) as exc:
            raise CLIError(f"cannot read the script {args.script}: {exc}") from None
        if not isinstance(turns, list) or not all(isinstance(t, (str, dict)) for t in turns):
            raise CLIError(f"{args.script} must hold a JSON list of turns (strings or objects)")
        return ScriptedBackend(turns), args.name or "scripted"
    from freetoken_agent.backends.local import LocalEngine
    from freetoken_agent.cli.budget import engine_kwargs
    from freetoken_agent.runtime.models import resolve_model

    folder = resolve_model(args.model)
    backend = LocalEngine.from_pretrained(folder, device=args.device, dtype=args.dtype, **engine_kwargs(args))
    return backend, args.name or folder.resolve().name
