"""How many CPU threads torch may use.

Oversubscribed OpenMP pools stall every parallel op by a scheduler slice (measured on our 2-core machine: decode
12× slower with 2 threads while other processes kept both cores busy). So the default is the number of cores that
look free now, and users can pin it (``threads=`` or ``FREETOKEN_THREADS``).
"""

from __future__ import annotations

import os

import torch

from freetoken_agent.runtime.errors import OptionError
from freetoken_agent.runtime.rules import Int


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def free_cores() -> int:
    """Cores not already kept busy by other runnable work (1-minute load average), at least 1."""
    cores = available_cores()
    try:
        busy = int(os.getloadavg()[0])
    except OSError:
        busy = 0
    return max(1, min(cores, cores - busy))


def configure_threads(requested: int | None = None) -> int:
    """Set torch's intra-op thread count: ``requested``, else ``$FREETOKEN_THREADS``, else the free cores.

    A count that is not an integer ≥ 1 (``threads=0``, ``FREETOKEN_THREADS=-2``) is an ``OptionError``, not
    silently the default.
    """
    env = os.environ.get("FREETOKEN_THREADS", "").strip()
    if requested is None and env:
        try:
            requested = Int(1).parse(env)
        except ValueError as exc:
            raise OptionError(f"FREETOKEN_THREADS {exc}") from None
    elif requested is not None and (msg := Int(1).problem(requested)) is not None:
        raise OptionError(f"threads {msg}")
    threads = requested if requested is not None else free_cores()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
