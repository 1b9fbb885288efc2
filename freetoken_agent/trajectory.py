"""Trajectories: one JSON object per line, appended and flushed as the run goes, so a killed process loses nothing
it had written.

Records (``type``): ``run_started`` (task, tools, config), ``message`` (each message added to the conversation),
every agent event except text deltas (``phase_changed``, ``tool_call_started``, ...), ``text`` (the text of a
step, coalesced and written before the next non-text record) and ``run_finished``.

A file may hold several runs (each run appends). A writer killed mid-write leaves a torn last line (part of a
record, no newline); the next writer starts on a new line, so the fragment never swallows its first record, and
readers skip the fragment with a ``TrajectoryWarning`` naming the file and line. An unreadable line anywhere
else (inside a run) is corruption, not a crash: readers raise ``TrajectoryError`` naming the line, since a run
with a record missing would replay differently.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from freetoken_agent.runtime.errors import FreeTokenError

# Every record starts with this (the writer puts ``t`` first, json's default separators): where a torn fragment
# from an older writer swallowed the start of the next record, the record is found again at this marker.
_RECORD_START = b'{"t": '


class TrajectoryWriter:
    """Appends records to a JSONL file; each ``write`` reaches the OS before it returns."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torn = ends_without_newline(self.path)
        # backslashreplace: a lone surrogate in a string (text decoded with surrogateescape) is written as its
        # JSON escape (\\udcXX), which reads back as the same string, instead of failing the run.
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8", errors="backslashreplace", newline="\n")
        if torn:  # a killed writer's last line: end it, so the first record of this run is a line of its own
            self._file.write("\n")
            self._file.flush()
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


def ends_without_newline(path: Path) -> bool:
    """True when ``path`` exists, is not empty, and its last byte is not a newline: a JSONL file whose writer was
    killed mid-line, where an append must start with a newline."""
    try:
        with path.open("rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


class TrajectoryError(FreeTokenError, ValueError):
    """A trajectory file cannot be read; the message names the file and line."""


class TrajectoryWarning(UserWarning):
    """A torn line (a writer killed mid-record) was skipped; the message names the file and line."""


def _record(line: bytes) -> dict[str, Any] | None:
    """The JSON value of one line, or None when the line is not JSON (torn, or bytes that are not UTF-8)."""
    try:
        return json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


def _split_swallowed(line: bytes) -> dict[str, Any] | None:
    """The record at the end of an unreadable line whose start is a torn fragment (an older writer appended
    without starting a new line), or None."""
    start = line.find(_RECORD_START, 1)
    while start != -1:
        record = _record(line[start:])
        if isinstance(record, dict):
            return record
        start = line.find(_RECORD_START, start + 1)
    return None


def _warn_torn(file: Path, number: int) -> None:
    warnings.warn(f"{file}:{number}: skipped a torn line (a writer was killed mid-record)", TrajectoryWarning,
                  stacklevel=3)


def read_trajectory(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The records of a trajectory file, in order. Lines are split at newline bytes only and decoded one by one.
    A line that is not JSON is a torn write when the file ends after it or the next record starts a run
    (``run_started``): it is skipped with a ``TrajectoryWarning``. Otherwise ``TrajectoryError`` names it."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise TrajectoryError(f"cannot read trajectory {file}: {exc.strerror or exc}") from None
    torn: list[int] = []  # unreadable lines not yet known to be torn tails or corruption
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        record = _record(line)
        if record is None:
            record = _split_swallowed(line)
            if record is None:
                torn.append(number)
                continue
            torn.append(number)  # the fragment before the swallowed record
        if not isinstance(record, dict) or "type" not in record:
            raise TrajectoryError(f"{file}:{number}: a trajectory record must be an object with a 'type'")
        if torn:
            if record["type"] != "run_started":
                raise TrajectoryError(f"{file}:{torn[0]}: not a JSON line (a corrupt record inside a run; "
                                      f"the next record, line {number}, is a {record['type']!r})")
            for bad in torn:
                _warn_torn(file, bad)
            torn = []
        yield record
    for bad in torn:
        _warn_torn(file, bad)


def assistant_turns(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The assistant messages of a trajectory, in order: the script to replay it with ``ScriptedBackend``."""
    return [r["message"] for r in read_trajectory(path)
            if r["type"] == "message" and r.get("message", {}).get("role") == "assistant"]
