"""A ``.gitignore``-aware directory walk (root and nested ``.gitignore`` files, ``.git/info/exclude``).

Implements git's pattern rules: ``#`` comments, ``!`` negation, trailing ``/`` for directories only, patterns with a
``/`` anchored to their ``.gitignore``'s folder, ``*``/``?``/``[...]`` within one path segment and ``**`` across
segments; the last matching rule wins. Ignored directories are pruned, so (as in git) files inside them cannot be
re-included. ``.git`` itself is always skipped, and symlinks are never followed out of the workspace.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import re2
from freetoken_agent.tools.safeio import DIR_FLAGS, open_beneath, read_capped

ALWAYS_SKIPPED = frozenset({".git"})
MAX_IGNORE_FILE_BYTES = 256 * 1024  # more is never a real .gitignore; the rest of a bigger one is not read
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a bad pattern is reported to the caller, not logged to stderr


class Matcher(Protocol):
    """A compiled pattern: ``match`` anchors at the start of the text."""

    def match(self, text: str) -> object | None: ...


class PatternError(ValueError):
    """A glob or ignore pattern that the linear-time engine cannot compile."""


def compile_linear(regex_text: str) -> Matcher:
    """Compile ``regex_text`` with RE2, whose matching time is linear in the text: no pattern can backtrack for ages.
    """
    try:
        return re2.compile(regex_text, _RE2_OPTIONS)
    except re2.error as exc:
        detail = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise PatternError(detail) from None


@dataclass(frozen=True)
class IgnoreRule:
    """One pattern line from a ``.gitignore`` whose folder is ``base`` (posix, relative to the root; ``""`` = root)."""

    regex: Matcher
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
        try:
            regex = compile_linear("(?s)" + ("^" if anchored else "^(?:.*/)?") + body + "$")
        except PatternError:
            continue  # git ignores a pattern it cannot use, too
        rules.append(IgnoreRule(regex=regex, negate=negate, dir_only=dir_only, base=base))
    return rules


def compile_glob(pattern: str, *, anchored: bool) -> Matcher:
    """A glob (gitignore syntax: ``*``, ``?``, ``[...]``, ``**``) as a regex over posix paths relative to a folder.

    ``anchored=False`` lets a pattern without ``/`` match at any depth, as in ``.gitignore``; a trailing ``/`` is
    ignored (the caller decides what a folder means). Raises :class:`PatternError` for a pattern RE2 refuses.
    """
    body = pattern.strip().rstrip("/")
    anchored = anchored or "/" in body
    body = _translate(body.lstrip("/"))
    return compile_linear("(?s)" + ("^" if anchored else "^(?:.*/)?") + body + "$")


def is_ignored(rules: list[IgnoreRule], rel_path: str, is_dir: bool) -> bool:
    """Apply ``rules`` in order (last match wins) to ``rel_path``."""
    ignored = False
    for rule in rules:
        if rule.matches(rel_path, is_dir):
            ignored = not rule.negate
    return ignored


def read_ignore_file(dir_fd: int, rel: str) -> str:
    """The text of an ignore file beneath ``dir_fd``, or ``""`` when it is missing, not a regular file (a FIFO would
    hang the read, ``/dev/zero`` never ends) or reached through a symlink; at most ``MAX_IGNORE_FILE_BYTES``."""
    try:
        fd = open_beneath(dir_fd, rel, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        data, _ = read_capped(fd, MAX_IGNORE_FILE_BYTES)
    except OSError:
        return ""
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace")


def _rel(root: Path, path: Path) -> str:
    text = path.relative_to(root).as_posix()
    return "" if text == "." else text


def walk(
    root: Path, start: Path, *, respect_gitignore: bool = True, recursive: bool = True, root_fd: int | None = None
) -> Iterator[tuple[Path, bool]]:
    """Yield ``(path, is_dir)`` for every entry under ``start`` (itself under the real ``root``), sorted, not ignored.

    Folders are opened one by one relative to their parent's descriptor without following symlinks (``root_fd``:
    the root's descriptor, else ``root`` is opened). Symlinks are yielded only when their target stays inside
    ``root``; symlinked directories are not descended. With ``recursive=False`` only ``start``'s entries are listed.
    """
    own_fd = root_fd is None
    base_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if root_fd is None else root_fd
    try:
        start_rel = _rel(root, start)
        try:
            start_fd = open_beneath(base_fd, start_rel or ".", DIR_FLAGS)
        except OSError:
            return
        rules: list[IgnoreRule] = []
        if respect_gitignore:
            rules += parse_gitignore(read_ignore_file(base_fd, ".git/info/exclude"))
            rules += parse_gitignore(read_ignore_file(base_fd, ".gitignore"))
            folder = ""
            for part in Path(start_rel).parts:
                folder = f"{folder}/{part}" if folder else part
                rules += parse_gitignore(read_ignore_file(base_fd, f"{folder}/.gitignore"), folder)
        yield from _walk_dir(root, start, start_fd, rules, respect_gitignore, recursive)
    finally:
        if own_fd:
            os.close(base_fd)


def _walk_dir(
    root: Path, folder: Path, folder_fd: int, rules: list[IgnoreRule], respect: bool, recursive: bool
) -> Iterator[tuple[Path, bool]]:
    """Walk the open folder ``folder_fd`` (closed at the end)."""
    try:
        try:
            with os.scandir(folder_fd) as listing:
                entries = sorted(listing, key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            if entry.name in ALWAYS_SKIPPED:
                continue
            path = folder / entry.name
            try:
                is_link = entry.is_symlink()
                if is_link:
                    target = os.path.realpath(path)
                    if not (target == str(root) or target.startswith(str(root) + os.sep)):
                        continue
                is_dir = entry.is_dir()
            except OSError:
                continue
            rel = _rel(root, path)
            if respect and is_ignored(rules, rel, is_dir):
                continue
            yield path, is_dir
            if recursive and is_dir and not is_link:
                try:
                    child_fd = os.open(entry.name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=folder_fd)
                except OSError:
                    continue
                child_rules = rules + parse_gitignore(read_ignore_file(child_fd, ".gitignore"), rel) if respect \
                    else rules
                yield from _walk_dir(root, path, child_fd, child_rules, respect, recursive)
    finally:
        os.close(folder_fd)
