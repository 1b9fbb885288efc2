"""File tools: ``read_file``, ``write_file``, ``edit_file``.

Paths are checked by ``Workspace.resolve`` (for clear messages) and then opened through ``safeio`` relative to the
workspace's root descriptor, so a symlink or hard link planted in the workspace cannot redirect a read or a write.
"""

from __future__ import annotations

import difflib
import os
from typing import Annotated

import pydantic

from freetoken_agent.tools.context import ToolContext, ToolError, ToolResult
from freetoken_agent.tools.definition import tool
from freetoken_agent.tools.safeio import check_regular, open_regular, parent_dir, read_capped, write_atomic
from freetoken_agent.tools.sandbox.policy import SandboxError, SandboxMode

MAX_READ_LINES = 2000
MAX_LINE_CHARS = 2000
MAX_EDIT_BYTES = 10 * 1024 * 1024
MAX_WRITE_BYTES = 10 * 1024 * 1024  # bytes write_file and edit_file may write per call
MAX_READ_BYTES = 256 * 1024 * 1024  # bytes read_file reads per call (a 20 GiB sparse file stops here)
MAX_LINE_NUMBER = 1_000_000_000
LineNumber = Annotated[int, pydantic.Field(ge=1, le=MAX_LINE_NUMBER)]
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


def _resolved(ctx: ToolContext, path: str) -> str:
    """``path`` checked against the workspace (nice errors for escapes) as a ``/``-separated path from its root."""
    rel = ctx.workspace.relative(ctx.workspace.resolve(path))
    if rel == ".":
        raise ToolError(f"{path!r} is the workspace folder itself, not a file")
    return rel


def _read_text(fd: int, info: os.stat_result, path: str) -> str:
    if info.st_size > MAX_EDIT_BYTES:
        raise ToolError(f"{path!r} is {info.st_size} bytes; files over {MAX_EDIT_BYTES} bytes cannot be edited")
    raw, more = read_capped(fd, MAX_EDIT_BYTES)
    if more:
        raise ToolError(f"{path!r} is over {MAX_EDIT_BYTES} bytes; it cannot be edited")
    if looks_binary(raw[:SNIFF_BYTES]):
        raise ToolError(f"{path!r} is a binary file; only text files can be edited")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ToolError(f"{path!r} is not valid UTF-8 text (byte {exc.start}); it cannot be edited") from None


def check_writable(ctx: ToolContext, rel: str, tool_name: str) -> None:
    """Refuse a write the tool's sandbox mode forbids: any in ``read-only``, ``.git`` and the policy's read-only
    paths in ``workspace-write`` (a prompt-injected model must not plant a git hook)."""
    policy = ctx.sandbox_for(tool_name)
    if policy.mode is SandboxMode.READ_ONLY:
        raise SandboxError(f"the sandbox mode is 'read-only': {tool_name} cannot change {rel!r}")
    if policy.mode is SandboxMode.WORKSPACE_WRITE:
        protected = [item.strip("/") for item in policy.read_only if not os.path.isabs(item)]
        if ".git" in rel.split("/") or any(rel == item or rel.startswith(item + "/") for item in protected):
            raise SandboxError(
                f"{rel!r} is read-only in the sandbox mode 'workspace-write' (.git and {', '.join(protected)} are "
                "protected); only the user can change it"
            )


def _check_size(data: bytes, rel: str) -> None:
    if len(data) > MAX_WRITE_BYTES:
        raise ToolError(f"the new content of {rel!r} would be {len(data)} bytes; at most {MAX_WRITE_BYTES} bytes "
                        "can be written per call")


def unified_diff(rel: str, before: str, after: str) -> str:
    """A unified diff of one file, ``a/rel`` → ``b/rel``."""
    lines = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{rel}", f"b/{rel}", n=3
    )
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


@tool(kind="read")
def read_file(ctx: ToolContext, path: str, start_line: LineNumber = 1, end_line: LineNumber | None = None
              ) -> ToolResult:
    """Read a text file from the workspace. Each line is shown as its number, a tab, then the text.

    Long files are cut at 2000 lines per call: read further with start_line. Binary files are refused.

    Args:
        path: File path, relative to the workspace root.
        start_line: First line to show (1-based).
        end_line: Last line to show (inclusive); omit to read to the end (up to 2000 lines).
    """
    rel = _resolved(ctx, path)
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
    fd, info = open_regular(ctx.workspace.root_fd, rel, path)
    with os.fdopen(fd, "rb") as handle:
        if looks_binary(handle.read(SNIFF_BYTES)):
            raise ToolError(f"{rel!r} is a binary file ({info.st_size} bytes); it cannot be shown as text")
        handle.seek(0)
        while True:
            if handle.tell() > MAX_READ_BYTES:  # a huge or sparse file: stop, the model can call again from here
                more = True
                break
            raw = handle.readline(MAX_LINE_CHARS * 4 + 1)
            if not raw:
                break
            cut = False
            if not raw.endswith(b"\n") and len(raw) > MAX_LINE_CHARS * 4:
                cut = True
                while handle.tell() <= MAX_READ_BYTES:  # skip the rest of an over-long line, within the budget
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
        if more:
            raise ToolError(f"start_line {start_line} is beyond the first {MAX_READ_BYTES} bytes of {rel!r}, the most "
                            "read_file reads per call; use search to find the text")
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
    rel = _resolved(ctx, path)
    check_writable(ctx, rel, "write_file")
    data = content.encode("utf-8")
    _check_size(data, rel)
    with parent_dir(ctx.workspace.root_fd, rel, create=True) as (dir_fd, name):
        try:
            info: os.stat_result | None = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            info = None
        existed = info is not None
        before: str | None = ""
        if info is not None:
            check_regular(info, path)  # folders, symlinks planted since resolve, FIFOs, devices, hard links
            fd, info = open_regular(dir_fd, name, path)
            try:
                before = _read_text(fd, info, path)
            except ToolError:  # replacing a binary or huge file: allowed, but no text diff
                before = None
            finally:
                os.close(fd)
        write_atomic(dir_fd, name, data, info.st_mode if info is not None else None)
    diff = unified_diff(rel, before, content) if before is not None else f"(non-text file {rel} replaced)\n"
    verb = "Updated" if existed else "Created"
    lines = content.count("\n") + (0 if content.endswith("\n") or not content else 1)
    return ToolResult(
        content=f"{verb} {rel} ({len(data)} bytes, {lines} lines).",
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
    rel = _resolved(ctx, path)
    if old_string == "":
        raise ToolError("old_string is empty; give the exact text to replace (use write_file to create a file)")
    if old_string == new_string:
        raise ToolError("old_string and new_string are identical; nothing would change")
    check_writable(ctx, rel, "edit_file")
    with parent_dir(ctx.workspace.root_fd, rel, create=False) as (dir_fd, name):
        fd, info = open_regular(dir_fd, name, path)
        try:
            before = _read_text(fd, info, path)
        finally:
            os.close(fd)
        return _edit(dir_fd, name, info, rel, before, old_string, new_string, replace_all)


def _edit(dir_fd: int, name: str, info: os.stat_result, rel: str, before: str, old_string: str, new_string: str,
          replace_all: bool) -> ToolResult:
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
    grown = len(before.encode("utf-8")) + (count if replace_all else 1) * (
        len(new_string.encode("utf-8")) - len(old_string.encode("utf-8")))
    if grown > MAX_WRITE_BYTES:  # checked before the replacement is built: replace_all must not make a gigabyte
        raise ToolError(f"the edit would make {rel!r} {grown} bytes; at most {MAX_WRITE_BYTES} bytes can be written")
    after = before.replace(old_string, new_string) if replace_all else before.replace(old_string, new_string, 1)
    data = after.encode("utf-8")
    _check_size(data, rel)
    write_atomic(dir_fd, name, data, info.st_mode)
    diff = unified_diff(rel, before, after)
    noun = "occurrence" if count == 1 else "occurrences"
    return ToolResult(
        content=f"Edited {rel}: replaced {count} {noun}.\n{diff}".rstrip(),
        data={"paths": [rel], "diff": diff, "replacements": count},
    )
