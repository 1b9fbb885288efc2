"""Per-task results and the run folder that holds them.

A run folder contains ``run.json`` (what was run), ``results.jsonl`` (one line appended per finished task, so
a crash loses nothing and ``--resume`` re-runs only the tasks without a line), ``predictions.jsonl`` (the
agent's patches in SWE-bench's prediction format) and ``tasks/<instance_id>/`` (patch, test log, transcript).

Patches are stored losslessly: ``tasks/<id>/model.patch`` holds the exact bytes of the diff. In predictions.jsonl
``model_patch`` is text as SWE-bench expects (``gitops.patch_text``: exact for UTF-8 patches, CRLF and binary
patches included, as JSON escapes ``\\r``); a patch that is not valid UTF-8 (raw bytes of a non-UTF-8 text
file) also gets ``model_patch_base64`` with its exact bytes, for readers other than Python.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import threading
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from freetoken_agent.evals.swe.gitops import patch_bytes, patch_text
from freetoken_agent.evals.swe.task import EvalError
from freetoken_agent.trajectory import ends_without_newline

RESOLVED, UNRESOLVED, SKIPPED, ERROR = "resolved", "unresolved", "skipped", "error"


@dataclass
class TaskResult:
    """The outcome of one task: the score, why, and what it cost."""

    instance_id: str
    status: str
    """resolved | unresolved | skipped (the environment is unavailable) | error (the harness failed)."""
    reason: str = ""
    """Why a task is not resolved, was skipped, or errored (one line)."""
    wall_s: float = 0.0
    agent_s: float = 0.0
    tests_s: float = 0.0
    turns: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    patch_bytes: int = 0
    fail_to_pass: dict[str, list[str]] = field(default_factory=dict)
    """``{"success": [...], "failure": [...]}`` as in SWE-bench's report."""
    pass_to_pass: dict[str, list[str]] = field(default_factory=dict)
    timed_out_tests: list[str] = field(default_factory=list)
    agent_stopped: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TaskResult:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def prediction(instance_id: str, model_name: str, patch: bytes) -> dict[str, Any]:
    """One line of predictions.jsonl (SWE-bench's format; see the module docstring for the patch fields)."""
    record: dict[str, Any] = {"instance_id": instance_id, "model_name_or_path": model_name,
                              "model_patch": patch_text(patch)}
    try:
        patch.decode("utf-8")
    except UnicodeDecodeError:
        record["model_patch_base64"] = base64.b64encode(patch).decode("ascii")
    return record


def prediction_patch(record: dict[str, Any]) -> bytes:
    """The exact bytes of a prediction's patch (``model_patch_base64`` when present, else ``model_patch``)."""
    if "model_patch_base64" in record:
        try:
            return base64.b64decode(record["model_patch_base64"], validate=True)
        except binascii.Error as exc:
            raise ValueError(f"model_patch_base64 is not base64: {exc}") from None
    return patch_bytes(record["model_patch"] or "")


class RunStore:
    """The files of one run folder; appends are thread-safe and flushed to disk line by line."""

    def __init__(self, out_dir: Path) -> None:
        self.dir = out_dir
        self.results_path = out_dir / "results.jsonl"
        self.predictions_path = out_dir / "predictions.jsonl"
        self.meta_path = out_dir / "run.json"
        self._lock = threading.Lock()

    def task_dir(self, instance_id: str) -> Path:
        path = self.dir / "tasks" / instance_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    def check(self, meta: dict[str, Any], resume: bool) -> None:
        """Raise ``EvalError`` unless ``start(meta, resume)`` would succeed; writes nothing."""
        if resume:
            if not self.meta_path.exists():
                raise EvalError(f"nothing to resume in {self.dir} (no run.json)")
            old = json.loads(self.meta_path.read_text(encoding="utf-8"))
            for key in ("agent", "model", "tasks"):
                if old.get(key) != meta.get(key):
                    raise EvalError(f"cannot resume {self.dir}: it was run with {key}={old.get(key)!r}, "
                                    f"not {meta.get(key)!r}")
        elif self.results_path.exists() or self.meta_path.exists():
            raise EvalError(f"{self.dir} already holds a run; pass --resume to continue it or choose another --out")

    def start(self, meta: dict[str, Any], resume: bool) -> dict[str, TaskResult]:
        """Open the folder for a run. Fresh runs need an empty folder; ``resume`` needs the same agent, model
        and task file as before. Returns the results already recorded (empty for a fresh run)."""
        self.check(meta, resume)
        if resume:
            return self.load(repair=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.meta_path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        return {}

    def meta(self) -> dict[str, Any]:
        return json.loads(self.meta_path.read_text(encoding="utf-8")) if self.meta_path.exists() else {}

    def load(self, repair: bool = False) -> dict[str, TaskResult]:
        """Results recorded so far (the last one wins); torn lines from a crash are skipped, and with ``repair``
        also removed from the file, so the next append starts on a fresh line."""
        results: dict[str, TaskResult] = {}
        if not self.results_path.exists():
            return results
        good: list[str] = []
        for line in self.results_path.read_text(encoding="utf-8").split("\n"):
            if not line.strip():
                continue
            try:
                result = TaskResult.from_dict(json.loads(line))
            except (json.JSONDecodeError, TypeError):
                continue
            results[result.instance_id] = result
            good.append(line)
        if repair:
            self.results_path.write_text("".join(f"{ln}\n" for ln in good), encoding="utf-8")
        return results

    def append(self, result: TaskResult, model_patch: bytes | None, model_name: str) -> None:
        """Record a finished task (and its prediction) durably."""
        with self._lock:
            self._append_line(self.results_path, asdict(result))
            if model_patch is not None:
                self._append_line(self.predictions_path, prediction(result.instance_id, model_name, model_patch))

    def predictions(self) -> dict[str, bytes]:
        """The agent's patches recorded so far, as exact bytes, by instance id (the last one wins)."""
        patches: dict[str, bytes] = {}
        if self.predictions_path.exists():
            for number, line in enumerate(self.predictions_path.read_text(encoding="utf-8").split("\n"), 1):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # empty, or torn by a crash (as in ``load``)
                try:
                    patches[record["instance_id"]] = prediction_patch(record)
                except (KeyError, TypeError, ValueError) as exc:
                    raise EvalError(f"{self.predictions_path}:{number}: not a prediction record ({exc})") from None
        return patches

    @staticmethod
    def _append_line(path: Path, record: dict[str, Any]) -> None:
        torn = ends_without_newline(path)  # a crash mid-line: start a new one, or this record is lost with it
        with path.open("a", encoding="utf-8") as f:
            f.write(("\n" if torn else "") + json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
