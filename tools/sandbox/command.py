"""Turn a command and a :class:`SandboxPolicy` into the argv that runs it confined (through the launcher)."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from freetoken_agent.tools.sandbox.policy import SandboxMode, SandboxPolicy, SandboxUnavailable
from freetoken_agent.tools.sandbox.probe import LAUNCHER, Mechanisms, probe

DEVICES_WRITABLE = ("/dev/null", "/dev/zero", "/dev/full", "/dev/tty")
SHM_BYTES = 1 << 30  # the private /dev/shm's size


@dataclass(frozen=True)
class Confined:
    """A command ready to start: ``argv`` and ``env`` for the process, and the mechanisms used (for the result)."""

    argv: list[str]
    env: dict[str, str]
    mechanisms: tuple[str, ...]


def refusal(policy: SandboxPolicy, found: Mechanisms) -> str:
    """Why ``policy`` cannot be enforced on this machine, as a message for the model and the user."""
    missing = "; ".join(found.notes) or "no Landlock and no namespaces"
    return (f"This machine has no OS sandbox for mode '{policy.mode.value}' ({missing}), so the command was not run. "
            "To run commands without a sandbox the user must choose the sandbox mode 'full-access' explicitly.")


def _workspace_grants(root: Path, read_only: list[str], namespaces: bool) -> list[str]:
    """Landlock grants are unions, so a read-only ``.git`` inside a writable root needs a read-only bind mount
    (namespaces). Without them, grant each top-level entry but the read-only ones (new top-level files are then
    refused too: safe, if less convenient)."""
    if namespaces or not any(Path(path).parent == root for path in read_only):
        return [str(root)]
    try:
        entries = sorted(entry.path for entry in os.scandir(root))
    except OSError:
        return []
    return [path for path in entries if path not in read_only]


def _hidden(policy: SandboxPolicy, root: Path) -> list[str]:
    """The policy's hidden paths, resolved; never one that holds the workspace or lies inside it."""
    found = []
    for item in policy.hidden:
        path = Path(os.path.realpath(os.path.expanduser(item)))
        if os.path.lexists(path) and not (root.is_relative_to(path) or path.is_relative_to(root)):
            found.append(str(path))
    return found


@contextmanager
def confined(argv: list[str], policy: SandboxPolicy, root: Path, extra_env: dict[str, str],
             timeout_s: float) -> Iterator[Confined]:
    """The confined form of ``argv`` for the duration of the ``with`` block (a private temp folder lives as long).

    Raises :class:`SandboxUnavailable` when the policy is sandboxed and this machine cannot enforce it.
    """
    env = policy.environment(extra_env)
    if not policy.sandboxed:
        yield Confined(list(argv), env, ())
        return
    found = probe()
    if not found.can_sandbox(policy.network):
        raise SandboxUnavailable(refusal(policy, found))
    private_tmp = tempfile.mkdtemp(prefix="freetoken-sandbox-")
    try:
        env.update({"TMPDIR": private_tmp, "TMP": private_tmp, "TEMP": private_tmp})
        write = [private_tmp, *DEVICES_WRITABLE] + (["/dev/shm"] if found.namespaces else [])
        read_only = [str(root / path) for path in policy.read_only]
        if policy.mode is SandboxMode.WORKSPACE_WRITE:
            write += [*_workspace_grants(root, read_only, found.namespaces), *policy.writable]
        limits = policy.limits.as_dict()
        hidden = _hidden(policy, root) if found.namespaces else []  # mounts need a mount namespace
        if limits["cpu_s"] is None:
            limits["cpu_s"] = math.ceil((timeout_s + 60) * (os.cpu_count() or 1))
        spec = {
            "argv": list(argv), "cwd": str(root), "env": env, "read": ["/"], "write": write,
            "read_only": read_only if found.namespaces else [], "hidden": hidden, "network": policy.network,
            "namespaces": found.namespaces, "landlock": True,
            # with a network namespace the loopback is private, so local servers may keep working inside it
            "block_tcp": not policy.network and not found.namespaces, "limits": limits, "shm_bytes": SHM_BYTES,
        }
        spec_path = os.path.join(private_tmp, "sandbox-spec.json")  # the launcher reads it and deletes it
        with open(os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
            json.dump(spec, handle)
        used = [f"landlock ABI {found.landlock_abi}", "no-new-privs", "rlimits"]
        used += ["namespaces (user, mount, pid" + ("" if policy.network else ", network") + ")"] if found.namespaces \
            else ["child subreaper"]
        yield Confined([sys.executable, "-I", str(LAUNCHER), spec_path], env, tuple(used))
    finally:
        shutil.rmtree(private_tmp, ignore_errors=True)
