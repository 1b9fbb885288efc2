"""The sandbox launcher: run as ``python -I launcher.py SPEC.json`` in place of the command it confines.

Standard library only, and imported by path, so the confined process never imports the agent. In order:

1. with ``namespaces``: a new user, mount and PID namespace (and network namespace unless network is allowed, with
   only its own loopback up); a private ``/dev/shm``; credential folders and files hidden (an empty tmpfs,
   ``/dev/null``); ``.git`` and other read-only paths bind-mounted read-only; then a fork: the child is PID 1 of the
   new namespace, so when it exits the kernel kills every process left in it (daemons, ``setsid``);
2. resource limits, ``PR_SET_NO_NEW_PRIVS``, and a Landlock domain (everything readable, only the write paths
   writable, TCP denied when the network is off, no signals out of the sandbox);
3. the command is forked and executed; this process reaps every orphan (PID 1, or a child subreaper without
   namespaces), kills the whole tree when the command ends, and kills it early when it runs more than
   ``processes`` processes, or holds that many for a second (a fork bomb: root ignores ``RLIMIT_NPROC``, and
   elsewhere the bomb keeps retrying its forks at the limit).

Exit status: the command's, 128 + N when a signal N killed it, 125 when the sandbox itself could not be set up.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import resource
import signal
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import landlock  # noqa: E402  (a sibling file, imported by path: see the module docstring)

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
SETUP_FAILED = 125
POLL_S = 0.02
FULL_GRACE_S = 1.0  # how long a command may hold the process cap before it is taken for a fork bomb
LIMITS = {"cpu_s": resource.RLIMIT_CPU, "memory_bytes": resource.RLIMIT_DATA, "file_bytes": resource.RLIMIT_FSIZE,
          "processes": resource.RLIMIT_NPROC, "open_files": resource.RLIMIT_NOFILE}


class SetupError(Exception):
    """The sandbox could not be set up; reported on stderr with exit code 125."""


_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what} failed: {os.strerror(errno)}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def enter_namespaces(spec: dict) -> None:
    """New user (same uid/gid), mount, PID and, unless networking is allowed, network namespaces."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | (0 if spec["network"] else CLONE_NEWNET)
    _check(_libc.unshare(flags), "unshare(user, mount, pid, net namespaces)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _check(_libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making mounts private")
    if os.path.isdir("/dev/shm"):  # a private, size-capped /dev/shm: multiprocessing's semaphores live there
        size = f"size={spec['shm_bytes']},mode=1777".encode()
        _check(_libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, size), "mounting a private /dev/shm")
    for path in spec["hidden"]:
        _hide(path)
    for path in spec["read_only"]:
        if os.path.lexists(path):
            _bind_read_only(path)
    if not spec["network"]:
        _loopback_up()


def _bind_read_only(path: str) -> None:
    raw = os.fsencode(path)
    _check(_libc.mount(raw, raw, None, MS_BIND | MS_REC, None), f"bind-mounting {path}")
    # a remount inside a user namespace must keep the flags the mount already has (they are locked)
    f = os.statvfs(path).f_flag
    kept = sum(ms for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                                 (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
                                 (os.ST_RELATIME, MS_RELATIME)) if f & st)
    _check(_libc.mount(None, raw, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept, None), f"making {path} read-only")


def _hide(path: str) -> None:
    # credentials: an empty read-only tmpfs over a folder, /dev/null over a file
    raw = os.fsencode(path)
    if os.path.isdir(path):
        _check(_libc.mount(b"tmpfs", raw, b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, b"size=4k"),
               f"hiding {path}")
    elif os.path.exists(path):
        _check(_libc.mount(b"/dev/null", raw, None, MS_BIND, None), f"hiding {path}")


def _loopback_up() -> None:
    # the new network namespace has only "lo", down: bring it up so local servers work; nothing leaves the namespace
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def confine(spec: dict) -> None:
    """Resource limits, no new privileges, Landlock: applies to this process and everything it starts."""
    for key, which in LIMITS.items():
        value = spec["limits"].get(key)
        if value is not None:
            hard = resource.getrlimit(which)[1]
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            # CPU: SIGXCPU at the soft limit ("CPU time limit exceeded"), SIGKILL 5 s later
            top = value + 5 if which == resource.RLIMIT_CPU else value
            resource.setrlimit(which, (value, top if hard == resource.RLIM_INFINITY else min(top, hard)))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    landlock.set_no_new_privs()
    if spec["landlock"]:
        landlock.restrict(spec["read"], spec["write"], block_tcp=spec["block_tcp"])


def _count_processes(as_init: bool) -> int:
    """Processes started by the command (this supervisor not counted)."""
    if as_init:
        return sum(1 for name in os.listdir("/proc") if name.isdigit()) - 1
    return len(_descendants(os.getpid()))


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{tid}/children") as handle:
                    kids = [int(word) for word in handle.read().split()]
                found += kids
                todo += kids
        except OSError:
            continue
    return found


def _kill_all(as_init: bool) -> None:
    for _ in range(100):  # a fork bomb can fork between two sweeps: sweep until nothing is left
        if as_init:
            try:
                os.kill(-1, signal.SIGKILL)  # from PID 1: every other process of the namespace
            except ProcessLookupError:
                return
        else:
            pids = _descendants(os.getpid())
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while (reaped := _reap()) is not None and reaped[0] != 0:  # every zombie: they still count in /proc
            pass
        if as_init and _count_processes(as_init) <= 0:
            return


def _reap() -> tuple[int, int] | None:
    try:
        return os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return None


def _boost() -> None:
    # the supervisor must win the CPU against a fork bomb of thousands of runnable processes: a real-time policy
    # (root only: elsewhere RLIMIT_NPROC stops the bomb) at the lowest priority; it sleeps between polls
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
    except (OSError, AttributeError):
        pass


def supervise(spec: dict, as_init: bool) -> int:
    """Start the command, reap orphans until it ends, then kill whatever it left; returns its exit status."""
    if os.sched_getscheduler(0) == os.SCHED_RR:  # the command must not inherit the supervisor's real-time policy
        os.sched_setscheduler(0, os.SCHED_RR | os.SCHED_RESET_ON_FORK, os.sched_param(1))
    if not as_init:
        _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    command = os.fork()
    if command == 0:
        try:
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these; the command must not inherit that
                signal.signal(sig, signal.SIG_DFL)
            os.chdir(spec["cwd"])
            os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
        except OSError as exc:
            os.write(2, f"sandbox: cannot run {spec['argv'][0]!r}: {exc.strerror}\n".encode())
        os._exit(127)
    cap = spec["limits"].get("processes")
    status: int | None = None
    full_since: float | None = None  # when the process count reached the cap
    while status is None:
        while (reaped := _reap()) is not None and reaped[0] != 0:
            if reaped[0] == command:
                status = reaped[1]
        count = _count_processes(as_init) if status is None and cap else 0
        full_since = (full_since or time.monotonic()) if cap and count >= cap else None
        # over the cap (root is exempt from RLIMIT_NPROC), or held at it (a fork bomb retrying its forks)
        if full_since is not None and (count > cap or time.monotonic() - full_since > FULL_GRACE_S):
            os.write(2, f"\nsandbox: the command kept {cap} or more processes running; all were killed\n".encode())
            _kill_all(as_init)
            return 128 + signal.SIGKILL
        if status is None:
            time.sleep(POLL_S)
    _kill_all(as_init)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _forward(pid: int) -> int:
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            return SETUP_FAILED
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def main(argv: list[str]) -> int:
    """Run the command described by the JSON spec file ``argv[1]`` (read, then deleted); see the module docstring.

    A file, not an argument: the command line of a process is visible to every user, and its environment is in it.
    """
    with open(argv[1]) as handle:
        spec = json.load(handle)
    os.unlink(argv[1])
    _boost()
    try:
        if not spec["namespaces"]:
            confine(spec)
            return supervise(spec, as_init=False)
        enter_namespaces(spec)
    except (SetupError, OSError) as exc:
        os.write(2, f"sandbox: setup failed: {exc}\n".encode())
        return SETUP_FAILED
    init = os.fork()
    if init != 0:
        return _forward(init)
    try:  # PID 1 of the new namespace
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _check(_libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mounting /proc")
        confine(spec)
        code = supervise(spec, as_init=True)
    except (SetupError, OSError) as exc:
        os.write(2, f"sandbox: setup failed: {exc}\n".encode())
        code = SETUP_FAILED
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
