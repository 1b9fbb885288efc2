"""``freetoken serve --model DIR``: an OpenAI-compatible HTTP server over the local engine."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a local model over an OpenAI-compatible HTTP API",
                              description="Serve /v1/models, /v1/chat/completions (streaming, tools) and "
                                          "/v1/completions for a local model folder.")
    p.add_argument("--model", default=None, help="model folder, 'builtin' (default) or 'synthetic:ARCH'")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--name", default=None, help="model id clients use (default: the folder name)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the engine (default: torch's)")
    p.add_argument("--default-max-tokens", type=int, default=1024,
                   help="completion length when a request gives none (default: 1024)")
    from freetoken_agent.cli.budget import add_budget_flags

    add_budget_flags(p)
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    from freetoken_agent.cli import CLIError

    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {args.port}")
    if args.default_max_tokens < 1:
        raise CLIError("--default-max-tokens must be at least 1")
    from freetoken_agent.backends.local import LocalEngine
    from freetoken_agent.cli.run import _threads
    from freetoken_agent.runtime.models import resolve_model
    from freetoken_agent.server import serve as run_server

    _threads(args.threads)
    folder = resolve_model(args.model)
    from freetoken_agent.cli.budget import engine_kwargs
    backend = LocalEngine.from_pretrained(folder, device=args.device, dtype=args.dtype, **engine_kwargs(args))
    name = args.name or folder.resolve().name
    print(f"serving {name} ({backend.tool_format} tool calls) on http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    try:
        run_server(backend, name, host=args.host, port=args.port, log_level="warning",
                   default_max_tokens=args.default_max_tokens)
    except OSError as exc:
        raise CLIError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    return 0
