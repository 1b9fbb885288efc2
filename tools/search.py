"""Finding things: ``list_files``, ``glob`` and ``search`` (regex over file contents). All respect ``.gitignore``."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import regex
from freetoken_agent.tools.context import ToolContext, ToolError, ToolResult
from freetoken_agent.tools.definition import tool
from freetoken_agent.tools.files import SNIFF_BYTES, looks_binary
from freetoken_agent.tools.ignore import compile_glob, walk

MAX_ENTRIES = 500
MAX_SEARCH_FILE_BYTES = 2 * 1024 * 1024
MAX_MATCH_LINE_CHARS = 300
MAX_SCANNED_FILES = 20_000
SEARCH_BUDGET_S = 30.0  # a pathological regex or a giant tree stops with a note instead of stalling the agent


def _folder(ctx: ToolContext, path: str) -> Path:
    folder = ctx.workspace.resolve(path)
    if not folder.exists():
        raise ToolError(f"{path!r} does not exist")
    return folder


@tool(kind="read")
def list_files(ctx: ToolContext, path: str = ".", recursive: bool = False, max_entries: int = 200) -> ToolResult:
    """List a folder of the workspace (folders end with '/'). Files ignored by .gitignore and .git are skipped.

    Args:
        path: Folder, relative to the workspace root.
        recursive: List everything below the folder, not just its direct entries.
        max_entries: Stop after this many entries (at most 500).
    """
    folder = _folder(ctx, path)
    if not folder.is_dir():
        raise ToolError(f"{path!r} is a file, not a folder; use read_file to read it")
    root = ctx.workspace.root
    cap = max(1, min(max_entries, MAX_ENTRIES))
    names: list[str] = []
    more = False
    for entry, is_dir in walk(root, folder, recursive=recursive):
        if len(names) >= cap:
            more = True
            break
        rel = entry.relative_to(folder).as_posix()
        names.append(rel + "/" if is_dir else rel)
    shown = ctx.workspace.relative(folder)
    if not names:
        return ToolResult(content=f"{shown} is empty (or everything in it is ignored).", data={"paths": []})
    lines = names + ([f"[stopped after {cap} entries]"] if more else [])
    return ToolResult(content="\n".join(lines), data={"paths": names, "truncated": more})


@tool(kind="search")
def glob(ctx: ToolContext, pattern: str, path: str = ".", max_results: int = 200) -> ToolResult:
    """Find files whose path matches a glob pattern, e.g. '**/*.py' or 'src/*.txt' (gitignore-aware).

    Args:
        pattern: Glob relative to the folder; '*' stays within one folder, '**' spans folders.
        path: Folder to search from, relative to the workspace root.
        max_results: Stop after this many matches (at most 500).
    """
    folder = _folder(ctx, path)
    if not folder.is_dir():
        raise ToolError(f"{path!r} is a file, not a folder")
    if not pattern.strip():
        raise ToolError("pattern is empty; try '**/*' for every file")
    matcher = compile_glob(pattern, anchored=True)
    cap = max(1, min(max_results, MAX_ENTRIES))
    found: list[str] = []
    more = False
    visited = 0
    for entry, is_dir in walk(ctx.workspace.root, folder):
        if is_dir:
            continue
        visited += 1
        if visited > MAX_SCANNED_FILES:
            more = True
            break
        rel = entry.relative_to(folder).as_posix()
        if matcher.match(rel):
            if len(found) >= cap:
                more = True
                break
            found.append(ctx.workspace.relative(entry))
    note = f"[stopped after {cap} matches]"
    if visited > MAX_SCANNED_FILES:
        note = f"[stopped after looking at {MAX_SCANNED_FILES} files; narrow the path]"
    if not found:
        text = f"No files match {pattern!r}." + (f"\n{note}" if more else "")
        return ToolResult(content=text, data={"paths": [], "truncated": more})
    lines = found + ([note] if more else [])
    return ToolResult(content="\n".join(lines), data={"paths": found, "truncated": more})


@tool(kind="search")
def search(
    ctx: ToolContext,
    pattern: str,
    path: str = ".",
    file_glob: str | None = None,
    ignore_case: bool = False,
    max_results: int = 100,
) -> ToolResult:
    """Search file contents with a regular expression (Python syntax); prints 'path:line: text' for each match.

    Binary files, files over 2 MB, symlinks and files ignored by .gitignore are skipped.

    Args:
        pattern: Regular expression, e.g. 'def \\w+_test' or 'TODO'.
        path: File or folder to search, relative to the workspace root.
        file_glob: Only search files matching this glob: '*.py' matches at any depth, 'src/*.py' is anchored
            to the searched folder.
        ignore_case: Match letters regardless of case.
        max_results: Stop after this many matching lines (at most 500).
    """
    try:
        # the `regex` package (re-compatible syntax) because its matches take a timeout: Python's re cannot be
        # interrupted, and a pattern such as (a|aa)+$ backtracks for ages on one line
        compiled = regex.compile(pattern, regex.IGNORECASE if ignore_case else 0)
    except regex.error as exc:
        raise ToolError(f"invalid regular expression {pattern!r}: {exc}") from None
    target = _folder(ctx, path)
    matcher = compile_glob(file_glob, anchored=False) if file_glob and file_glob.strip().strip("/") else None
    cap = max(1, min(max_results, MAX_ENTRIES))
    if target.is_file():
        files: Iterable[Path] = [target]
    else:
        # like ripgrep, symlinked files are not followed (no duplicates; escapes are refused by walk anyway)
        files = (entry for entry, is_dir in walk(ctx.workspace.root, target) if not is_dir and not entry.is_symlink())
    lines: list[str] = []
    paths: list[str] = []
    stop: str | None = None  # why the search ended early: "matches", "files" or "time"
    skipped = scanned = 0
    deadline = time.monotonic() + SEARCH_BUDGET_S
    for file in files:
        if ctx.cancelled:
            raise ToolError("search cancelled")
        if not file.is_file():  # FIFOs, sockets, devices: reading them could block forever
            continue
        scanned += 1
        if scanned > MAX_SCANNED_FILES:
            stop = "files"
            break
        relative = file.name if file == target else file.relative_to(target).as_posix()
        if matcher is not None and not matcher.match(relative):
            continue
        try:
            if file.stat().st_size > MAX_SEARCH_FILE_BYTES:
                skipped += 1
                continue
            raw = file.read_bytes()
        except OSError:
            continue
        if looks_binary(raw[:SNIFF_BYTES]):
            continue
        rel = ctx.workspace.relative(file)
        hit = False
        for number, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), start=1):
            try:
                found = compiled.search(line, timeout=max(0.001, deadline - time.monotonic()))
            except TimeoutError:
                stop = "time"
                break
            if found:
                if len(lines) >= cap:
                    stop = "matches"
                    break
                text = line if len(line) <= MAX_MATCH_LINE_CHARS else line[:MAX_MATCH_LINE_CHARS] + " [...]"
                lines.append(f"{rel}:{number}: {text}")
                hit = True
        if hit:
            paths.append(rel)
        if stop:
            break
    notes: list[str] = []
    if stop == "files":
        notes.append(f"[stopped after scanning {MAX_SCANNED_FILES} files; narrow the path or file_glob]")
    elif stop == "time":
        notes.append(f"[stopped after {SEARCH_BUDGET_S:g} s; simplify the pattern or narrow the path]")
    elif stop == "matches":
        notes.append(f"[stopped after {cap} matching lines; narrow the pattern or the path]")
    if skipped:
        notes.append(f"[{skipped} file(s) over {MAX_SEARCH_FILE_BYTES // (1024 * 1024)} MB were not searched]")
    if not lines:
        return ToolResult(content="\n".join([f"No matches for {pattern!r}."] + notes), data={"paths": [], "matches": 0})
    content = "\n".join(lines + notes)
    return ToolResult(content=content, data={"paths": paths, "matches": len(lines), "truncated": stop is not None})
