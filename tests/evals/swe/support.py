"""Helpers for the SWE-eval tests: the ``freetoken`` CLI run in-process, and small git repositories."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from freetoken_agent.evals.swe.gitops import disable_conversions, git, git_bytes, patch_text

from freetoken_agent import cli


def freetoken(*argv: str, capsys: pytest.CaptureFixture[str] | None = None) -> tuple[int, str, str]:
    """Run ``freetoken ARGV`` through the real ``main``; returns (exit status, stdout, stderr) when ``capsys``
    is given. Only the ``eval`` sub-command is registered, so these tests do not depend on other commands."""
    saved = cli.COMMANDS
    cli.COMMANDS = ["eval"]
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # usage errors exit from argparse, as the installed command does
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        cli.COMMANDS = saved
    out, err = capsys.readouterr() if capsys is not None else ("", "")
    return code, out, err


def make_repo(root: Path, files: dict[str, str | bytes | None], message: str = "commit") -> str:
    """Write ``files`` under ``root`` (text dedented, bytes exactly as given, None deletes; a name that is not
    UTF-8 is given with surrogates, as ``os.fsdecode`` makes it) and commit them, creating the repository if
    needed; blobs hold exactly these bytes whatever ``.gitattributes`` says. Returns the sha."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / ".git").exists():
        git(root, "init", "-q")
        disable_conversions(root)
    for rel, content in files.items():
        path = root / rel
        if content is None:
            path.unlink()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(textwrap.dedent(content).lstrip("\n"), encoding="utf-8")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", message)
    return git(root, "rev-parse", "HEAD").strip()


def diff(root: Path, a: str, b: str, *paths: str) -> str:
    """``git diff --binary a b [-- paths]`` in ``root``, as a task's patch text (``patch_text``)."""
    return patch_text(git_bytes(root, "diff", "--binary", a, b, *(["--", *paths] if paths else [])))


def read_results(out: Path) -> dict[str, dict]:
    """The run folder's results.jsonl as {instance_id: record}."""
    lines = (out / "results.jsonl").read_text().splitlines()
    return {r["instance_id"]: r for r in map(json.loads, lines)}
