"""read_file, write_file and edit_file on real files in a temp workspace."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from freetoken_agent.tools import ToolContext, ToolRegistry

pytestmark = pytest.mark.anyio


async def test_read_file_numbers_and_ranges(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    (root / "pkg").mkdir()
    (root / "pkg" / "m.py").write_text("".join(f"line {i}\n" for i in range(1, 11)))
    whole = await registry.call("read_file", {"path": "pkg/m.py"}, ctx)
    assert not whole.is_error
    assert whole.content.splitlines()[0] == "     1\tline 1" and whole.content.splitlines()[-1] == "    10\tline 10"
    part = await registry.call("read_file", {"path": "pkg/m.py", "start_line": 3, "end_line": 4}, ctx)
    assert part.content == "     3\tline 3\n     4\tline 4"
    assert part.data == {"paths": ["pkg/m.py"], "start_line": 3, "end_line": 4}
    past = await registry.call("read_file", {"path": "pkg/m.py", "start_line": 50}, ctx)
    assert past.is_error and "past the end" in past.content and "10 lines" in past.content
    backwards = await registry.call("read_file", {"path": "pkg/m.py", "start_line": 5, "end_line": 2}, ctx)
    assert backwards.is_error and "before start_line" in backwards.content
    missing = await registry.call("read_file", {"path": "pkg/nope.py"}, ctx)
    assert missing.is_error and "does not exist" in missing.content
    folder = await registry.call("read_file", {"path": "pkg"}, ctx)
    assert folder.is_error and "is a directory" in folder.content
    (root / "empty.txt").write_text("")
    assert (await registry.call("read_file", {"path": "empty.txt"}, ctx)).content == "empty.txt is empty."


async def test_read_file_huge_file_is_capped_and_fast(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    line = "x" * 99 + "\n"
    with (root / "huge.log").open("w") as handle:
        for _ in range(20):
            handle.write(line * 10_000)  # 200k lines, 20 MB
    start = time.monotonic()
    result = await registry.call("read_file", {"path": "huge.log"}, ctx)
    assert time.monotonic() - start < 2.0
    assert not result.is_error
    assert len(result.content) <= ctx.max_output_chars + 200
    assert "more follow: call again with start_line=" in result.content
    assert result.data is not None
    next_start = result.data["end_line"] + 1
    window = {"path": "huge.log", "start_line": next_start, "end_line": next_start}
    following = await registry.call("read_file", window, ctx)
    assert following.content == f"{next_start:>6}\t{'x' * 99}"
    deep = await registry.call("read_file", {"path": "huge.log", "start_line": 199_999}, ctx)
    assert deep.content.splitlines() == [f"199999\t{'x' * 99}", f"200000\t{'x' * 99}"]


async def test_read_file_long_lines_truncated(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    (root / "min.js").write_text("a" * 5_000_000 + "\nsecond\n")  # one 5 MB line
    result = await registry.call("read_file", {"path": "min.js"}, ctx)
    lines = result.content.splitlines()
    assert lines[0] == "     1\t" + "a" * 2000 + " [... line truncated]"
    assert lines[1] == "     2\tsecond"
    assert "1 line(s) longer than 2000 characters were truncated" in lines[-1]


@pytest.mark.parametrize(
    "payload", [b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", bytes(range(256)) * 4, b"\xff\xfe\xfa" * 100]
)
async def test_read_file_refuses_binary(root: Path, ctx: ToolContext, registry: ToolRegistry, payload: bytes) -> None:
    (root / "blob.bin").write_bytes(payload)
    result = await registry.call("read_file", {"path": "blob.bin"}, ctx)
    assert result.is_error and "binary file" in result.content


async def test_read_file_utf8_multibyte_not_binary(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    (root / "u.txt").write_text("é" * 8000 + "\n")  # sniff window ends in the middle of a character
    result = await registry.call("read_file", {"path": "u.txt"}, ctx)
    assert not result.is_error and "é" * 100 in result.content


async def test_write_file_creates_and_replaces(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    created = await registry.call("write_file", {"path": "a/b/new.py", "content": "x = 1\n"}, ctx)
    assert not created.is_error and created.content == "Created a/b/new.py (6 bytes, 1 lines)."
    assert (root / "a" / "b" / "new.py").read_text() == "x = 1\n"
    assert created.data is not None and created.data["created"] is True and "+x = 1" in created.data["diff"]
    os.chmod(root / "a" / "b" / "new.py", 0o755)
    updated = await registry.call("write_file", {"path": "a/b/new.py", "content": "x = 2\n"}, ctx)
    assert updated.content.startswith("Updated a/b/new.py")
    assert updated.data is not None and "-x = 1\n+x = 2\n" in updated.data["diff"]
    assert stat.S_IMODE((root / "a" / "b" / "new.py").stat().st_mode) == 0o755  # mode kept across the atomic replace
    assert sorted(p.name for p in (root / "a" / "b").iterdir()) == ["new.py"]  # no temp file left behind
    folder = await registry.call("write_file", {"path": "a", "content": ""}, ctx)
    assert folder.is_error and "is a directory" in folder.content
    (root / "img.bin").write_bytes(b"\x00\x01")
    replaced = await registry.call("write_file", {"path": "img.bin", "content": "text"}, ctx)
    assert not replaced.is_error and (root / "img.bin").read_text() == "text"


SOURCE = "def f(x):\n    return x - 1\n\n\ndef g(x):\n    return x - 1\n"


async def test_edit_file_exact_unique_replace(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    (root / "m.py").write_text(SOURCE)
    result = await registry.call(
        "edit_file",
        {"path": "m.py", "old_string": "def g(x):\n    return x - 1", "new_string": "def g(x):\n    return x + 1"},
        ctx,
    )
    assert not result.is_error, result.content
    assert (root / "m.py").read_text() == SOURCE.replace("return x - 1\n", "return x + 1\n").replace(
        "def f(x):\n    return x + 1", "def f(x):\n    return x - 1"
    )
    assert result.data is not None and result.data["replacements"] == 1
    assert "-    return x - 1\n+    return x + 1\n" in result.data["diff"]
    assert result.data["diff"].startswith("--- a/m.py\n+++ b/m.py\n@@ -3,4 +3,4 @@")
    assert result.content.startswith("Edited m.py: replaced 1 occurrence.\n--- a/m.py")


async def test_edit_file_errors_are_actionable(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    (root / "m.py").write_text(SOURCE)
    call = lambda **kw: registry.call("edit_file", {"path": "m.py", **kw}, ctx)  # noqa: E731
    ambiguous = await call(old_string="return x - 1", new_string="return x")
    assert ambiguous.is_error and "occurs 2 times in m.py (starting at lines 2, 6)" in ambiguous.content
    assert "set replace_all to true" in ambiguous.content
    missing = await call(old_string="return x * 1", new_string="y")
    assert missing.is_error and "old_string was not found in m.py" in missing.content
    indent = await call(old_string="def f(x):\n  return x - 1", new_string="y")
    assert indent.is_error and "first line of old_string appears at line 1" in indent.content
    empty = await call(old_string="", new_string="y")
    assert empty.is_error and "old_string is empty" in empty.content
    same = await call(old_string="def f", new_string="def f")
    assert same.is_error and "identical" in same.content
    assert (root / "m.py").read_text() == SOURCE  # nothing was written by any failed edit
    everywhere = await call(old_string="x - 1", new_string="x - 2", replace_all=True)
    assert not everywhere.is_error and everywhere.data is not None and everywhere.data["replacements"] == 2
    assert (root / "m.py").read_text().count("x - 2") == 2


async def test_edit_file_keeps_crlf_and_refuses_binary(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    (root / "w.txt").write_bytes(b"one\r\ntwo\r\n")
    result = await registry.call("edit_file", {"path": "w.txt", "old_string": "two", "new_string": "2"}, ctx)
    assert not result.is_error and (root / "w.txt").read_bytes() == b"one\r\n2\r\n"
    (root / "b.dat").write_bytes(b"abc\x00def")
    binary = await registry.call("edit_file", {"path": "b.dat", "old_string": "abc", "new_string": "x"}, ctx)
    assert binary.is_error and "binary file" in binary.content


async def test_edit_file_lf_text_matches_crlf_file(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    (root / "dos.py").write_bytes(b"def f():\r\n    return 1\r\n")
    args = {"path": "dos.py", "old_string": "def f():\n    return 1", "new_string": "def f():\n    return 2"}
    result = await registry.call("edit_file", args, ctx)
    assert not result.is_error, result.content
    assert (root / "dos.py").read_bytes() == b"def f():\r\n    return 2\r\n"


async def test_edit_file_refuses_huge_files(root: Path, ctx: ToolContext, registry: ToolRegistry) -> None:
    with (root / "big.txt").open("w") as handle:
        handle.write("needle\n" + "x" * 11 * 1024 * 1024)
    result = await registry.call("edit_file", {"path": "big.txt", "old_string": "needle", "new_string": "pin"}, ctx)
    assert result.is_error and "cannot be edited" in result.content and "10485760 bytes" in result.content
    assert (root / "big.txt").read_bytes()[:6] == b"needle"
