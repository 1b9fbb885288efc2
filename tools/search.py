"""Finding things: ``list_files``, ``glob`` and ``search`` (regex over file contents). All respect ``.gitignore``."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

import pydantic

from freetoken_agent.tools.context import ToolContext, ToolError, ToolResult
from freetoken_agent.tools.definition import tool
from freetoken_agent.tools.files import SNIFF_BYTES, looks_binary
from freetoken_agent.tools.ignore import Matcher, PatternError, compile_glob, compile_linear, walk
from freetoken_agent.tools.safeio import open_regular, read_capped

MAX_ENTRIES = 500
MAX_SEARCH_FILE_BYTES = 2 * 1024 * 1024
MAX_MATCH_LINE_CHARS = 300
MAX_SCANNED_FILES = 20_000
SEARCH_BUDGET_S = 30.0  # a pathological regex or a giant tree stops with a note instead of stalling the agent
WALK_BUDGET_S = 30.0  # list_files and glob over a giant tree stop with a note too
Count = Annotated[int, pydantic.Field(ge=1, le=MAX_ENTRIES)]  # a result cap: the schema refuses 0, -1, 10**12


def _glob(pattern: str, *, anchored: bool) -> Matcher:
    try:
        return compile_glob(pattern, anchored=anchored)
    except PatternError as exc:
        raise ToolError(f"invalid glob pattern {pattern!r}: {exc}") from None


def _regex(pattern: str, ignore_case: bool) -> Matcher:
    """A search pattern compiled by RE2: matching is linear in the line, so no pattern can stall the search (a
    backtracking engine's timeout is checked too rarely to be a budget: it overran 30 s to 75 s)."""
    try:
        return compile_linear(("(?i)" if ignore_case else "") + pattern)
    except PatternError as exc:
        raise ToolError(
            f"invalid regular expression {pattern!r}: {exc}. Patterns use RE2 syntax (like Python's re, without "
            "lookarounds and backreferences)"
        ) from None


def _folder(ctx: ToolContext, path: str) -> Path:
    folder = ctx.workspace.resolve(path)
    if not folder.exists():
        raise ToolError(f"{path!r} does not exist")
    return folder


@tool(kind="read")
def list_files(ctx: ToolContext, path: str = ".", recursive: bool = False, max_entries: Count = 200) -> ToolResult:
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
    cap = min(max_entries, MAX_ENTRIES)
    names: list[str] = []
    more = False
    deadline = time.monotonic() + WALK_BUDGET_S
    for entry, is_dir in walk(root, folder, recursive=recursive, root_fd=ctx.workspace.root_fd):
        if len(names) >= cap or time.monotonic() > deadline or ctx.cancelled:
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
def glob(ctx: ToolContext, pattern: str, path: str = ".", max_results: Count = 200) -> ToolResult:
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
    matcher = _glob(pattern, anchored=True)
    cap = min(max_results, MAX_ENTRIES)
    found: list[str] = []
    more = False
    visited = 0
    deadline = time.monotonic() + WALK_BUDGET_S
    note = f"[stopped after {cap} matches]"
    for entry, is_dir in walk(ctx.workspace.root, folder, root_fd=ctx.workspace.root_fd):
        if time.monotonic() > deadline or ctx.cancelled:
            more, note = True, f"[stopped after {WALK_BUDGET_S:g} s; narrow the path]"
            break
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
    max_results: Count = 100,
) -> ToolResult:
    """Search file contents with a regular expression (RE2 syntax: Python's without lookarounds and backreferences);
    prints 'path:line: text' for each match.

    Binary files, files over 2 MB, symlinks and files ignored by .gitignore are skipped.

    Args:
        pattern: Regular expression, e.g. 'def \\w+_test' or 'TODO'.
        path: File or folder to search, relative to the workspace root.
        file_glob: Only search files matching this glob: '*.py' matches at any depth, 'src/*.py' is anchored
            to the searched folder.
        ignore_case: Match letters regardless of case.
        max_results: Stop after this many matching lines (at most 500).
    """
    compiled = _regex(pattern, ignore_case)
    target = _folder(ctx, path)
    matcher = _glob(file_glob, anchored=False) if file_glob and file_glob.strip().strip("/") else None
    cap = min(max_results, MAX_ENTRIES)
    if target.is_file():
        files: Iterable[Path] = [target]
    else:
        # like ripgrep, symlinked files are not followed (no duplicates; escapes are refused by walk anyway)
        walked = walk(ctx.workspace.root, target, root_fd=ctx.workspace.root_fd)
        files = (entry for entry, is_dir in walked if not is_dir and not entry.is_symlink())
    lines: list[str] = []
    paths: list[str] = []
    stop: str | None = None  # why the search ended early: "matches", "files" or "time"
    skipped = scanned = 0
    deadline = time.monotonic() + SEARCH_BUDGET_S
    for file in files:
        if ctx.cancelled:
            raise ToolError("search cancelled")
        if time.monotonic() > deadline:  # checked per file and per line: the walk and the reads count too
            stop = "time"
            break
        scanned += 1
        if scanned > MAX_SCANNED_FILES:
            stop = "files"
            break
        relative = file.name if file == target else file.relative_to(target).as_posix()
        if matcher is not None and not matcher.match(relative):
            continue
        rel = ctx.workspace.relative(file)
        try:  # only regular, singly linked files, opened beneath the root: FIFOs and devices are never read
            fd, info = open_regular(ctx.workspace.root_fd, rel, rel)
        except ToolError:
            continue
        try:
            if info.st_size > MAX_SEARCH_FILE_BYTES:
                skipped += 1
                continue
            raw, _ = read_capped(fd, MAX_SEARCH_FILE_BYTES)  # a file that grew since fstat is cut
        except OSError:
            continue
        finally:
            os.close(fd)
        if looks_binary(raw[:SNIFF_BYTES]):
            continue
        hit = False
        for number, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), start=1):
            if number % 1024 == 0 and time.monotonic() > deadline:
                stop = "time"
                break
            found = compiled.search(line)  # type: ignore[attr-defined]
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
