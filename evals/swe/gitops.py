"""Git plumbing for the harness: fresh checkouts at a commit, the agent's diff, applying patches.

Every call runs ``git`` as a subprocess with a fixed identity and no user config, so results do not depend on
the machine's ``~/.gitconfig`` (hooks, signing, autocrlf).
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


def git(cwd: Path, *args: str, input: str | None = None, timeout: float = 300.0) -> str:
    """Run one git command in ``cwd`` and return its stdout; raise ``GitError`` on a non-zero exit."""
    try:
        proc = subprocess.run(
            ["git", "-c", "core.autocrlf=false", "-c", "init.defaultBranch=main", *args],
            check=False,
            cwd=cwd,
            input=input,
            capture_output=True,
            text=True,
            env=git_env(),
            timeout=timeout,
        )
    except FileNotFoundError as exc:
        raise GitError("git is not installed (the eval harness needs it)") from exc
    except subprocess.TimeoutExpired as exc:
        raise GitError(f"git {args[0]} timed out after {timeout:.0f}s") from exc
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
        raise GitError(f"git {args[0]} failed: {lines[-1] if lines else f'exit {proc.returncode}'}")
    return proc.stdout


def is_git_repo(path: Path) -> bool:
    """True when ``path`` is the top of a git work tree or a bare repository."""
    return (path / ".git").exists() or ((path / "HEAD").is_file() and (path / "objects").is_dir())


def checkout(repo: str, commit: str, dest: Path) -> str:
    """Create ``dest`` as a fresh checkout of ``repo`` at ``commit`` (a local git repo, a URL, or a plain
    folder that is copied and committed). Returns the commit the workspace's diffs are taken against."""
    src = Path(repo)
    if src.is_dir() and not is_git_repo(src):
        # A plain folder: copy it and make it a repository, so the agent's changes are a git diff too.
        shutil.copytree(src, dest, symlinks=True)
        git(dest, "init", "-q")
        git(dest, "add", "-A", "--", ".", *JUNK_PATHSPECS)
        git(dest, "commit", "-q", "--allow-empty", "-m", "base")
        return git(dest, "rev-parse", "HEAD").strip()
    dest.parent.mkdir(parents=True, exist_ok=True)
    git(dest.parent, "clone", "-q", "--no-checkout", repo, str(dest), timeout=1800.0)
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


def diff_against(workspace: Path, base: str) -> str:
    """The workspace's changes since ``base`` as a binary-safe unified diff, new files included."""
    git(workspace, "add", "-A", "--", ".", *JUNK_PATHSPECS)
    return git(workspace, "diff", "--cached", "--binary", "--no-color", "--no-ext-diff", base, "--")


def apply_patch(workspace: Path, patch: str) -> None:
    """Apply a unified diff to the work tree (with a 3-way fallback); raise ``GitError`` when it fails."""
    if not patch.strip():
        return
    text = patch if patch.endswith("\n") else patch + "\n"
    try:
        git(workspace, "apply", "--whitespace=nowarn", "-", input=text)
    except GitError:
        git(workspace, "apply", "--whitespace=nowarn", "--3way", "-", input=text)


def patch_files(patch: str) -> list[str]:
    """Paths a unified diff touches (the ``b/`` side, or ``a/`` for deletions)."""
    files: list[str] = []
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            parts = line.split(" ")
            if len(parts) >= 4:
                path = parts[3].removeprefix("b/")
                files.append(path)
    return files


def has_git() -> bool:
    """True when a ``git`` executable is on PATH."""
    return shutil.which("git") is not None
