"""File access that a hostile workspace cannot redirect: every open is relative to a directory descriptor.

Paths are opened with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`` from the workspace's root descriptor, so
the kernel itself refuses a ``..`` or a symlink that would leave the workspace at the moment of the open (no
check-then-use race). Where ``openat2`` is missing (Linux < 5.6) each component is opened with ``O_NOFOLLOW``
instead. Only regular files with one link are read (a FIFO, device or socket is never opened for reading; a hard
link could name a file outside); new files are written to a random ``O_CREAT | O_EXCL | O_NOFOLLOW`` temporary in
the same folder and renamed over the target.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager

from freetoken_agent.tools.context import ToolError

SYS_OPENAT2 = 437  # the same number on every architecture
RESOLVE_NO_MAGICLINKS, RESOLVE_BENEATH = 0x02, 0x08
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
CHUNK = 1 << 20


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_has_openat2: bool | None = None


def open_beneath(dir_fd: int, rel: str, flags: int, mode: int = 0o666) -> int:
    """Open ``rel`` (relative, ``/``-separated) beneath ``dir_fd``; ``OSError`` (``EXDEV``/``ELOOP``) if it escapes."""
    global _has_openat2
    if rel.startswith("/"):
        raise OSError(errno.EXDEV, "absolute path", rel)
    if _has_openat2 is not False:
        how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
        fd = _libc.syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dir_fd), os.fsencode(rel or "."),
                           ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            _has_openat2 = True
            return int(fd)
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EPERM) or _has_openat2:  # EPERM: a seccomp filter without openat2
            raise OSError(err, os.strerror(err), rel)
        _has_openat2 = False
    return _open_by_components(dir_fd, rel, flags, mode)


def _open_by_components(dir_fd: int, rel: str, flags: int, mode: int) -> int:
    parts = [part for part in rel.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise OSError(errno.EXDEV, "'..' is not allowed", rel)
    current = os.dup(dir_fd)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=current)
            os.close(current)
            current = nxt
        return os.open(parts[-1] if parts else ".", flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=current)
    finally:
        os.close(current)


def describe_open_error(exc: OSError, shown: str) -> str:
    """A message for the model about a failed open of ``shown``."""
    if exc.errno == errno.ENOENT:
        return f"file {shown!r} does not exist"
    if exc.errno in (errno.EXDEV, errno.ELOOP):
        return f"{shown!r} is not allowed: it leads outside the workspace (through '..' or a symlink)"
    if exc.errno == errno.ENOTDIR:
        return f"{shown!r}: a part of the path is not a folder"
    return f"cannot open {shown!r}: {exc.strerror}"


def check_regular(info: os.stat_result, shown: str) -> None:
    """Refuse anything but a regular file with a single link (a hard link may name a file outside the workspace)."""
    if stat.S_ISDIR(info.st_mode):
        raise ToolError(f"{shown!r} is a directory; use list_files to see its contents")
    if not stat.S_ISREG(info.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a socket" if stat.S_ISSOCK(info.st_mode) else "a device"
        raise ToolError(f"{shown!r} is not a regular file ({kind}); only regular files can be read or written")
    if info.st_nlink > 1:
        raise ToolError(f"{shown!r} has {info.st_nlink} hard links; hard-linked files are refused (one of the links "
                        "may be outside the workspace)")


def open_regular(dir_fd: int, rel: str, shown: str) -> tuple[int, os.stat_result]:
    """Open a regular, singly linked file beneath ``dir_fd`` for reading; ``ToolError`` with the reason otherwise.

    The file is first opened with ``O_PATH`` (which never blocks and has no side effects, even on a FIFO or a
    device) and checked; then it is opened for reading and must still be the same file.
    """
    try:
        probe_fd = open_beneath(dir_fd, rel, os.O_PATH)
    except OSError as exc:
        raise ToolError(describe_open_error(exc, shown)) from None
    try:
        info = os.fstat(probe_fd)
    finally:
        os.close(probe_fd)
    check_regular(info, shown)
    try:
        fd = open_beneath(dir_fd, rel, READ_FLAGS)
    except OSError as exc:
        raise ToolError(describe_open_error(exc, shown)) from None
    again = os.fstat(fd)
    if (again.st_dev, again.st_ino) != (info.st_dev, info.st_ino) or not stat.S_ISREG(again.st_mode):
        os.close(fd)
        raise ToolError(f"{shown!r} changed while it was being opened; try again")
    check_regular(again, shown)
    return fd, again


def read_capped(fd: int, max_bytes: int) -> tuple[bytes, bool]:
    """Up to ``max_bytes`` from ``fd``; the flag says whether the file had more."""
    chunks: list[bytes] = []
    left = max_bytes + 1
    while left > 0:
        chunk = os.read(fd, min(CHUNK, left))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    data = b"".join(chunks)
    return data[:max_bytes], len(data) > max_bytes


@contextmanager
def parent_dir(root_fd: int, rel: str, *, create: bool) -> Iterator[tuple[int, str]]:
    """The folder holding ``rel`` (opened beneath ``root_fd``; created when ``create``) and the final name."""
    parts = [part for part in rel.split("/") if part not in ("", ".")]
    if not parts or ".." in parts:
        raise ToolError(f"{rel!r} does not name a file inside the workspace")
    current = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            try:
                nxt = open_beneath(current, part, DIR_FLAGS)
            except FileNotFoundError:
                if not create:
                    raise ToolError(f"file {rel!r} does not exist (its folder {part!r} is missing)") from None
                try:
                    os.mkdir(part, 0o777, dir_fd=current)
                except FileExistsError:
                    pass
                nxt = open_beneath(current, part, DIR_FLAGS | os.O_NOFOLLOW)
            except OSError as exc:
                raise ToolError(describe_open_error(exc, rel)) from None
            os.close(current)
            current = nxt
        yield current, parts[-1]
    finally:
        os.close(current)


def write_atomic(dir_fd: int, name: str, data: bytes, mode: int | None) -> None:
    """Replace ``name`` in ``dir_fd`` by ``data``: a random temporary (``O_EXCL | O_NOFOLLOW``), then a rename.

    A planted symlink or file at any temporary name makes the create fail instead of writing through it; ``mode``
    is the permission bits to keep (None: a new file, the umask decides).
    """
    tmp = f".{name[:100]}.{secrets.token_hex(8)}.freetoken-tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o666 if mode is None else 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if mode is not None:
                os.fchmod(fd, mode & 0o777)  # never copy set-uid/set-gid bits
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
