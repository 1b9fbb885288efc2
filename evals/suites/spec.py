"""How a built-in suite task is written, and how it becomes a SWE-bench task with a real git repository.

A ``SuiteTask`` holds the repository's files at the base commit, the gold fix and the test change as edits.
``materialize`` writes each task as a git repository (fixed author and dates, so ``base_commit`` is the same
on every machine), derives ``patch`` and ``test_patch`` with ``git diff``, and writes a SWE-bench JSONL that
the harness (or any SWE-bench-style tool) loads like any other.
"""

from __future__ import annotations

import shutil
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from freetoken_agent.evals.swe.gitops import git
from freetoken_agent.evals.swe.task import Task, write_tasks

Edit = str | list[tuple[str, str]]
"""A whole new file content, or exact ``(old, new)`` replacements (``old == ""`` appends ``new`` after two
blank lines)."""


@dataclass(frozen=True)
class SuiteTask:
    """One bug-fix task of a built-in suite (file contents are dedented)."""

    name: str
    kind: str
    """The kind of bug: off-by-one, wrong-condition, missing-case, wrong-api, multi-file."""
    problem: str
    files: dict[str, str]
    fix: dict[str, Edit]
    tests: dict[str, Edit]
    fail_to_pass: list[str]
    pass_to_pass: list[str] = field(default_factory=list)


def _apply(root: Path, edits: dict[str, Edit]) -> None:
    for rel, edit in edits.items():
        path = root / rel
        if isinstance(edit, str):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_clean(edit), encoding="utf-8")
            continue
        text = path.read_text(encoding="utf-8")
        for old, new in edit:
            if old == "":
                text = text.rstrip("\n") + "\n\n\n" + _clean(new)
                continue
            count = text.count(old)
            if count != 1:
                raise ValueError(f"{rel}: edit target found {count} times: {old[:50]!r}")
            text = text.replace(old, new)
        path.write_text(text, encoding="utf-8")


def _clean(text: str) -> str:
    return textwrap.dedent(text).strip("\n") + "\n"


def _diff_after(repo: Path, base: str, edits: dict[str, Edit]) -> str:
    _apply(repo, edits)
    git(repo, "add", "-A")
    diff = git(repo, "diff", "--cached", "--no-color", base, "--")
    git(repo, "reset", "-q", "--hard", base)
    git(repo, "clean", "-qfd")
    return diff


def build_task(spec: SuiteTask, suite: str, repo: Path) -> Task:
    """Create ``repo`` (a git repository at the task's base commit) and return the SWE-bench task."""
    repo.mkdir(parents=True)
    _apply(repo, {rel: content for rel, content in spec.files.items()})
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"{spec.name}: base")
    base = git(repo, "rev-parse", "HEAD").strip()
    return Task(
        instance_id=f"{suite}__{spec.name}",
        repo=str(repo),
        base_commit=base,
        problem_statement=_clean(spec.problem),
        patch=_diff_after(repo, base, spec.fix),
        test_patch=_diff_after(repo, base, spec.tests),
        FAIL_TO_PASS=spec.fail_to_pass,
        PASS_TO_PASS=spec.pass_to_pass,
        test_timeout_s=30.0,
        agent_timeout_s=900.0,
        # The tasks need no pytest plugins; not loading the user's installed ones makes each run ~5x faster.
        env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        kind=spec.kind,
    )


def materialize(specs: list[SuiteTask], suite: str, dest: Path) -> Path:
    """Write ``dest/repos/<instance_id>`` (git repositories) and ``dest/<suite>.jsonl``; return the JSONL path.
    Repositories already there are rebuilt."""

    tasks = []
    for spec in specs:
        repo = dest / "repos" / f"{suite}__{spec.name}"
        if repo.exists():
            shutil.rmtree(repo)
        tasks.append(build_task(spec, suite, repo))
    path = dest / f"{suite}.jsonl"
    write_tasks(tasks, path)
    return path
