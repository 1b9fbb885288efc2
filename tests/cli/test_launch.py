"""The real agent CLIs — Claude Code (``claude -p``) and Codex (``codex exec``), installed from npm into a cache
folder — run a turn with a tool-call round trip against ``freetoken serve`` (scripted answers) via
``freetoken launch``: the model asks for a shell command, the CLI runs it and sends the result back, the model
answers. Against the built-in model (4096-token context) they get honest answers they understand: their default
prompts (Claude Code's ~24k tokens, Codex's ~11k in its tokenizer) are refused as too long for the context, a turn
cut at the output limit is read as one (both CLIs then stop with their own max-output error), and a plain turn with
their prompts slimmed to fit ends (the model's end of turn) and exits 0. Skipped (with the reason) only when npm is
missing."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

import pytest

LAUNCH = "import sys; from freetoken_agent.cli import main; sys.exit(main())"  # the `freetoken` entry point
NPM_CACHE = Path(os.environ.get("FREETOKEN_NPM_CACHE", Path.home() / ".cache" / "freetoken" / "npm"))
"""Where the CLIs are installed once (``npm install --prefix``); later runs reuse them."""
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex"}
FINAL = "Done: the proof is written."


def npm_cli(name: str) -> Path:
    """The CLI ``name`` from the cache folder, installed with npm on first use."""
    binary = NPM_CACHE / "node_modules" / ".bin" / name
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed: cannot install {PACKAGES[name]} to drive the real {name} CLI")
    NPM_CACHE.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([npm, "install", "--prefix", str(NPM_CACHE), "--no-audit", "--no-fund", PACKAGES[name]],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and binary.exists(), f"npm install {PACKAGES[name]} failed: {done.stderr[-2000:]}"
    return binary


def _run_launch(tmp_path: Path, client: str, launch_args: list[str], client_args: list[str],
                ) -> subprocess.CompletedProcess:
    """``freetoken launch CLIENT LAUNCH_ARGS -- CLIENT_ARGS`` in a fresh work folder, with the CLI's own config and
    state (``HOME``, ``CODEX_HOME``) inside ``tmp_path``."""
    work = tmp_path / "work"
    work.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    env = dict(os.environ, HOME=str(home), CODEX_HOME=str(home), IS_SANDBOX="1")
    for name in ("CLAUDE_CODE_MAX_OUTPUT_TOKENS", "CLAUDE_CODE_ATTRIBUTION_HEADER"):
        env.pop(name, None)  # launch decides them
    command = [sys.executable, "-c", LAUNCH, "launch", client, *launch_args, "--cli", str(npm_cli(client)), "--",
               *client_args]
    return subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)


def _launch(tmp_path: Path, client: str, call: dict, client_args: list[str]) -> subprocess.CompletedProcess:
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"content": "Writing the proof.", "tool_calls": [call]}, FINAL]))
    return _run_launch(tmp_path, client, ["--script", str(script), "--threads", "1"], client_args)


def _check(done: subprocess.CompletedProcess, tmp_path: Path) -> None:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (tmp_path / "work" / "proof.txt").read_text().strip() == "42"  # the CLI ran the command
    assert FINAL in done.stdout  # and asked the model again with its result: the second scripted turn
    assert "Traceback" not in done.stderr


def test_claude_code_runs_a_tool_round_trip(tmp_path: Path) -> None:
    call = {"name": "Bash", "arguments": {"command": "echo $((6*7)) > proof.txt", "description": "Write the proof"}}
    done = _launch(tmp_path, "claude", call, ["-p", "Write the proof.", "--allowedTools", "Bash"])
    _check(done, tmp_path)


def test_codex_runs_a_tool_round_trip(tmp_path: Path) -> None:
    call = {"name": "exec_command", "arguments": {"cmd": "echo $((6*7)) > proof.txt"}}
    done = _launch(tmp_path, "codex", call, ["exec", "--skip-git-repo-check",
                                             "--dangerously-bypass-approvals-and-sandbox", "Write the proof."])
    _check(done, tmp_path)


def test_launch_without_the_cli_is_one_line(tmp_path: Path) -> None:
    env = dict(os.environ, PATH=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", LAUNCH, "launch", "codex", "--", "exec", "hi"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == ("freetoken launch: error: codex is not installed: npm install -g @openai/codex "
                                   "(or give --cli PATH)")


CUT = 8
"""The built-in model's answers are cut at this many tokens where a test wants a turn cut at the output limit."""
PLAIN_LIMIT = 512
"""Output limit of a plain turn (Claude Code's slimmed prompt plus this must fit the 4096-token context, which the
Messages API checks): the built-in model ends a plain answer in ~100 tokens on average (37 of 40 sampled plain
turns ended within 512 tokens, measured on the shipped weights)."""


@pytest.fixture(scope="module")
def builtin_server() -> Iterator[str]:
    """``freetoken serve`` on the built-in model (context 4096), answers cut at ``CUT`` tokens when a request sets
    no limit (Codex sets none)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-c", LAUNCH, "serve", "--port", str(port), "--threads", "1",
                                "--default-max-tokens", str(CUT)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stderr.read() if process.stderr else "serve exited"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the built-in server did not start within 120 s"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _on_builtin(tmp_path: Path, url: str, client: str, launch_args: list[str], client_args: list[str]) -> str:
    done = _run_launch(tmp_path, client, ["--url", url, *launch_args], client_args)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert "Traceback" not in output
    return output


def test_claude_code_default_prompt_is_refused_as_too_long(tmp_path: Path, builtin_server: str) -> None:
    """Claude Code's own prompt (~24k tokens for this tokenizer) does not fit the 4096-token context: the server's
    400 (Anthropic's "prompt is too long" wording, with the numbers) is what Claude Code reports."""
    output = _on_builtin(tmp_path, builtin_server, "claude", [], ["-p", "Say hi."])
    assert "Prompt is too long" in output and "(limit 4096)" in output


def test_codex_default_prompt_is_refused_as_too_long(tmp_path: Path, builtin_server: str) -> None:
    """Codex's prompt (~11k tokens: its base instructions and tool specs) does not fit either: the server's
    ``context_length_exceeded`` is what Codex reports."""
    output = _on_builtin(tmp_path, builtin_server, "codex", [], ["exec", "--skip-git-repo-check", "Say hi."])
    assert "ran out of room in the model's context window" in output


def test_claude_code_reads_a_turn_cut_at_the_output_limit(tmp_path: Path, builtin_server: str) -> None:
    """A prompt slimmed with Claude Code's own flags fits; the built-in model's answer is cut at ``--max-tokens``
    (``stop_reason: max_tokens``): Claude Code asks it to resume three times, then stops with its max-output error."""
    output = _on_builtin(tmp_path, builtin_server, "claude", ["--max-tokens", str(CUT)],
                         ["-p", "Say hi.", "--system-prompt", "You are a helpful assistant.", "--tools", ""])
    assert f"Claude's response exceeded the {CUT} output token maximum" in output


def test_codex_reads_a_turn_cut_at_the_output_limit(tmp_path: Path, builtin_server: str) -> None:
    """Codex slimmed with its own options (short instructions, no multi-agent or goal tools) fits; the answer cut at
    the server's default length is a ``response.incomplete`` (reason ``max_output_tokens``), which Codex reports."""
    instructions = tmp_path / "instructions.md"
    instructions.write_text("You are a helpful assistant.\n")
    output = _on_builtin(tmp_path, builtin_server, "codex", [], [
        "exec", "--skip-git-repo-check", "-c", f"model_instructions_file={json.dumps(str(instructions))}",
        "--disable", "multi_agent", "--disable", "goals", "Say hi."])
    assert "Incomplete response returned, reason: max_output_tokens" in output


def test_codex_max_tokens_needs_a_server_launch_starts(tmp_path: Path) -> None:
    """Codex sends no output limit, so ``--max-tokens`` can only go to a server launch starts itself."""
    done = subprocess.run([sys.executable, "-c", LAUNCH, "launch", "codex", "--url", "http://127.0.0.1:9",
                           "--max-tokens", "8", "--cli", sys.executable, "--", "exec", "hi"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == ("freetoken launch: error: --max-tokens with --url: Codex sends no output limit, "
                                   "so the running server's --default-max-tokens decides it")


def test_claude_code_plain_turn_on_the_builtin_model_exits_0(tmp_path: Path) -> None:
    """A plain question, Claude Code's prompt slimmed to fit the 4096-token context: the built-in model answers and
    ends its turn (``stop_reason: end_turn``), Claude Code prints the answer and exits 0."""
    done = _run_launch(tmp_path, "claude", ["--threads", "1", "--max-tokens", str(PLAIN_LIMIT)],
                       ["-p", "Say hi.", "--system-prompt", "You are a helpful assistant.", "--tools", ""])
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.strip()  # the model's answer
    assert "Traceback" not in done.stderr


def test_codex_plain_turn_on_the_builtin_model_exits_0(tmp_path: Path) -> None:
    """The same with Codex (short instructions, no multi-agent or goal tools; its shell tools stay offered): the
    built-in model answers without a tool call and ends its turn, Codex exits 0."""
    instructions = tmp_path / "instructions.md"
    instructions.write_text("You are a helpful assistant.\n")
    done = _run_launch(tmp_path, "codex", ["--threads", "1", "--max-tokens", str(PLAIN_LIMIT)], [
        "exec", "--skip-git-repo-check", "-c", f"model_instructions_file={json.dumps(str(instructions))}",
        "--disable", "multi_agent", "--disable", "goals", "Say hi."])
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "Traceback" not in done.stderr
