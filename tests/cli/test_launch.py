"""The real agent CLIs — Claude Code (``claude -p``) and Codex (``codex exec``), installed from npm into a cache
folder — run a turn with a tool-call round trip against ``freetoken serve`` (scripted answers) via
``freetoken launch``: the model asks for a shell command, the CLI runs it and sends the result back, the model
answers. Skipped (with the reason) only when npm is missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

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


def _launch(tmp_path: Path, client: str, call: dict, client_args: list[str]) -> subprocess.CompletedProcess:
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"content": "Writing the proof.", "tool_calls": [call]}, FINAL]))
    work = tmp_path / "work"
    work.mkdir()
    home = tmp_path / "home"  # the CLIs' own config and state stay inside the test
    home.mkdir()
    env = dict(os.environ, HOME=str(home), CODEX_HOME=str(home), IS_SANDBOX="1")
    command = [sys.executable, "-c", LAUNCH, "launch", client, "--script", str(script), "--threads", "1",
               "--cli", str(npm_cli(client)), "--", *client_args]
    return subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)


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
