"""Git plumbing for the harness: fresh checkouts at a commit, the agent's diff, applying patches.

Every call runs ``git`` as a subprocess with a fixed identity and no user config, so results do not depend on
the machine's ``~/.gitconfig`` (hooks, signing, autocrlf). Content is bytes end to end: output is captured and
patches are fed in binary mode (text mode would turn CRLF into LF), diffs carry binary files as git binary
patches, and every repository the harness works in has git's content conversions switched off
(``RAW_ATTRIBUTES``), so a work tree holds exactly the bytes of its commit whatever ``.gitattributes`` says.

Where a patch has to be text (``Task.patch`` in a JSONL, ``model_patch`` in predictions.jsonl) it is the bytes
decoded as UTF-8 with ``surrogateescape``: bytes that are not UTF-8 become lone surrogates, which Python's json
writes as ``\\udcXX`` escapes and reads back, so ``patch_bytes(patch_text(b)) == b`` for every ``b``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

# Paths that never belong in a patch: interpreter and tool caches the agent's commands leave behind.
JUNK_PATHSPECS = [
    ":(exclude,glob)**/__pycache__/**",
    ":(exclude,glob)**/*.pyc",
    ":(exclude,glob)**/.pytest_cache/**",
]

# Written to ``.git/info/attributes``, which outranks every ``.gitattributes`` in the tree: no end-of-line
# conversion (``text``/``eol``), no clean/smudge filters, no ``$Id$`` expansion, no re-encoding. Patches are
# diffs between blobs, so they must meet the blobs' bytes in the work tree, not a converted copy.
RAW_ATTRIBUTES = b"* -text -eol -filter -ident -working-tree-encoding\n"

# Fixed settings for every call: no CRLF conversion, non-ASCII path bytes quoted (so patch headers are ASCII).
_CONFIG = ["-c", "core.autocrlf=false", "-c", "core.safecrlf=false", "-c", "core.quotepath=true",
           "-c", "init.defaultBranch=main"]


class GitError(Exception):
    """A git command failed; the message holds git's own last error line."""


def git_env() -> dict[str, str]:
    """The environment every git call runs with: fixed author and dates, no global or system config."""
    env = dict(os.environ)
    env.update(
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_AUTHOR_NAME="freetoken-eval",
        GIT_AUTHOR_EMAIL="eval@freetoken.invalid",
        GIT_COMMITTER_NAME="freetoken-eval",
        GIT_COMMITTER_EMAIL="eval@freetoken.invalid",
        GIT_AUTHOR_DATE="2024-01-01T00:00:00+0000",
        GIT_COMMITTER_DATE="2024-01-01T00:00:00+0000",
        GIT_TERMINAL_PROMPT="0",
    )
    return env


def git_bytes(cwd: Path, *args: str, input: bytes | None = None, timeout: float = 300.0) -> bytes:
    """Run one git command in ``cwd`` and return its stdout exactly as git wrote it; raise ``GitError`` on a
    non-zero exit."""
    try:
        proc = subprocess.run(["git", *_CONFIG, *args], check=False, cwd=cwd, input=input, capture_output=True,
                              env=git_env(), timeout=timeout)
    except FileNotFoundError as exc:
        raise GitError("git is not installed (the eval harness needs it)") from exc
    except subprocess.TimeoutExpired as exc:
        raise GitError(f"git {args[0]} timed out after {timeout:.0f}s") from exc
    if proc.returncode != 0:
        text = (proc.stderr or proc.stdout).decode("utf-8", "replace")
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        raise GitError(f"git {args[0]} failed: {lines[-1] if lines else f'exit {proc.returncode}'}")
    return proc.stdout


def git(cwd: Path, *args: str, input: str | bytes | None = None, timeout: float = 300.0) -> str:
    """``git_bytes`` for commands whose output is text (shas, names): decoded without newline translation,
    bytes that are not UTF-8 kept as surrogates (``patch_text``)."""
    data = patch_bytes(input) if input is not None else None
    return patch_text(git_bytes(cwd, *args, input=data, timeout=timeout))


def patch_bytes(patch: str | bytes) -> bytes:
    """A patch as bytes: ``bytes`` unchanged, text encoded as UTF-8 with ``surrogateescape`` (the inverse of
    ``patch_text``)."""
    return patch if isinstance(patch, bytes) else patch.encode("utf-8", "surrogateescape")


def patch_text(patch: bytes) -> str:
    """A patch as text for JSON: UTF-8, with each byte that is not UTF-8 as a lone surrogate (U+DC80-U+DCFF)."""
    return patch.decode("utf-8", "surrogateescape")


def disable_conversions(repo: Path) -> None:
    """Switch off git's content conversions in the repository at ``repo`` (a work tree) for every later
    checkout, add, diff and apply (see ``RAW_ATTRIBUTES``)."""
    info = Path(git(repo, "rev-parse", "--absolute-git-dir").strip()) / "info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "attributes").write_bytes(RAW_ATTRIBUTES)


def is_git_repo(path: Path) -> bool:
    """True when ``path`` is the top of a git work tree or a bare repository."""
    return (path / ".git").exists() or ((path / "HEAD").is_file() and (path / "objects").is_dir())


def checkout(repo: str, commit: str, dest: Path) -> str:
    """Create ``dest`` as a fresh checkout of ``repo`` at ``commit`` (a local git repo, a URL, or a plain
    folder that is copied and committed), with content conversions off (``disable_conversions``). Returns the
    commit the workspace's diffs are taken against."""
    src = Path(repo)
    if src.is_dir() and not is_git_repo(src):
        # A plain folder: copy it and make it a repository, so the agent's changes are a git diff too.
        shutil.copytree(src, dest, symlinks=True)
        git(dest, "init", "-q")
        disable_conversions(dest)
        git(dest, "add", "-A", "--", ".", *JUNK_PATHSPECS)
        git(dest, "commit", "-q", "--allow-empty", "-m", "base")
        return git(dest, "rev-parse", "HEAD").strip()
    dest.parent.mkdir(parents=True, exist_ok=True)
    git(dest.parent, "clone", "-q", "--no-checkout", repo, str(dest), timeout=1800.0)
    disable_conversions(dest)  # before the first checkout writes any file
    target = commit or "HEAD"
    try:
        git(dest, "checkout", "-q", "--detach", target)
    except GitError as exc:
        raise GitError(f"commit {target} not found in {repo} ({exc})") from exc
    return git(dest, "rev-parse", "HEAD").strip()


def snapshot(workspace: Path, message: str) -> str:
    """Commit the work tree as it is (caches excluded) and return the commit."""
    git(workspace, "add", "-A", "--", ".", *JUNK_PATHSPECS)
    git(workspace, "commit", "-q", "--allow-empty", "--no-verify", "-m", message)
    return git(workspace, "rev-parse", "HEAD").strip()


def diff_against(workspace: Path, base: str) -> bytes:
    """The workspace's changes since ``base`` as the exact bytes of a git diff, new and deleted files included,
    binary files as git binary patches (no textconv or external diff: the result must apply)."""
    git(workspace, "add", "-A", "--", ".", *JUNK_PATHSPECS)
    return git_bytes(workspace, "diff", "--cached", "--binary", "--no-color", "--no-ext-diff", "--no-textconv",
                     base, "--")


def apply_patch(workspace: Path, patch: str | bytes) -> None:
    """Apply a git diff (bytes, or text as ``patch_text`` makes it) to the work tree, with a 3-way fallback;
    raise ``GitError`` when it fails."""
    data = patch_bytes(patch)
    if not data.strip():
        return
    if not data.endswith(b"\n"):
        data += b"\n"
    try:
        git_bytes(workspace, "apply", "--whitespace=nowarn", "-", input=data)
    except GitError:
        git_bytes(workspace, "apply", "--whitespace=nowarn", "--3way", "-", input=data)


_ESCAPES = {ord("a"): 7, ord("b"): 8, ord("t"): 9, ord("n"): 10, ord("v"): 11, ord("f"): 12, ord("r"): 13,
            ord('"'): 34, ord("\\"): 92}


def unquote_path(name: bytes) -> bytes:
    """A path as git writes it in a diff header: as it is, or C-quoted (``"a/caf\\303\\251.txt"``) when it holds
    bytes outside printable ASCII, quotes or backslashes."""
    if not (len(name) >= 2 and name.startswith(b'"') and name.endswith(b'"')):
        return name
    out, body, i = bytearray(), name[1:-1], 0
    while i < len(body):
        if body[i] == 92 and i + 1 < len(body):  # backslash
            digits = body[i + 1 : i + 4]
            if len(digits) == 3 and digits.isdigit():
                out.append(int(digits, 8))
                i += 4
                continue
            out.append(_ESCAPES.get(body[i + 1], body[i + 1]))
            i += 2
            continue
        out.append(body[i])
        i += 1
    return bytes(out)


def _header_path(line: bytes, prefix: bytes) -> bytes | None:
    """The path on a ``--- a/X`` / ``+++ b/X`` line (None for /dev/null); git ends names holding a space with a
    tab there."""
    name = line[4:].rstrip(b"\r").removesuffix(b"\t")
    if name == b"/dev/null":
        return None
    return unquote_path(name).removeprefix(prefix)


def _git_line_path(line: bytes) -> bytes:
    """The ``b/`` path of a ``diff --git a/X b/Y`` line (for sections without ---/+++ lines: binary files, mode
    changes, pure renames)."""
    names = line[len(b"diff --git "):].rstrip(b"\r")
    if names.startswith(b'"'):  # a quoted a/ side: skip to its closing quote (escaped quotes are \\")
        i = 1
        while i < len(names) and names[i] != ord('"'):
            i += 2 if names[i] == ord("\\") else 1
        second = names[i + 2 :]
    elif names.endswith(b'"'):  # only the b/ side quoted; an unquoted name never holds a quote
        second = names[names.index(b' "') + 1 :]
    else:  # unquoted, both sides equal: "a/NAME b/NAME" (NAME may hold spaces), so the second half is b/
        second = names[(len(names) - 1) // 2 + 1 :]
    return unquote_path(second).removeprefix(b"b/")


def patch_files(patch: str | bytes) -> list[str]:
    """Paths a git diff touches, in order (the new side; the old one for deletions), as ``os.fsdecode`` gives
    them: quoted names are unquoted, bytes that are not UTF-8 become surrogates."""
    files: list[str] = []
    sections = patch_bytes(patch).split(b"\ndiff --git ")
    for i, section in enumerate(sections):
        if i == 0:
            if not section.startswith(b"diff --git "):
                continue
            section = section[len(b"diff --git "):]
        lines = section.split(b"\n")
        path: bytes | None = None
        old: bytes | None = None
        for line in lines[1:]:
            if line.startswith((b"@@", b"GIT binary patch")):
                break
            if line.startswith((b"rename to ", b"copy to ")):
                path = unquote_path(line.split(b" ", 2)[2].rstrip(b"\r"))
            elif line.startswith(b"--- "):
                old = _header_path(line, b"a/")
            elif line.startswith(b"+++ "):
                path = _header_path(line, b"b/") or old
        files.append(os.fsdecode(path if path is not None else _git_line_path(b"diff --git " + lines[0])))
    return files


def has_git() -> bool:
    """True when a ``git`` executable is on PATH."""
    return shutil.which("git") is not None
