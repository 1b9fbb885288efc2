"""The workspace root that coding tools are confined to."""

from __future__ import annotations

import os
from pathlib import Path

from freetoken_agent.tools.context import ToolError


class WorkspaceError(ToolError):
    """A path that is not allowed inside the workspace (escapes the root, malformed). The message is for the model."""


class Workspace:
    """A directory that tools may read and write; every path a tool touches goes through :meth:`resolve`.

    Relative paths are taken from the root. Absolute paths are accepted only when they point inside the root.
    The check is made on the *real* path (symlinks followed), so ``..`` segments and symlinks that leave the root are
    refused, while ``a/../b`` or a symlink that stays inside the root is fine.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        real = Path(os.path.realpath(os.fspath(root)))
        if not real.is_dir():
            raise WorkspaceError(f"workspace root {os.fspath(root)!r} is not a directory")
        self.root: Path = real
        # the root as it is now: opens go through this descriptor, so swapping a folder of the root's path for a
        # symlink later cannot move the workspace
        self.root_fd: int = os.open(real, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def __reduce__(self) -> tuple[type[Workspace], tuple[str]]:
        # copies and pickles open their own descriptor (a copied number would be closed twice)
        return (Workspace, (str(self.root),))

    def __del__(self) -> None:
        fd = getattr(self, "root_fd", None)
        if fd is not None:
            os.close(fd)

    def __repr__(self) -> str:
        return f"Workspace({str(self.root)!r})"

    def resolve(self, path: str | os.PathLike[str] = ".") -> Path:
        """Return the real absolute path for ``path``, or raise :class:`WorkspaceError` if it leaves the root."""
        text = os.fspath(path)
        if not isinstance(text, str):
            raise WorkspaceError(f"path must be text, got {type(text).__name__}")
        if "\x00" in text:
            raise WorkspaceError(f"path {text!r} contains a NUL byte")
        if text.strip() == "":
            text = "."
        candidate = Path(os.path.expanduser(text)) if text.startswith("~") else Path(text)
        if not candidate.is_absolute():
            candidate = self.root / candidate
        real = Path(os.path.realpath(candidate))
        if real != self.root and not real.is_relative_to(self.root):
            lexical = Path(os.path.normpath(candidate))
            if lexical == self.root or lexical.is_relative_to(self.root):
                reason = "it goes through a symlink that leads outside the workspace"
            else:
                reason = "it is outside the workspace"
            raise WorkspaceError(
                f"path {text!r} is not allowed: {reason} (workspace root: {self.root}). "
                "Use a path relative to the workspace root."
            )
        return real

    def relative(self, path: str | os.PathLike[str]) -> str:
        """Return ``path`` (absolute, inside the root) relative to the root, with ``/`` separators, for display."""
        rel = Path(os.fspath(path)).relative_to(self.root)
        text = rel.as_posix()
        return text if text else "."
