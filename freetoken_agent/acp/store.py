"""Saved sessions: one ``<id>.json`` per session, written after every turn, for ``session/load``,
``session/resume`` and ``session/list``."""

from __future__ import annotations

import json
import os
import re
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from freetoken_agent.acp.jsonrpc import INTERNAL_ERROR, RpcError

_SESSION_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
PAGE_SIZE = 50


class SessionStore:
    """A folder of session records (``id``, ``cwd``, ``title``, ``history``, ``saved``, ...)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def save(self, record: dict[str, Any]) -> None:
        """Write ``record`` atomically; a failure is logged (the turn itself succeeded)."""
        session_id = str(record["id"])
        tmp = self.folder / f".{session_id}.{os.getpid()}.tmp"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(record, ensure_ascii=False, default=str), encoding="utf-8")
            os.replace(tmp, self.folder / f"{session_id}.json")
        except OSError as exc:
            print(f"freetoken acp: cannot save session {session_id} in {self.folder}: {exc.strerror or exc}",
                  file=sys.stderr)

    def load(self, session_id: str) -> dict[str, Any]:
        """The record of ``session_id``; ``RpcError`` (resource not found) when there is none."""
        if not _SESSION_ID.match(session_id) or session_id.startswith("."):
            raise RpcError.not_found(f"unknown session {session_id[:100]!r}")
        path = self.folder / f"{session_id}.json"
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise RpcError.not_found(f"unknown session {session_id!r}") from None
        except (OSError, ValueError) as exc:
            raise RpcError(INTERNAL_ERROR, f"session {session_id!r} cannot be read: {exc}") from None
        if not isinstance(record, dict):
            raise RpcError(INTERNAL_ERROR, f"session {session_id!r} is not a session record")
        return record

    def list(self, cwd: str | None = None, cursor: str | None = None) -> dict[str, Any]:
        """A ``session/list`` result: newest first, ``PAGE_SIZE`` per page, optionally only those in ``cwd``."""
        try:
            start = int(cursor) if cursor else 0
        except ValueError:
            raise RpcError.invalid_params(f"invalid cursor {cursor[:50]!r}") from None
        infos: list[tuple[float, dict[str, Any]]] = []
        for path in self.folder.glob("*.json") if self.folder.is_dir() else ():
            try:
                record = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # a damaged file is skipped, not fatal to the listing
            if not isinstance(record, dict) or not isinstance(record.get("cwd"), str):
                continue
            if cwd is not None and os.path.realpath(record["cwd"]) != os.path.realpath(cwd):
                continue
            saved = float(record.get("saved") or 0.0)
            info: dict[str, Any] = {"sessionId": path.stem, "cwd": record["cwd"],
                                    "updatedAt": datetime.fromtimestamp(saved, timezone.utc).isoformat()}
            if record.get("title"):
                info["title"] = str(record["title"])
            infos.append((saved, info))
        infos.sort(key=lambda item: item[0], reverse=True)
        page = [info for _, info in infos[start:start + PAGE_SIZE]]
        result: dict[str, Any] = {"sessions": page}
        if start + PAGE_SIZE < len(infos):
            result["nextCursor"] = str(start + PAGE_SIZE)
        return result
