"""Helpers for the SWE-eval tests: the ``freetoken`` CLI run in-process, and small git repositories."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from freetoken_agent.evals.swe.gitops import git

from freetoken_agent import cli


def freetoken(*argv: str, capsys: pytest.CaptureFixture[str] | None = None) -> tuple[int, str, str]:
    """Run ``freetoken ARGV`` through the real ``main``; returns (exit status, stdout, stderr) when ``capsys``
    is given. Only the ``eval`` sub-command is registered, so these tests do not depend on other commands."""
    saved = cli.COMMANDS
    cli.COMMANDS = ["eval"]
    try:
        code = cli.main(list(argv))
    finally:
        cli.COMMANDS = saved
    out, err = capsys.readouterr() if capsys is not None else ("", "")
    return code, out, err


def make_repo(root: Path, files: dict[str, str], message: str = "commit") -> str:
    """Write ``files`` (dedented) under ``root``, commit them (creating the repository if needed); return the sha."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / ".git").exists():
        git(root, "init", "-q")
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", message)
    return git(root, "rev-parse", "HEAD").strip()


def diff(root: Path, a: str, b: str) -> str:
    """``git diff a b`` in ``root``."""
    return git(root, "diff", a, b)


def read_results(out: Path) -> dict[str, dict]:
    """The run folder's results.jsonl as {instance_id: record}."""
    lines = (out / "results.jsonl").read_text().splitlines()
    return {r["instance_id"]: r for r in map(json.loads, lines)}
