"""The task format: SWE-bench instances (one JSON object per line) plus a few optional local fields.

A SWE-bench JSONL loads unchanged: ``FAIL_TO_PASS``/``PASS_TO_PASS`` may be JSON-encoded strings (as in the
Hugging Face export) or lists, and unknown fields (``version``, ``hints_text``, ...) are kept but unused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from freetoken_agent.runtime.errors import FreeTokenError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class EvalError(FreeTokenError):
    """Bad eval input (a task file, a suite name, an output folder); reported as one line."""


class Task(BaseModel):
    """One evaluation instance: a repository at a commit, an issue text, and the tests that decide it."""

    model_config = ConfigDict(extra="allow", frozen=True)

    instance_id: str
    """Unique id, e.g. ``astropy__astropy-12907``; also the name of the task's output folder."""
    repo: str
    """A local path (git repository or plain folder), a git URL, or a SWE-bench ``owner/name`` slug."""
    base_commit: str = ""
    """The commit the workspace is checked out at (empty for a plain folder)."""
    problem_statement: str
    """The issue text the agent is given."""
    patch: str = ""
    """The gold patch (a git diff; binary files as git binary patches); only the gold agent reads it. Applied as
    bytes: CRLF and every other byte is kept, bytes that are not UTF-8 are lone surrogates (``gitops.patch_text``)."""
    test_patch: str = ""
    """Applied after the agent's patch, before the tests run (adds/updates the deciding tests); bytes as ``patch``."""
    FAIL_TO_PASS: list[str] = Field(default_factory=list)
    """Tests that fail at ``base_commit`` and must pass after the fix."""
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    """Tests that pass at ``base_commit`` and must keep passing."""
    setup: list[str] = Field(default_factory=list)
    """Local extra: shell commands run in each fresh workspace before the agent and before the tests."""
    test_command: str | None = None
    """Local extra: a shell command run once per test with ``{test}`` replaced (exit 0 = passed). Without it
    the tests are pytest node ids run with ``python -m pytest``."""
    env: dict[str, str] = Field(default_factory=dict)
    """Local extra: environment variables added for setup commands and tests."""
    python: str | None = None
    """Local extra: the interpreter that runs setup and tests (default: the one running the harness)."""
    test_timeout_s: float = 60.0
    """Local extra: seconds one test may run before its process group is killed and it counts as failed."""
    agent_timeout_s: float = 1800.0
    """Local extra: seconds the agent may work on the task."""

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", "setup", mode="before")
    @classmethod
    def _json_list(cls, value: Any) -> Any:
        # SWE-bench's Hugging Face export stores these lists as JSON strings.
        if isinstance(value, str):
            value = value.strip()
            if not value:
                return []
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON list: {value[:60]!r}") from exc
        return value

    @field_validator("instance_id")
    @classmethod
    def _safe_id(cls, value: str) -> str:
        if not value or "/" in value or "\\" in value or value in {".", ".."}:
            raise ValueError(f"instance_id {value!r} must be a non-empty name without path separators")
        return value

    @property
    def tests(self) -> list[str]:
        """FAIL_TO_PASS then PASS_TO_PASS, without duplicates."""
        return list(dict.fromkeys([*self.FAIL_TO_PASS, *self.PASS_TO_PASS]))


def load_tasks(path: Path, base_dir: Path | None = None) -> list[Task]:
    """Read tasks from a JSONL file (or a JSON list). Relative local ``repo`` paths resolve against the file's
    folder (or ``base_dir``). Raises ``EvalError`` naming the line of the first bad record."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise EvalError(f"cannot read task file {path}: {exc.strerror or exc}") from exc
    records: list[tuple[int, Any]] = []
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            records = [(i + 1, r) for i, r in enumerate(json.loads(stripped))]
        except json.JSONDecodeError as exc:
            raise EvalError(f"{path}: not valid JSON: {exc.msg} (line {exc.lineno})") from exc
    else:
        # Split at "\n" only: str.splitlines also splits at U+2028, U+0085, ... that JSON strings may hold raw.
        for lineno, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                records.append((lineno, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise EvalError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from exc
    base = base_dir or path.parent
    tasks: list[Task] = []
    seen: set[str] = set()
    for lineno, record in records:
        if not isinstance(record, dict):
            raise EvalError(f"{path}:{lineno}: a task must be a JSON object")
        try:
            task = Task.model_validate(record)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "record"
            raise EvalError(f"{path}:{lineno}: field {where}: {err['msg']}") from exc
        if task.instance_id in seen:
            raise EvalError(f"{path}:{lineno}: duplicate instance_id {task.instance_id!r}")
        seen.add(task.instance_id)
        tasks.append(_resolve_repo(task, base))
    if not tasks:
        raise EvalError(f"{path}: no tasks")
    return tasks


def _resolve_repo(task: Task, base: Path) -> Task:
    repo = task.repo
    if "://" in repo or repo.startswith("git@") or Path(repo).is_absolute():
        return task
    local = base / repo
    if local.exists():
        return task.model_copy(update={"repo": str(local.resolve())})
    return task  # a SWE-bench slug or a missing path: the harness resolves or skips it


def write_tasks(tasks: list[Task], path: Path) -> None:
    """Write tasks as SWE-bench JSONL (lists as JSON lists; our local fields only when set)."""
    with path.open("w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(task.model_dump(exclude_defaults=True)) + "\n")
