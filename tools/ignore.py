"""A ``.gitignore``-aware directory walk (root and nested ``.gitignore`` files, ``.git/info/exclude``).

Implements git's pattern rules: ``#`` comments, ``!`` negation, trailing ``/`` for directories only, patterns with a
``/`` anchored to their ``.gitignore``'s folder, ``*``/``?``/``[...]`` within one path segment and ``**`` across
segments; the last matching rule wins. Ignored directories are pruned, so (as in git) files inside them cannot be
re-included. ``.git`` itself is always skipped, and symlinks are never followed out of the workspace.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ALWAYS_SKIPPED = frozenset({".git"})


@dataclass(frozen=True)
class IgnoreRule:
    """One pattern line from a ``.gitignore`` whose folder is ``base`` (posix, relative to the root; ``""`` = root)."""

    regex: re.Pattern[str]
    negate: bool
    dir_only: bool
    base: str

    def matches(self, rel_path: str, is_dir: bool) -> bool:
        """Does this rule match ``rel_path`` (posix, relative to the workspace root)?"""
        if self.dir_only and not is_dir:
            return False
        if self.base:
            if not rel_path.startswith(self.base + "/"):
                return False
            rel_path = rel_path[len(self.base) + 1 :]
        return self.regex.match(rel_path) is not None


def _translate(pattern: str) -> str:
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "*":
            if pattern.startswith("**", i) and (i == 0 or pattern[i - 1] == "/"):
                rest = pattern[i + 2 : i + 3]
                if rest == "/":
                    out.append("(?:.*/)?")
                    i += 3
                    continue
                if rest == "":
                    out.append(".*")
                    i += 2
                    continue
            while i < n and pattern[i] == "*":
                i += 1
            out.append("[^/]*")
            continue
        if char == "?":
            out.append("[^/]")
        elif char == "[":
            end = pattern.find("]", i + 2 if pattern[i + 1 : i + 2] in ("!", "^", "]") else i + 1)
            if end == -1:
                out.append(re.escape(char))
            else:
                body = pattern[i + 1 : end]
                if body[:1] in ("!", "^"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = end
        elif char == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(char))
        i += 1
    return "".join(out)


def parse_gitignore(text: str, base: str = "") -> list[IgnoreRule]:
    """Parse the text of one ``.gitignore`` located in folder ``base`` into rules."""
    rules: list[IgnoreRule] = []
    for raw in text.splitlines():
        line = raw.rstrip("\r")
        stripped = line.rstrip(" ")
        if stripped.endswith("\\") and len(line) > len(stripped):
            stripped += " "  # an escaped trailing space is kept
        line = stripped
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if negate:
            line = line[1:]
        elif line.startswith("\\"):
            line = line[1:] if line[1:2] in ("#", "!") else line
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        line = line.lstrip("/")
        body = _translate(line)
        regex = re.compile(("^" if anchored else "^(?:.*/)?") + body + "$", re.DOTALL)
        rules.append(IgnoreRule(regex=regex, negate=negate, dir_only=dir_only, base=base))
    return rules


def compile_glob(pattern: str, *, anchored: bool) -> re.Pattern[str]:
    """A glob (gitignore syntax: ``*``, ``?``, ``[...]``, ``**``) as a regex over posix paths relative to a folder.

    ``anchored=False`` lets a pattern without ``/`` match at any depth, as in ``.gitignore``; a trailing ``/`` is
    ignored (the caller decides what a folder means).
    """
    body = pattern.strip().rstrip("/")
    anchored = anchored or "/" in body
    body = _translate(body.lstrip("/"))
    return re.compile(("^" if anchored else "^(?:.*/)?") + body + "$", re.DOTALL)


def is_ignored(rules: list[IgnoreRule], rel_path: str, is_dir: bool) -> bool:
    """Apply ``rules`` in order (last match wins) to ``rel_path``."""
    ignored = False
    for rule in rules:
        if rule.matches(rel_path, is_dir):
            ignored = not rule.negate
    return ignored


def _read_rules(folder: Path, base: str) -> list[IgnoreRule]:
    try:
        text = (folder / ".gitignore").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return parse_gitignore(text, base)


def _rel(root: Path, path: Path) -> str:
    text = path.relative_to(root).as_posix()
    return "" if text == "." else text


def walk(
    root: Path, start: Path, *, respect_gitignore: bool = True, recursive: bool = True
) -> Iterator[tuple[Path, bool]]:
    """Yield ``(path, is_dir)`` for every entry under ``start`` (itself under the real ``root``), sorted, not ignored.

    Symlinks are yielded only when their target stays inside ``root``; symlinked directories are not descended.
    With ``recursive=False`` only the direct entries of ``start`` are listed.
    """
    rules: list[IgnoreRule] = []
    if respect_gitignore:
        try:
            rules += parse_gitignore((root / ".git" / "info" / "exclude").read_text(errors="replace"))
        except OSError:
            pass
        folder = root
        rules += _read_rules(root, "")
        for part in start.relative_to(root).parts:
            folder = folder / part
            rules += _read_rules(folder, _rel(root, folder))
    yield from _walk_dir(root, start, rules, respect_gitignore, recursive)


def _walk_dir(
    root: Path, folder: Path, rules: list[IgnoreRule], respect: bool, recursive: bool
) -> Iterator[tuple[Path, bool]]:
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.name in ALWAYS_SKIPPED:
            continue
        path = Path(entry.path)
        is_link = entry.is_symlink()
        if is_link:
            target = os.path.realpath(path)
            if not (target == str(root) or target.startswith(str(root) + os.sep)):
                continue
        try:
            is_dir = entry.is_dir()
        except OSError:
            continue
        rel = _rel(root, path)
        if respect and is_ignored(rules, rel, is_dir):
            continue
        yield path, is_dir
        if recursive and is_dir and not is_link:
            child_rules = rules + _read_rules(path, rel) if respect else rules
            yield from _walk_dir(root, path, child_rules, respect, recursive)
