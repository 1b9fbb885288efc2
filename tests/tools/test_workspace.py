"""Adversarial path confinement: nothing outside the workspace root can be read, written, listed or searched."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from freetoken_agent.tools import ToolContext, ToolRegistry, Workspace, WorkspaceError

pytestmark = pytest.mark.anyio


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret.txt"
    path.write_text("TOP SECRET\n")
    return path


def test_resolve_inside_paths(root: Path) -> None:
    ws = Workspace(root)
    (root / "a").mkdir()
    assert ws.resolve("a/../b.txt") == root.resolve() / "b.txt"
    assert ws.resolve("") == ws.resolve(".") == root.resolve()
    assert ws.resolve(str(root / "a")) == root.resolve() / "a"  # absolute inside the root is fine
    os.symlink(root / "a", root / "link-in")
    assert ws.resolve("link-in/x") == root.resolve() / "a" / "x"
    assert ws.relative(ws.resolve("a/x.py")) == "a/x.py" and ws.relative(ws.root) == "."


@pytest.mark.parametrize("path", ["..", "../secret.txt", "a/../../secret.txt", "/etc/passwd", "~", "ok\x00bad"])
def test_resolve_refuses_escapes(root: Path, secret: Path, path: str) -> None:
    with pytest.raises(WorkspaceError, match="not allowed|NUL"):
        Workspace(root).resolve(path)


def test_symlink_escapes_refused(root: Path, secret: Path) -> None:
    os.symlink(secret, root / "leak.txt")
    os.symlink(secret.parent, root / "outside")
    ws = Workspace(root)
    for path in ("leak.txt", "outside/secret.txt", "outside"):
        with pytest.raises(WorkspaceError, match="symlink that leads outside"):
            ws.resolve(path)


def test_root_must_be_a_directory(tmp_path: Path) -> None:
    with pytest.raises(WorkspaceError, match="not a directory"):
        Workspace(tmp_path / "missing")


@pytest.mark.parametrize(
    "name, args",
    [
        ("read_file", {"path": "../secret.txt"}),
        ("read_file", {"path": "leak.txt"}),
        ("read_file", {"path": "outside/secret.txt"}),
        ("write_file", {"path": "outside/secret.txt", "content": "pwned"}),
        ("write_file", {"path": "leak.txt", "content": "pwned"}),
        ("edit_file", {"path": "leak.txt", "old_string": "TOP", "new_string": "pwned"}),
        ("list_files", {"path": ".."}),
        ("glob", {"pattern": "*", "path": "outside"}),
        ("search", {"pattern": "SECRET", "path": "/"}),
        ("run_tests", {"paths": ["../secret.txt"]}),
    ],
)
async def test_tools_refuse_escapes(
    root: Path, secret: Path, ctx: ToolContext, registry: ToolRegistry, name: str, args: dict[str, object]
) -> None:
    os.symlink(secret, root / "leak.txt")
    os.symlink(secret.parent, root / "outside")
    result = await registry.call(name, args, ctx)
    assert result.is_error, result.content
    assert "is not allowed" in result.content and "SECRET" not in result.content.replace("'SECRET'", "")
    assert secret.read_text() == "TOP SECRET\n"


async def test_walks_skip_symlinks_that_leave(
    root: Path, secret: Path, ctx: ToolContext, registry: ToolRegistry
) -> None:
    os.symlink(secret, root / "leak.txt")
    os.symlink(secret.parent, root / "outside")
    (root / "inside.txt").write_text("SECRET? no, public\n")
    os.symlink(root / "inside.txt", root / "alias.txt")
    found = await registry.call("search", {"pattern": "SECRET"}, ctx)
    assert found.data is not None and found.data["paths"] == ["inside.txt"]  # alias resolves to the same real file
    listed = await registry.call("list_files", {"recursive": True}, ctx)
    assert listed.content.splitlines() == ["alias.txt", "inside.txt"]


async def test_dangling_symlink_cannot_create_files_outside(
    root: Path, tmp_path: Path, ctx: ToolContext, registry: ToolRegistry
) -> None:
    outside = tmp_path / "created-outside.txt"
    os.symlink(outside, root / "dangling.txt")
    result = await registry.call("write_file", {"path": "dangling.txt", "content": "pwned"}, ctx)
    assert result.is_error and "symlink that leads outside" in result.content
    assert not outside.exists()
    edited = await registry.call("edit_file", {"path": "dangling.txt", "old_string": "a", "new_string": "b"}, ctx)
    assert edited.is_error and not outside.exists()
