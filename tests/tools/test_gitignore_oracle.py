"""Our .gitignore walk agrees with git itself (``git ls-files --others --exclude-standard``) on random rule sets."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from freetoken_agent.tools.ignore import walk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is the oracle")

FILES = [
    "a.log", "keep.log", "top.txt", "a.py", "b.py", "ab.py", "#x", "name with space.txt",
    "build/out.txt", "build/keep.log", "sub/top.txt", "sub/a.py",
    "src/a.py", "src/b.txt", "src/build/x.py", "src/sub/deep/c.py", "src/sub/deep/d.txt",
    "docs/x.md", "docs/sub/y.md", "docs/sub/z.txt", "deep/e.py",
]
PATTERNS = [
    "*.log", "!keep.log", "build/", "/build", "build", "src/*.py", "**/deep", "docs/**", "*.md", "!docs/sub/y.md",
    "sub/", "/top.txt", "top.txt", "?.py", "[ab].py", "[!a].py", "src/**/c.py", "*", "!src/", "!*.py", "deep/",
    "# a comment", "\\#x", "a*", "**/*.txt", "!**/d.txt", "docs/*", "/sub", "sub/*.py", "!/src/build",
    "*.txt", "name\\ with\\ space.txt", "src/sub", "!docs/", "**/sub/**", "", "x.py/",
]
rules = st.lists(st.sampled_from(PATTERNS), max_size=6)


def _git_visible(root: Path) -> set[str]:
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    out = subprocess.run(
        ["git", "-C", str(root), "-c", "core.quotePath=false", "ls-files", "--others", "--exclude-standard", "-z"],
        check=True, capture_output=True, text=True,
    ).stdout
    return {name for name in out.split("\0") if name}


def _ours(root: Path) -> set[str]:
    return {path.relative_to(root).as_posix() for path, is_dir in walk(root, root) if not is_dir}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(root_rules=rules, nested_rules=rules)
def test_walk_matches_git(root_rules: list[str], nested_rules: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for rel in FILES:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text("x")
        (root / ".gitignore").write_text("\n".join(root_rules) + "\n")
        (root / "src" / ".gitignore").write_text("\n".join(nested_rules) + "\n")
        assert _ours(root) == _git_visible(root), (root_rules, nested_rules)
