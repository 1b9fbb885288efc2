"""Which sandbox mechanisms this machine has: Landlock (and its ABI), unprivileged namespaces, bubblewrap.

Each answer comes from trying the real thing once per process (``landlock_create_ruleset`` for the ABI, the
launcher itself for namespaces). ``FREETOKEN_SANDBOX_DISABLE`` (comma-separated: ``landlock``, ``namespaces``)
makes the probe report a mechanism as missing, to see how the agent behaves on a machine without it.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

DISABLE_ENV = "FREETOKEN_SANDBOX_DISABLE"
LAUNCHER = Path(__file__).with_name("launcher.py")
PROBE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Mechanisms:
    """What the kernel and the system offer for confining commands."""

    landlock_abi: int
    """Landlock ABI version (0: none). >= 1 confines the file system; >= 4 also TCP; >= 6 signals."""
    namespaces: bool
    """Unprivileged user + mount + PID + network namespaces work (network off, nothing outlives a call)."""
    bubblewrap: str | None
    """Path of ``bwrap`` when installed (reported; the launcher does not need it)."""
    notes: tuple[str, ...] = ()
    """Why a mechanism is missing, one line each."""

    def can_sandbox(self, network: bool) -> bool:
        """Whether a sandboxed mode can be enforced: Landlock for files, and a way to cut the network if asked."""
        return self.landlock_abi >= 1 and (network or self.namespaces or self.landlock_abi >= 4)

    def rows(self) -> list[tuple[str, str]]:
        """(mechanism, status) rows for ``freetoken doctor``."""
        abi = self.landlock_abi
        parts = ["files"] + (["TCP"] if abi >= 4 else []) + (["signals, abstract sockets"] if abi >= 6 else [])
        rows = [
            ("sandbox: landlock", f"ABI {abi} ({', '.join(parts)})" if abi else "not available"),
            ("sandbox: namespaces", "user, mount, pid, network: available" if self.namespaces else "not available"),
            ("sandbox: bubblewrap", self.bubblewrap or "not installed (not needed)"),
        ]
        if self.can_sandbox(network=False):
            verdict = "read-only and workspace-write enforced (network off, .git read-only)"
        else:
            verdict = "NONE: commands are refused unless the sandbox mode is full-access"
        rows.append(("sandbox: modes", verdict))
        rows += [("sandbox: note", note) for note in self.notes]
        return rows


def disabled() -> frozenset[str]:
    """The mechanisms ``FREETOKEN_SANDBOX_DISABLE`` asks to treat as missing."""
    return frozenset(part.strip() for part in os.environ.get(DISABLE_ENV, "").split(",") if part.strip())


def probe() -> Mechanisms:
    """The mechanisms of this machine (cached per process and per ``FREETOKEN_SANDBOX_DISABLE`` value)."""
    return _probe(disabled())


@functools.lru_cache(maxsize=8)
def _probe(off: frozenset[str]) -> Mechanisms:
    from freetoken_agent.tools.sandbox import landlock

    notes: list[str] = []
    abi = 0
    if "landlock" in off:
        notes.append(f"landlock disabled by {DISABLE_ENV}")
    elif platform.system() != "Linux":
        notes.append("landlock needs Linux")
    else:
        abi = landlock.abi_version()
        if not abi:
            notes.append("landlock: the kernel has none (Linux >= 5.13 with 'landlock' in the lsm= boot list)")
    namespaces = False
    if "namespaces" in off:
        notes.append(f"namespaces disabled by {DISABLE_ENV}")
    elif platform.system() == "Linux":
        namespaces, why = _try_namespaces()
        if not namespaces:
            notes.append(f"namespaces: {why}")
    return Mechanisms(abi, namespaces, shutil.which("bwrap"), tuple(notes))


def _try_namespaces() -> tuple[bool, str]:
    spec = {"argv": ["/bin/true"], "cwd": "/", "env": {}, "read": [], "write": [], "read_only": [], "hidden": [],
            "network": False, "namespaces": True, "landlock": False, "block_tcp": False, "limits": {},
            "shm_bytes": 1 << 20}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
    try:
        done = subprocess.run([sys.executable, "-I", str(LAUNCHER), handle.name], capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"the probe failed ({exc})"
    finally:
        if os.path.exists(handle.name):
            os.unlink(handle.name)
    if done.returncode == 0:
        return True, ""
    return False, (done.stderr.strip().splitlines() or ["unknown error"])[-1]
