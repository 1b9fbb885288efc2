"""File tools: ``read_file``, ``write_file``, ``edit_file``. All paths go through ``Workspace.resolve``."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from freetoken_agent.tools.context import ToolContext, ToolError, ToolResult
from freetoken_agent.tools.definition import tool

MAX_READ_LINES = 2000
MAX_LINE_CHARS = 2000
MAX_EDIT_BYTES = 10 * 1024 * 1024
SNIFF_BYTES = 8192


def looks_binary(head: bytes) -> bool:
    """True when ``head`` (the first bytes of a file) has a NUL byte or is not UTF-8 text."""
    if b"\x00" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start < len(head) - 4  # a multi-byte character cut at the end of the sniff window is fine
    return False


def _existing_file(ctx: ToolContext, path: str) -> Path:
    target = ctx.workspace.resolve(path)
    if not target.exists():
        raise ToolError(f"file {path!r} does not exist")
    if target.is_dir():
        raise ToolError(f"{path!r} is a directory; use list_files to see its contents")
    if not target.is_file():
        raise ToolError(f"{path!r} is not a regular file")
    return target


def _read_text(target: Path, path: str) -> str:
    size = target.stat().st_size
    if size > MAX_EDIT_BYTES:
        raise ToolError(f"{path!r} is {size} bytes; files over {MAX_EDIT_BYTES} bytes cannot be edited")
    raw = target.read_bytes()
    if looks_binary(raw[:SNIFF_BYTES]):
        raise ToolError(f"{path!r} is a binary file; only text files can be edited")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ToolError(f"{path!r} is not valid UTF-8 text (byte {exc.start}); it cannot be edited") from None


def unified_diff(rel: str, before: str, after: str) -> str:
    """A unified diff of one file, ``a/rel`` → ``b/rel``."""
    lines = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{rel}", f"b/{rel}", n=3
    )
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def _write_atomic(target: Path, text: str) -> None:
    tmp = target.with_name(f".{target.name}.freetoken-tmp")
    try:
        tmp.write_text(text, encoding="utf-8", newline="")
        if target.exists():
            os.chmod(tmp, target.stat().st_mode & 0o7777)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


@tool(kind="read")
def read_file(ctx: ToolContext, path: str, start_line: int = 1, end_line: int | None = None) -> ToolResult:
    """Read a text file from the workspace. Each line is shown as its number, a tab, then the text.

    Long files are cut at 2000 lines per call: read further with start_line. Binary files are refused.

    Args:
        path: File path, relative to the workspace root.
        start_line: First line to show (1-based).
        end_line: Last line to show (inclusive); omit to read to the end (up to 2000 lines).
    """
    target = _existing_file(ctx, path)
    rel = ctx.workspace.relative(target)
    if start_line < 1:
        raise ToolError("start_line must be 1 or more")
    if end_line is not None and end_line < start_line:
        raise ToolError(f"end_line ({end_line}) is before start_line ({start_line})")
    last = min(end_line if end_line is not None else start_line + MAX_READ_LINES - 1, start_line + MAX_READ_LINES - 1)
    budget = ctx.max_output_chars
    shown: list[str] = []
    number = 0
    more = False
    truncated_lines = 0
    with target.open("rb") as handle:
        if looks_binary(handle.read(SNIFF_BYTES)):
            raise ToolError(f"{rel!r} is a binary file ({target.stat().st_size} bytes); it cannot be shown as text")
        handle.seek(0)
        while True:
            raw = handle.readline(MAX_LINE_CHARS * 4 + 1)
            if not raw:
                break
            cut = False
            if not raw.endswith(b"\n") and len(raw) > MAX_LINE_CHARS * 4:
                cut = True
                while True:  # skip the rest of an over-long line without holding it in memory
                    tail = handle.readline(1 << 20)
                    if not tail or tail.endswith(b"\n"):
                        break
            number += 1
            if number < start_line:
                continue
            if number > last:
                more = end_line is None or end_line > last  # stopped by the cap, not by the caller's end_line
                break
            text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if cut or len(text) > MAX_LINE_CHARS:
                text = text[:MAX_LINE_CHARS] + " [... line truncated]"
                truncated_lines += 1
            entry = f"{number:>6}\t{text}"
            if len(entry) + 1 > budget and shown:
                more = True
                break
            budget -= len(entry) + 1
            shown.append(entry)
    if number < start_line and not shown:
        if number == 0:
            return ToolResult(content=f"{rel} is empty.", data={"paths": [rel], "lines": 0})
        raise ToolError(f"start_line {start_line} is past the end of {rel!r} ({number} lines)")
    first_shown = start_line
    last_shown = start_line + len(shown) - 1
    notes: list[str] = []
    if more:
        follow = f"more follow: call again with start_line={last_shown + 1}"
        notes.append(f"[showing lines {first_shown}-{last_shown}; {follow}]")
    if truncated_lines:
        notes.append(f"[{truncated_lines} line(s) longer than {MAX_LINE_CHARS} characters were truncated]")
    content = "\n".join(shown + notes)
    return ToolResult(content=content, data={"paths": [rel], "start_line": first_shown, "end_line": last_shown})


@tool(kind="edit", writes=True)
def write_file(ctx: ToolContext, path: str, content: str) -> ToolResult:
    """Create a file or replace its whole content. Parent folders are created. Prefer edit_file for small changes.

    Args:
        path: File path, relative to the workspace root.
        content: The complete new content of the file.
    """
    target = ctx.workspace.resolve(path)
    if target.is_dir():
        raise ToolError(f"{path!r} is a directory")
    rel = ctx.workspace.relative(target)
    existed = target.exists()
    try:
        before: str | None = _read_text(target, path) if existed else ""
    except ToolError:  # replacing a binary or huge file: allowed, but no text diff
        before = None
    target.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(target, content)
    diff = unified_diff(rel, before, content) if before is not None else f"(non-text file {rel} replaced)\n"
    verb = "Updated" if existed else "Created"
    lines = content.count("\n") + (0 if content.endswith("\n") or not content else 1)
    return ToolResult(
        content=f"{verb} {rel} ({len(content.encode('utf-8'))} bytes, {lines} lines).",
        data={"paths": [rel], "diff": diff, "created": not existed},
    )


def _line_numbers(text: str, needle: str) -> list[int]:
    numbers: list[int] = []
    start = text.find(needle)
    while start != -1:
        numbers.append(text.count("\n", 0, start) + 1)
        start = text.find(needle, start + 1)
    return numbers


def _near_miss(text: str, needle: str) -> str:
    first = needle.strip().splitlines()[0].strip() if needle.strip() else ""
    if not first:
        return ""
    for number, line in enumerate(text.splitlines(), start=1):
        if first in line or line.strip() == first:
            return f" The first line of old_string appears at line {number}; check whitespace and the lines after it."
    squashed = " ".join(needle.split())
    if squashed and squashed in " ".join(text.split()):
        return " It matches if whitespace is ignored: copy the exact indentation and line breaks from read_file."
    return " Use read_file to see the current text."


@tool(kind="edit", writes=True)
def edit_file(
    ctx: ToolContext, path: str, old_string: str, new_string: str, replace_all: bool = False
) -> ToolResult:
    """Replace an exact piece of text in a file. old_string must match the file exactly (indentation included,
    without the line numbers read_file shows) and be unique unless replace_all is true.

    Args:
        path: File path, relative to the workspace root.
        old_string: The exact text to replace; include enough surrounding lines to make it unique.
        new_string: The replacement text.
        replace_all: Replace every occurrence instead of requiring exactly one.
    """
    target = _existing_file(ctx, path)
    rel = ctx.workspace.relative(target)
    if old_string == "":
        raise ToolError("old_string is empty; give the exact text to replace (use write_file to create a file)")
    if old_string == new_string:
        raise ToolError("old_string and new_string are identical; nothing would change")
    before = _read_text(target, path)
    count = before.count(old_string)
    if count == 0 and "\r\n" in before and "\r" not in old_string:
        # a CRLF file edited with LF text (models rarely reproduce \r): match and write in the file's convention
        crlf_old = old_string.replace("\n", "\r\n")
        if before.count(crlf_old):
            old_string, new_string = crlf_old, new_string.replace("\r\n", "\n").replace("\n", "\r\n")
            count = before.count(old_string)
    if count == 0:
        raise ToolError(f"old_string was not found in {rel}.{_near_miss(before, old_string)}")
    if count > 1 and not replace_all:
        where = ", ".join(map(str, _line_numbers(before, old_string)[:10]))
        raise ToolError(
            f"old_string occurs {count} times in {rel} (starting at lines {where}); include more surrounding "
            "context to make it unique, or set replace_all to true"
        )
    after = before.replace(old_string, new_string) if replace_all else before.replace(old_string, new_string, 1)
    _write_atomic(target, after)
    diff = unified_diff(rel, before, after)
    noun = "occurrence" if count == 1 else "occurrences"
    return ToolResult(
        content=f"Edited {rel}: replaced {count} {noun}.\n{diff}".rstrip(),
        data={"paths": [rel], "diff": diff, "replacements": count},
    )
