"""``freetoken launch claude|codex [-- ARGS]``: run Claude Code or Codex CLI against a local model.

Starts ``freetoken serve`` on a free port (or uses a running server, ``--url``), runs the installed CLI configured
against it — Claude Code through ``ANTHROPIC_BASE_URL`` (Messages API), Codex through a ``model_providers`` entry
with ``wire_api = "responses"`` given as ``-c`` overrides (the user's config files are not touched) — and stops the
server when the CLI exits. The exit status is the CLI's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from freetoken_agent.cli.flags import count

CLIENTS = {"claude": ("claude", "@anthropic-ai/claude-code"), "codex": ("codex", "@openai/codex")}
LAUNCH_SERVE = "import sys; from freetoken_agent.cli import main; sys.exit(main())"
START_TIMEOUT_S = 600.0
"""How long a server may take to load its model before launch gives up."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("launch", help="run Claude Code or Codex CLI against a local model",
                              description="Start `freetoken serve` (or use --url) and run Claude Code (`claude`) or "
                                          "Codex (`codex`) configured against it. Arguments after `--` go to the "
                                          "client, e.g. `freetoken launch claude -- -p 'fix the test'`.")
    add_options(p)
    p.add_argument("client", choices=sorted(CLIENTS), help="the agent CLI to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="[launch options] -- arguments for the client")
    p.set_defaults(func=launch)


def add_options(p: argparse.ArgumentParser) -> None:
    """Launch's own options (accepted before the client's name, or after it up to ``--``)."""
    p.add_argument("--url", default=None, help="use a running server (http://HOST:PORT) instead of starting one")
    p.add_argument("--model", default=None, help="model folder, 'builtin' (default) or 'synthetic:ARCH'")
    p.add_argument("--script", default=None, metavar="FILE", help="serve scripted answers (see freetoken serve)")
    p.add_argument("--name", default=None, help="model id (default: the folder name)")
    p.add_argument("--threads", type=count(), default=None, help="CPU threads for the engine")
    p.add_argument("--api-key", default=None, help="the server's key (default: $FREETOKEN_API_KEY)")
    p.add_argument("--cli", default=None, metavar="PATH", help="the client executable (default: found on PATH)")
    p.add_argument("--max-tokens", type=count(), default=None, metavar="N",
                   help="the longest answer the client gets: Claude Code's CLAUDE_CODE_MAX_OUTPUT_TOKENS; for Codex "
                        "(which sends no limit) the started server's --default-max-tokens (default: a quarter of the "
                        "model's context for Claude Code, the server's default for Codex)")


def split_args(args: argparse.Namespace) -> list[str]:
    """The client's arguments; launch options given between the client's name and ``--`` are read into ``args``."""
    rest = list(args.args)
    if "--" not in rest:
        return rest
    cut = rest.index("--")
    if cut:
        from freetoken_agent.cli import CLIError

        options = argparse.ArgumentParser(prog="freetoken launch", add_help=False, exit_on_error=False)
        add_options(options)
        try:
            given, unknown = options.parse_known_args(rest[:cut])
        except argparse.ArgumentError as exc:
            raise CLIError(str(exc)) from None
        if unknown:
            raise CLIError(f"unrecognized launch options before --: {' '.join(unknown)}")
        for key, value in vars(given).items():
            if value is not None:
                setattr(args, key, value)
    return rest[cut + 1:]


@dataclass
class Server:
    """A server the client talks to: its root URL, model id and context (None when it does not say)."""

    url: str
    model: str
    context: int | None
    process: subprocess.Popen | None = None

    def stop(self) -> None:
        """Stop the server launch started (a running one given by ``--url`` is left alone)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _describe(url: str, api_key: str | None) -> tuple[str, int | None] | None:
    """(model id, context) from a server's ``/v1/models``; None while it does not answer."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        reply = httpx.get(f"{url}/v1/models", headers=headers, timeout=2)
    except httpx.HTTPError:
        return None
    if reply.status_code != 200:
        return None
    card = (reply.json().get("data") or [{}])[0]
    return str(card.get("id")), card.get("context_length")


def start_server(args: argparse.Namespace, api_key: str | None) -> Server:
    """The server ``args`` name (``--url``), or a ``freetoken serve`` started on a free loopback port."""
    from freetoken_agent.cli import CLIError

    if args.url:
        url = args.url.rstrip("/").removesuffix("/v1")
        found = _describe(url, api_key)
        if found is None:
            raise CLIError(f"no freetoken server answers at {url} (is it running, is the API key right?)")
        return Server(url, *found)
    port = _free_port()
    command = [sys.executable, "-c", LAUNCH_SERVE, "serve", "--port", str(port)]
    for flag in ("model", "script", "name", "threads"):
        value = getattr(args, flag)
        if value is not None:
            command += [f"--{flag}", str(value)]
    if args.max_tokens is not None and args.client == "codex":
        command += ["--default-max-tokens", str(args.max_tokens)]
    env = dict(os.environ, FREETOKEN_API_KEY=api_key or "")
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while (found := _describe(url, api_key)) is None:
        if process.poll() is not None:
            lines = (process.stderr.read() if process.stderr else "").strip().splitlines()
            raise CLIError(lines[-1] if lines else f"freetoken serve exited with status {process.returncode}")
        if time.monotonic() > deadline:
            process.kill()
            raise CLIError(f"freetoken serve did not answer within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.2)
    return Server(url, *found, process=process)


def client_command(client: str, executable: str, server: Server, api_key: str | None, user_args: list[str],
                   max_tokens: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that point ``client`` at ``server``; ``max_tokens`` caps Claude Code's
    answers (Codex sends no limit: the server's default applies)."""
    env = dict(os.environ)
    if client == "claude":
        env.pop("ANTHROPIC_API_KEY", None)  # a key for Anthropic's service is not sent to a local server
        env.update(ANTHROPIC_BASE_URL=server.url, ANTHROPIC_AUTH_TOKEN=api_key or "freetoken",
                   ANTHROPIC_MODEL=server.model, ANTHROPIC_SMALL_FAST_MODEL=server.model,
                   ANTHROPIC_DEFAULT_OPUS_MODEL=server.model, ANTHROPIC_DEFAULT_SONNET_MODEL=server.model,
                   ANTHROPIC_DEFAULT_HAIKU_MODEL=server.model, CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
        # Claude Code opens its system prompt with a billing line for Anthropic's service that carries a fingerprint
        # of the first message: to a local model it is noise that changes the prompt's first tokens per conversation
        # (no prefix reuse between conversations). The user's own setting wins.
        env.setdefault("CLAUDE_CODE_ATTRIBUTION_HEADER", "0")
        if max_tokens is not None:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_tokens)
        elif server.context is not None:  # it asks for 32k output tokens unless told: keep room for the prompt
            env.setdefault("CLAUDE_CODE_MAX_OUTPUT_TOKENS", str(max(1, min(32_000, server.context // 4))))
        return [executable, *user_args], env
    provider = f'{{name="FreeToken", base_url="{server.url}/v1", wire_api="responses"'
    if api_key:
        env["FREETOKEN_API_KEY"] = api_key
        provider += ', env_key="FREETOKEN_API_KEY"'
    overrides = ['model_provider="freetoken"', f"model_providers.freetoken={provider}}}", f'model="{server.model}"',
                 'web_search="disabled"']
    if server.context is not None:
        overrides.append(f"model_context_window={server.context}")
    return [executable, *[a for o in overrides for a in ("-c", o)], *user_args], env


def launch(args: argparse.Namespace) -> int:
    from freetoken_agent.cli import CLIError

    user_args = split_args(args)
    name, package = CLIENTS[args.client]
    executable = args.cli or shutil.which(name)
    if executable is None:
        raise CLIError(f"{name} is not installed: npm install -g {package} (or give --cli PATH)")
    api_key = args.api_key if args.api_key is not None else os.environ.get("FREETOKEN_API_KEY") or None
    if args.max_tokens is not None and args.client == "codex" and args.url:
        raise CLIError("--max-tokens with --url: Codex sends no output limit, so the running server's "
                       "--default-max-tokens decides it")
    server = start_server(args, api_key)
    try:
        command, env = client_command(args.client, executable, server, api_key, user_args, args.max_tokens)
        print(f"freetoken launch: {name} → {server.url} (model {server.model})", file=sys.stderr, flush=True)
        try:
            return subprocess.run(command, env=env).returncode
        except OSError as exc:
            raise CLIError(f"cannot run {executable}: {exc.strerror or exc}") from None
    finally:
        server.stop()
