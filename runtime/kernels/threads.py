"""How many threads the CPU expert kernels use: the cores that are free now, unless the user says.

Oversubscription is the worst case on small machines (measured: a 2-thread call stalls for a scheduler slice,
6-8 ms instead of 0.1 ms, while another process holds a core), so the default counts only idle cores.
"""

from __future__ import annotations

import os

ENV = "FREETOKEN_CPU_THREADS"


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def runnable_others() -> int:
    """Runnable tasks other than this one right now (from /proc/loadavg), 0 where unknown."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, running - 1)


def default_threads() -> int:
    """``$FREETOKEN_CPU_THREADS`` if set, else the usable CPUs not busy with other runnable tasks (at least 1)."""
    env = os.environ.get(ENV)
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            pass
    cpus = usable_cpus()
    return max(1, min(cpus, cpus - runnable_others()))
