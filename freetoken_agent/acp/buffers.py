"""``read_file`` through the editor (``fs/read_text_file``) when the client offers it: the model then sees the
buffer as the user has it, unsaved changes included. Paths stay confined to the workspace; any failure falls back
to reading the file from disk with the normal tool."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from freetoken_agent.acp.jsonrpc import RpcError
from freetoken_agent.tools import ToolResult, Workspace, WorkspaceError

if TYPE_CHECKING:
    from freetoken_agent.acp.jsonrpc import Connection

MAX_LINES = 2000  # the same page size as the read_file tool


def _line_arg(value: Any, default: int | None) -> int | None:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("line numbers must be integers")
    return value


async def read_via_client(conn: Connection, session_id: str, workspace: Workspace, args: dict[str, Any],
                          max_chars: int) -> ToolResult | None:
    """The ``read_file`` result from the editor's buffer, or None to read from disk instead."""
    try:
        path = workspace.resolve(args["path"]) if isinstance(args.get("path"), str) else None
        start = _line_arg(args.get("start_line"), 1)
        end = _line_arg(args.get("end_line"), None)
    except (WorkspaceError, ValueError):
        return None  # the tool itself reports the problem to the model
    if path is None or start is None or start < 1 or (end is not None and end < start) or not path.is_file():
        return None
    limit = min(MAX_LINES, end - start + 1) if end is not None else MAX_LINES
    try:
        answer = await conn.request("fs/read_text_file", {"sessionId": session_id, "path": str(path),
                                                          "line": start, "limit": limit})
    except RpcError as exc:
        print(f"freetoken acp: fs/read_text_file failed ({exc.message}); reading {path} from disk", file=sys.stderr)
        return None
    content = answer.get("content") if isinstance(answer, dict) else None
    if not isinstance(content, str):
        return None
    rel = workspace.relative(path)
    lines = content.splitlines()[:limit]
    if not lines:
        return ToolResult(content=f"{rel} is empty (editor buffer).", data={"paths": [rel], "lines": 0})
    shown: list[str] = []
    budget = max_chars
    for number, text in enumerate(lines, start):
        entry = f"{number:>6}\t{text}"
        if len(entry) + 1 > budget and shown:
            break
        budget -= len(entry) + 1
        shown.append(entry)
    last = start + len(shown) - 1
    more = len(shown) < len(lines) or (end is None and len(lines) == MAX_LINES)
    follow = f"; more follow: call again with start_line={last + 1}" if more else ""
    notes = [f"[from the editor's buffer: lines {start}-{last}{follow}]"]
    return ToolResult(content="\n".join(shown + notes),
                      data={"paths": [rel], "start_line": start, "end_line": last, "source": "editor"})
