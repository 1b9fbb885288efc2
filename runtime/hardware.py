"""Hardware probe: what this machine has, and how fast it moves and computes experts. Cached per machine.

``probe()`` reads devices and memory (``/proc``, ``os``, nvidia-ml-py where a GPU exists) and runs microbenchmarks
that take seconds: host memcpy GB/s, the CPU expert kernel's GB/s at M=1 and M=16 (Q4_0 C kernels when they build,
fp32 ``torch`` otherwise) cycling over more experts than the caches hold, disk read GB/s of a file like the
expert cache (pages dropped first), and with a GPU host→device GB/s (pinned and pageable) and the device time of
one expert. ``load_or_probe()`` returns the cached profile of this machine (``$FREETOKEN_CACHE/hardware.json``,
default ``~/.cache/freetoken/hardware.json``) or probes and caches it. Nothing runs at import.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from freetoken_agent.runtime.execution.cost import Rates

EXPERT_SHAPE = (2048, 768)
"""(D, I) of the benchmark expert: a Qwen3-30B-A3B expert (gate|up [1536, 2048], down [2048, 768])."""


def cache_path() -> Path:
    root = os.environ.get("FREETOKEN_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "freetoken") / "hardware.json"


@dataclass
class HardwareProfile:
    """One machine: devices, memory, and measured rates (None where not measured)."""

    fingerprint: str
    cpu: dict[str, Any]
    memory: dict[str, int]
    disk: dict[str, Any]
    gpus: list[dict[str, Any]] = field(default_factory=list)
    bench: dict[str, float | None] = field(default_factory=dict)
    probed_at: str = ""

    def rates(self) -> Rates:
        """The planner's cost-model rates from these measurements (defaults where missing)."""
        b, r = self.bench, Rates()
        return Rates(
            copy_gbps=b.get("h2d_pinned_gbps") or r.copy_gbps,
            host_gbps_m1=b.get("cpu_expert_gbps_m1") or r.host_gbps_m1,
            host_gbps_m16=b.get("cpu_expert_gbps_m16") or r.host_gbps_m16,
            disk_gbps=b.get("disk_read_gbps") or r.disk_gbps,
            device_s_fixed=b.get("device_expert_s") or r.device_s_fixed,
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, value = line.split(":", 1)
            if name in ("MemTotal", "MemAvailable"):
                out["total" if name == "MemTotal" else "available"] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    if "total" not in out and hasattr(os, "sysconf"):
        out["total"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return out


def _cpu() -> dict[str, Any]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                model = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and ":" in line:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "asimd",
                        "asimddp", "sve") if f in flags]
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return {"model": model, "arch": platform.machine(), "cores": os.cpu_count() or 1, "usable": usable, "simd": simd}


def _gpus() -> list[dict[str, Any]]:
    try:
        import torch

        if not torch.cuda.is_available():
            return []
    except ImportError:
        return []
    out = []
    try:
        import pynvml

        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            out.append({"index": i, "name": name if isinstance(name, str) else name.decode(),
                        "total": int(mem.total), "free": int(mem.free)})
        pynvml.nvmlShutdown()
    except Exception:  # nvml missing or unusable: fall back to torch's view  # noqa: BLE001
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            out.append({"index": i, "name": torch.cuda.get_device_name(i), "total": int(total), "free": int(free)})
    return out


def fingerprint(cpu: dict[str, Any], memory: dict[str, int], gpus: list[dict[str, Any]]) -> str:
    return "|".join([cpu["model"], str(cpu["cores"]), str(memory.get("total", 0) >> 30)] + [g["name"] for g in gpus])


def describe() -> tuple[str, dict[str, Any], dict[str, int], dict[str, Any], list[dict[str, Any]]]:
    """(fingerprint, cpu, memory, disk, gpus) without running any benchmark."""
    cpu, memory, gpus = _cpu(), _meminfo(), _gpus()
    root = cache_path().parent
    root.mkdir(parents=True, exist_ok=True)
    usage = shutil.disk_usage(root)
    disk = {"path": str(root), "free": usage.free, "total": usage.total}
    return fingerprint(cpu, memory, gpus), cpu, memory, disk, gpus


def probe(seconds: float = 1.0) -> HardwareProfile:
    """Describe the machine and run the microbenchmarks (roughly ``seconds`` each)."""
    from freetoken_agent.runtime.execution import microbench as bench_micro

    fp, cpu, memory, disk, gpus = describe()
    bench: dict[str, float | None] = {}
    bench["memcpy_gbps"] = bench_micro.memcpy_gbps(seconds)
    m1, m16, kind = bench_micro.cpu_expert_gbps(EXPERT_SHAPE, seconds)
    bench["cpu_expert_gbps_m1"], bench["cpu_expert_gbps_m16"] = m1, m16
    disk["expert_kernel"] = kind
    bench["disk_read_gbps"] = bench_micro.disk_read_gbps(Path(disk["path"]))
    if gpus:
        bench.update(bench_micro.gpu_rates(EXPERT_SHAPE))
    return HardwareProfile(fp, cpu, memory, disk, gpus, bench, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def cached_profile() -> HardwareProfile | None:
    """This machine's cached profile, or None (missing, unreadable, or from another machine)."""
    path = cache_path()
    try:
        data = json.loads(path.read_text())
        profile = HardwareProfile(**data)
    except (OSError, ValueError, TypeError):
        return None
    cpu, memory = _cpu(), _meminfo()
    if profile.fingerprint.split("|")[:3] != fingerprint(cpu, memory, []).split("|")[:3]:
        return None
    return profile


def load_or_probe(refresh: bool = False, seconds: float = 1.0) -> HardwareProfile:
    """The cached profile of this machine, probing (and caching) when there is none or ``refresh``."""
    if not refresh:
        cached = cached_profile()
        if cached is not None:
            return cached
    profile = probe(seconds)
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump(profile.to_json(), fh, indent=2)
    os.replace(tmp, path)
    return profile
