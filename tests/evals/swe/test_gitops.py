"""Git plumbing on arbitrary bytes: random trees (any byte in content and names) survive diff -> text -> JSON ->
apply exactly, under a ``.gitattributes`` that would convert them; ``patch_files`` agrees with git."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from freetoken_agent.evals.swe.gitops import (
    GitError,
    apply_patch,
    checkout,
    diff_against,
    git,
    git_bytes,
    patch_bytes,
    patch_files,
    patch_text,
    unquote_path,
)

from tests.evals.swe.support import make_repo

# Would convert every file on checkout and add (eol, keyword expansion, a filter) if the harness let it.
ATTRIBUTES = b"* text=auto eol=crlf ident\n*.txt text eol=crlf\n*.bin filter=missing\n"
NAME_CHARS = b"abcXYZ019 _-.\"\\\t\xe9\xff\x80\xc3\xa9"  # spaces, quotes, backslash, tab, bytes not UTF-8


def random_name(rng: random.Random) -> str:
    """A file name from bytes git must quote (tab, quote, backslash, non-ASCII, invalid UTF-8), maybe in a folder."""
    stem = bytes(rng.choice(NAME_CHARS) for _ in range(rng.randint(1, 8))).strip(b".") or b"f"
    ext = rng.choice([b"", b".txt", b".bin", b".py"])
    folder = rng.choice([b"", b"sub/", b"d\xe9/"])
    return os.fsdecode(folder + stem + ext)


def random_content(rng: random.Random) -> bytes:
    """Lines ending in LF, CRLF or lone CR, sometimes no final newline, sometimes NUL and high bytes."""
    alphabet = rng.choice([b"abc \t", b"abc\x00\xff\x80", bytes(range(256))])
    lines = [bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) + rng.choice([b"\n", b"\r\n", b"\r"])
             for _ in range(rng.randint(0, 6))]
    body = b"".join(lines)
    return body[:-1] if body and rng.random() < 0.4 else body


def tree(root: Path) -> dict[bytes, bytes]:
    """Every file under ``root`` (but .git) by its byte path, with its bytes."""
    out: dict[bytes, bytes] = {}
    for folder, dirs, files in os.walk(os.fsencode(root)):
        dirs[:] = [d for d in dirs if d != b".git"]
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, os.fsencode(root))] = f.read()
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_edits_round_trip_exactly(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    files: dict[str, str | bytes | None] = {".gitattributes": ATTRIBUTES, "keyword.py": b"# $Id$\r\nX = 1\n"}
    while len(files) < 14:
        files[random_name(rng)] = random_content(rng)
    upstream = tmp_path / "upstream"
    base = make_repo(upstream, files)
    ws, fresh = tmp_path / "ws", tmp_path / "fresh"
    assert checkout(str(upstream), base, ws) == base
    assert tree(ws) == {os.fsencode(k): v for k, v in files.items()}  # no conversion on checkout
    names = [k for k in files if k != ".gitattributes"]
    for name in rng.sample(names, 6):  # modify, delete, or replace with a binary file
        action = rng.choice(["edit", "delete", "binary"])
        path = ws / name
        if action == "delete":
            path.unlink()
        else:
            path.write_bytes(random_content(rng) + (b"\x00" * 3 if action == "binary" else b""))
    for _ in range(3):
        path = ws / random_name(rng)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(random_content(rng))
    expected = tree(ws)
    patch = diff_against(ws, base)
    # As a task or prediction stores it: text in JSON, and back.
    carried = json.loads(json.dumps({"patch": patch_text(patch)}))["patch"]
    assert patch_bytes(carried) == patch
    checkout(str(upstream), base, fresh)
    apply_patch(fresh, carried)
    assert tree(fresh) == expected
    names_z = git_bytes(ws, "diff", "--cached", "--name-only", "-z", base).split(b"\0")[:-1]
    assert patch_files(patch) == [os.fsdecode(n) for n in names_z]


def test_a_plain_folder_is_committed_as_its_bytes(tmp_path: Path) -> None:
    src = tmp_path / "plain"
    src.mkdir()
    (src / ".gitattributes").write_bytes(ATTRIBUTES)
    (src / "win.txt").write_bytes(b"a\r\nb\r\n")
    (src / "lf.txt").write_bytes(b"a\nb")
    base = checkout(str(src), "", tmp_path / "ws")
    assert git_bytes(tmp_path / "ws", "cat-file", "-p", f"{base}:win.txt") == b"a\r\nb\r\n"
    assert git_bytes(tmp_path / "ws", "cat-file", "-p", f"{base}:lf.txt") == b"a\nb"


def test_patch_files_reads_every_kind_of_section(tmp_path: Path) -> None:
    repo = tmp_path / "r"
    base = make_repo(repo, {"old name.txt": b"same\n" * 20, "mode.sh": b"echo\n", "gone.bin": b"\x00\x01",
                            os.fsdecode(b"caf\xe9.txt"): b"x\n", 'q"uote.txt': b"q", os.fsdecode(b"b \xff "): b"\0"})
    (repo / "old name.txt").rename(repo / "new name.txt")  # a pure rename: no ---/+++ lines
    (repo / "mode.sh").chmod(0o755)  # a mode change: no hunks at all
    (repo / "gone.bin").unlink()
    (repo / os.fsdecode(b"caf\xe9.txt")).write_bytes(b"y\n")
    (repo / 'q"uote.txt').write_bytes(b"Q")
    (repo / os.fsdecode(b"b \xff ")).write_bytes(b"\0\0")  # binary, quoted, ending in a space: no ---/+++
    patch = diff_against(repo, base)
    assert patch_files(patch) == [os.fsdecode(b"b \xff "), os.fsdecode(b"caf\xe9.txt"), "gone.bin", "mode.sh",
                                  "new name.txt", 'q"uote.txt']
    assert patch_files(patch_text(patch)) == patch_files(patch)


def test_unquote_path_reads_git_c_quoting() -> None:
    assert unquote_path(b'"a/caf\\303\\251 \\"x\\"\\t\\\\.txt"') == b'a/caf\xc3\xa9 "x"\t\\.txt'
    assert unquote_path(b"a/plain name.txt") == b"a/plain name.txt"


def test_patch_text_is_lossless_for_every_byte() -> None:
    data = bytes(range(256)) * 2 + b"\r\n\xc3\xa9\xed\xa0\x80"
    text = patch_text(data)
    assert patch_bytes(text) == data and patch_bytes(json.loads(json.dumps(text))) == data


def test_a_patch_that_does_not_apply_raises_git_error(tmp_path: Path) -> None:
    repo = tmp_path / "r"
    base = make_repo(repo, {"win.txt": b"one\r\ntwo\r\n"})
    (repo / "win.txt").write_bytes(b"one\r\nTWO\r\n")
    patch = diff_against(repo, base)
    git(repo, "reset", "-q", "--hard", base)
    with pytest.raises(GitError, match="patch does not apply"):
        apply_patch(repo, patch.replace(b"\r\n", b"\n"))  # what a text-mode capture made of it
    apply_patch(repo, patch)
    assert (repo / "win.txt").read_bytes() == b"one\r\nTWO\r\n"
