"""list_files, glob and search, including .gitignore semantics."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from freetoken_agent.tools import ToolContext, ToolRegistry
from freetoken_agent.tools import ignore as ignore_module
from freetoken_agent.tools import search as search_module
from freetoken_agent.tools.ignore import is_ignored, parse_gitignore

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "patterns, path, is_dir, ignored",
    [
        ("*.log", "a.log", False, True),
        ("*.log", "deep/down/a.log", False, True),
        ("*.log\n!keep.log", "x/keep.log", False, False),
        ("build/", "build", True, True),
        ("build/", "build", False, False),  # dir-only pattern does not match a file
        ("/top.txt", "top.txt", False, True),
        ("/top.txt", "sub/top.txt", False, False),
        ("docs/*.md", "docs/a.md", False, True),
        ("docs/*.md", "docs/sub/a.md", False, False),
        ("**/cache", "a/b/cache", True, True),
        ("a/**/z", "a/z", False, True),
        ("a/**/z", "a/b/c/z", False, True),
        ("logs/**", "logs/x/y.txt", False, True),
        ("file?.txt", "file1.txt", False, True),
        ("file[0-9].txt", "fileA.txt", False, False),
        ("file[!0-9].txt", "fileA.txt", False, True),
        ("# comment\n\\#hash", "#hash", False, True),
        ("  \n*.tmp   ", "x.tmp", False, True),
    ],
)
def test_gitignore_rules(patterns: str, path: str, is_dir: bool, ignored: bool) -> None:
    assert is_ignored(parse_gitignore(patterns), path, is_dir) is ignored


@pytest.fixture
def project(root: Path) -> Path:
    files = {
        ".gitignore": "build/\n*.log\n!keep.log\n",
        "src/app.py": "def main():\n    return helper()\n",
        "src/util/helper.py": "def helper():\n    return 42  # TODO tidy\n",
        "src/util/.gitignore": "generated.py\n",
        "src/util/generated.py": "TODO generated\n",
        "build/out.py": "TODO built\n",
        "debug.log": "TODO log\n",
        "keep.log": "TODO kept\n",
        "README.md": "Project. todo later\n",
        ".git/config": "TODO git internals\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "image.png").write_bytes(b"\x89PNG\x00TODO")
    return root


async def test_list_files(project: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    top = await registry.call("list_files", {}, ctx)
    assert top.content.splitlines() == [".gitignore", "README.md", "image.png", "keep.log", "src/"]
    deep = await registry.call("list_files", {"path": "src", "recursive": True}, ctx)
    assert deep.content.splitlines() == ["app.py", "util/", "util/.gitignore", "util/helper.py"]
    capped = await registry.call("list_files", {"recursive": True, "max_entries": 2}, ctx)
    assert capped.content.splitlines() == [".gitignore", "README.md", "[stopped after 2 entries]"]
    assert capped.data is not None and capped.data["truncated"] is True
    not_dir = await registry.call("list_files", {"path": "README.md"}, ctx)
    assert not_dir.is_error and "use read_file" in not_dir.content


async def test_glob(project: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    every_py = await registry.call("glob", {"pattern": "**/*.py"}, ctx)
    assert every_py.content.splitlines() == ["src/app.py", "src/util/helper.py"]
    top_only = await registry.call("glob", {"pattern": "*.md"}, ctx)
    assert top_only.content == "README.md"
    scoped = await registry.call("glob", {"pattern": "*.py", "path": "src/util"}, ctx)
    assert scoped.content == "src/util/helper.py"
    none = await registry.call("glob", {"pattern": "*.rs"}, ctx)
    assert not none.is_error and none.content == "No files match '*.rs'."


async def test_search_regex_gitignore_and_binary(project: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    result = await registry.call("search", {"pattern": r"TODO"}, ctx)
    assert result.content.splitlines() == ["keep.log:1: TODO kept", "src/util/helper.py:2:     return 42  # TODO tidy"]
    insensitive = await registry.call("search", {"pattern": "todo", "ignore_case": True, "file_glob": "*.md"}, ctx)
    assert insensitive.content == "README.md:1: Project. todo later"
    python_only = await registry.call("search", {"pattern": r"def \w+\(", "file_glob": "*.py"}, ctx)
    assert python_only.data is not None and python_only.data["paths"] == ["src/app.py", "src/util/helper.py"]
    one_file = await registry.call("search", {"pattern": "return", "path": "src/app.py"}, ctx)
    assert one_file.content == "src/app.py:2:     return helper()"
    bad = await registry.call("search", {"pattern": "def ("}, ctx)
    assert bad.is_error and "invalid regular expression 'def ('" in bad.content
    nothing = await registry.call("search", {"pattern": "zzz"}, ctx)
    assert not nothing.is_error and nothing.content == "No matches for 'zzz'."


async def test_search_skips_fifos(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    os.mkfifo(root / "pipe")  # reading it would block forever
    (root / "real.txt").write_text("needle\n")
    result = await registry.call("search", {"pattern": "needle"}, ctx)
    assert result.content == "real.txt:1: needle"


async def test_list_files_non_recursive_does_not_walk_the_tree(
    root: Path, ctx: ToolContext, registry: ToolRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "deep.txt").write_text("x")
    scanned: list[str] = []
    real_scandir = os.scandir

    def spy(path: Any) -> Any:  # records which folders are read; the real scandir does the work
        named = os.readlink(f"/proc/self/fd/{path}") if isinstance(path, int) else path  # walks read by descriptor
        scanned.append(Path(named).name)
        return real_scandir(path)

    monkeypatch.setattr(ignore_module.os, "scandir", spy)
    result = await registry.call("list_files", {}, ctx)
    assert result.content == "a/" and scanned == ["ws"]
    walked = await registry.call("list_files", {"recursive": True}, ctx)
    assert walked.content.splitlines() == ["a/", "a/b/", "a/b/deep.txt"]


async def test_search_caps_results_and_skips_huge_files(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    (root / "many.txt").write_text("hit\n" * 1000)
    (root / "huge.txt").write_text("hit\n" * 700_000)  # 2.8 MB: skipped
    result = await registry.call("search", {"pattern": "hit", "max_results": 10}, ctx)
    lines = result.content.splitlines()
    assert lines[:10] == [f"many.txt:{i}: hit" for i in range(1, 11)]
    assert "[stopped after 10 matching lines; narrow the pattern or the path]" in lines
    assert "[1 file(s) over 2 MB were not searched]" in lines
    assert result.data is not None and result.data["truncated"] is True


async def test_glob_patterns_with_gitignore_specials(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    (root / "#notes.txt").write_text("x")
    (root / "!bang.txt").write_text("x")
    (root / "dir").mkdir()
    (root / "dir" / "f.txt").write_text("x")
    assert (await registry.call("glob", {"pattern": "#*"}, ctx)).content == "#notes.txt"
    assert (await registry.call("glob", {"pattern": "!*"}, ctx)).content == "!bang.txt"
    assert (await registry.call("glob", {"pattern": "dir/"}, ctx)).content == "No files match 'dir/'."
    assert (await registry.call("glob", {"pattern": "dir/*"}, ctx)).content == "dir/f.txt"
    found = await registry.call("search", {"pattern": "x", "file_glob": "#*"}, ctx)
    assert found.content == "#notes.txt:1: x"


async def test_search_and_glob_budgets(
    root: Path, ctx: ToolContext, registry: ToolRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    for index in range(30):
        (root / f"f{index:02}.txt").write_text("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!\n" * 3)
    monkeypatch.setattr(search_module, "MAX_SCANNED_FILES", 10)
    many = await registry.call("glob", {"pattern": "*.md"}, ctx)
    assert many.content == "No files match '*.md'.\n[stopped after looking at 10 files; narrow the path]"
    scanned = await registry.call("search", {"pattern": "zzz"}, ctx)
    assert scanned.content.endswith("[stopped after scanning 10 files; narrow the path or file_glob]")
    monkeypatch.setattr(search_module, "MAX_SCANNED_FILES", 20_000)
    start = time.monotonic()
    linear = await registry.call("search", {"pattern": r"(a|aa)+$"}, ctx)  # a backtracking engine takes ages here
    assert time.monotonic() - start < 2.0 and linear.content == "No matches for '(a|aa)+$'."
    monkeypatch.setattr(search_module, "SEARCH_BUDGET_S", 0.0)
    slow = await registry.call("search", {"pattern": "a"}, ctx)
    assert slow.content.endswith("[stopped after 0 s; simplify the pattern or narrow the path]")
