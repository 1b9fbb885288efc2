"""Trajectories: one JSON object per line, appended and flushed as the run goes, so a killed process loses nothing
it had written.

Records (``type``): ``run_started`` (task, tools, config), ``message`` (each message added to the conversation),
every agent event except text deltas (``phase_changed``, ``tool_call_started``, ...), ``text`` (the text of a
step, coalesced and written before the next non-text record) and ``run_finished``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


class TrajectoryWriter:
    """Appends records to a JSONL file; each ``write`` reaches the OS before it returns."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")
        self._text: list[str] = []
        self._text_step = 0

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (flushing any pending text first)."""
        self._flush_text()
        self._write(record)

    def text(self, step: int, text: str) -> None:
        """Buffer streamed text; it is written as one ``text`` record before the next record."""
        if self._text and step != self._text_step:
            self._flush_text()
        self._text_step = step
        self._text.append(text)

    def close(self) -> None:
        """Write pending text and close the file (idempotent)."""
        if self._file is None:
            return
        self._flush_text()
        self._file.close()
        self._file = None

    def _flush_text(self) -> None:
        if self._text:
            text, self._text = "".join(self._text), []
            self._write({"type": "text", "step": self._text_step, "text": text})

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            raise ValueError(f"trajectory {self.path} is closed")
        record = {"t": round(time.time(), 3), **record}
        self._file.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        self._file.flush()


class TrajectoryError(ValueError):
    """A trajectory file cannot be read; the message names the file and line."""


def read_trajectory(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The records of a trajectory file, in order. A half-written last line (a killed writer) is skipped."""
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TrajectoryError(f"cannot read trajectory {file}: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                return
            raise TrajectoryError(f"{file}:{number}: not a JSON line") from None
        if not isinstance(record, dict) or "type" not in record:
            raise TrajectoryError(f"{file}:{number}: a trajectory record must be an object with a 'type'")
        yield record


def assistant_turns(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The assistant messages of a trajectory, in order: the script to replay it with ``ScriptedBackend``."""
    return [r["message"] for r in read_trajectory(path)
            if r["type"] == "message" and r.get("message", {}).get("role") == "assistant"]
