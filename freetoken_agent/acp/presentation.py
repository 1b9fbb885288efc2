"""How a tool call looks in the editor: title, ACP tool kind, file locations and diffs, from its arguments."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from freetoken_agent.tools import Workspace, WorkspaceError

MAX_LOCATIONS = 20
MAX_DIFF_FILE_BYTES = 2 * 2**20  # larger files are not shown as diffs
_TITLES = {
    "read_file": "Read {path}",
    "write_file": "Write {path}",
    "edit_file": "Edit {path}",
    "list_files": "List {path}",
    "glob": "Find {pattern}",
    "search": "Search for {pattern}",
    "run_shell": "Run `{command}`",
    "run_tests": "Run tests",
    "update_plan": "Update the plan",
}
ACP_KINDS = ("read", "edit", "delete", "move", "search", "execute", "think", "fetch", "switch_mode", "other")


def decode_arguments(arguments: dict[str, Any] | str | None) -> dict[str, Any]:
    """The call's arguments as a dict (empty when they cannot be read; the tool reports that to the model)."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str) and arguments.strip():
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}
    return {}


def tool_title(name: str, args: dict[str, Any]) -> str:
    """A short human title, e.g. ``Edit src/app.py`` or ``Run `pytest -q```."""
    template = _TITLES.get(name)
    if template is None:
        return name
    values = {key: _short(str(args.get(key, "") or ".")) for key in ("path", "pattern", "command")}
    return template.format(**values)


def _short(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def acp_kind(name: str, kind: str) -> str:
    """Our tool kind as an ACP ``ToolKind`` (the plan tool is ``think``)."""
    if name == "update_plan":
        return "think"
    return kind if kind in ACP_KINDS else "other"


def absolute_path(workspace: Workspace, path: Any) -> Path | None:
    if not isinstance(path, str) or not path:
        return None
    try:
        return workspace.resolve(path)
    except (WorkspaceError, OSError):  # the tool itself refuses it, with a message for the model
        return None


def locations(workspace: Workspace, args: dict[str, Any], data: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Absolute file locations the call touches: its ``path`` argument, then paths the tool reported."""
    found: list[dict[str, Any]] = []
    seen: set[str] = set()

    def add(path: Any, line: Any = None) -> None:
        absolute = absolute_path(workspace, path)
        if absolute is None or str(absolute) in seen or len(found) >= MAX_LOCATIONS:
            return
        seen.add(str(absolute))
        entry: dict[str, Any] = {"path": str(absolute)}
        if isinstance(line, int) and not isinstance(line, bool) and line >= 0:
            entry["line"] = line
        found.append(entry)

    add(args.get("path"), args.get("start_line"))
    for path in (data or {}).get("paths") or []:
        add(path)
    return found


def read_text(path: Path | None) -> str | None:
    """A file's text for a diff, or None (missing, binary, too large)."""
    if path is None or not path.is_file():
        return None
    try:
        if path.stat().st_size > MAX_DIFF_FILE_BYTES:
            return None
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def proposed_diff(workspace: Workspace, name: str, args: dict[str, Any]) -> dict[str, Any] | None:
    """The edit a ``write_file``/``edit_file`` call would make, as ACP diff content (None when unknown)."""
    if name not in ("write_file", "edit_file"):
        return None
    target = absolute_path(workspace, args.get("path"))
    if target is None:
        return None
    before = read_text(target)
    if name == "write_file":
        after = args.get("content")
    else:
        old, new = args.get("old_string"), args.get("new_string")
        if before is None or not isinstance(old, str) or not isinstance(new, str) or not old:
            return None
        count = before.count(old)
        if count == 0 or (count > 1 and not args.get("replace_all")):
            return None
        after = before.replace(old, new) if args.get("replace_all") else before.replace(old, new, 1)
    if not isinstance(after, str):
        return None
    return diff_content(target, before, after)


def diff_content(path: Path, before: str | None, after: str) -> dict[str, Any]:
    """ACP ``diff`` tool-call content (``oldText`` null for a new file)."""
    return {"type": "diff", "path": str(path), "oldText": before, "newText": after}


def text_content(text: str) -> dict[str, Any]:
    """ACP ``content`` tool-call content holding one text block."""
    return {"type": "content", "content": {"type": "text", "text": text}}
