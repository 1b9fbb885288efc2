"""The machine a benchmark ran on, recorded with every result: CPU, cores, memory, read bandwidth, load.

The CPU model, its SIMD flags, core counts and memory come from ``runtime.hardware.describe`` (``/proc/cpuinfo``,
``/proc/meminfo``); the streaming-read bandwidth is measured here, in the run that records it (a ``torch`` sum
over a buffer far larger than the caches, best of several rounds, on one thread and on all usable cores: the
faster, since one thread often streams faster than all of them on a shared VM); the load average is read before
the row runs, so a result taken on a busy machine says so.
"""

from __future__ import annotations

import os
from typing import Any

from freetoken_agent.evals.perf.timing import repeat

READ_BYTES = 512 << 20
"""Bytes streamed per bandwidth round: far above the last-level cache of the CPUs we target."""


def read_gbps(threads: int, nbytes: int = READ_BYTES, rounds: int = 7) -> float:
    """Streaming-read GB/s on ``threads`` threads: ``sum`` over ``nbytes``, best of ``rounds`` (the limit)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4)
        best = repeat(buf.sum, rounds, warmup=1).low
    finally:
        torch.set_num_threads(old)
    return nbytes / best / 1e9


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def best_read_gbps(nbytes: int = READ_BYTES, rounds: int = 7) -> tuple[float, int]:
    """The machine's streaming-read limit and the thread count that reached it (1 or all usable cores)."""
    return max((read_gbps(t, nbytes, rounds), t) for t in sorted({1, usable_cores()}))


def bandwidth(nbytes: int = READ_BYTES) -> dict[str, Any]:
    """``read_gbps`` and ``read_threads`` of ``best_read_gbps``, as a record holds them."""
    gbps, threads = best_read_gbps(nbytes)
    return {"read_gbps": round(gbps, 2), "read_threads": threads}


def facts(bandwidth_bytes: int | None = READ_BYTES) -> dict[str, Any]:
    """What a result is recorded with. ``bandwidth_bytes=None`` skips the bandwidth measurement (a run that is not
    recorded, or a caller that measures it after the row); ``key`` names the machine in the generated tables."""
    from freetoken_agent.runtime.hardware import describe

    key, cpu, memory, _disk, gpus = describe()
    out: dict[str, Any] = {
        "key": key, "cpu": cpu["model"], "arch": cpu["arch"], "flags": cpu["simd"], "cores": cpu["cores"],
        "usable_cores": cpu["usable"], "memory_bytes": memory.get("total"),
        "load_avg": [round(v, 2) for v in os.getloadavg()],
        "gpus": [g.get("name") for g in gpus],
    }  # fmt: skip
    if bandwidth_bytes is not None:
        out.update(bandwidth(bandwidth_bytes))
    return out
