"""Microbenchmarks behind the hardware profile (each takes about a second; run by ``freetoken doctor``).

Legend: D hidden, I expert intermediate size, M tokens per call.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch


def _timed(fn, seconds: float, min_reps: int = 3) -> float:  # type: ignore[no-untyped-def]
    """Best (lowest) seconds per call of ``fn`` over about ``seconds`` of wall time."""
    best = float("inf")
    end = time.perf_counter() + seconds
    reps = 0
    while reps < min_reps or time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return best


def memcpy_gbps(seconds: float = 1.0, nbytes: int = 128 << 20) -> float:
    """Host memory copy rate (bytes read + written count once: the copied size per second)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return round(nbytes / _timed(lambda: dst.copy_(src), seconds) / 1e9, 2)


def cpu_expert_gbps(shape: tuple[int, int], seconds: float = 1.0, working_set: int = 256 << 20) -> tuple[float, float, str]:
    """Weight GB/s of one expert's gate|up projection at M=1 and M=16, cycling over experts (no cache reuse).

    Uses the Q4_0 C kernels when they build (what decode runs), else fp32 ``torch`` (returns which in the 3rd item).
    """
    d, i = shape
    torch.manual_seed(0)
    try:
        from freetoken_agent.runtime.kernels import build, ops
        from freetoken_agent.runtime.quant.blocks import quantize

        if build.load() is None:
            raise RuntimeError("kernels unavailable")
        proto = ops.PackedWeight.from_blocks(quantize(torch.randn(2 * i, d), "q4"))
        n = max(2, working_set // proto.nbytes)
        ws = [ops.PackedWeight(proto.fmt, proto.n, proto.k, proto.data.clone()) for _ in range(n)]
        nbytes, kind = proto.nbytes, "q4_0 C kernel"
        run = lambda w, x: ops.linear(w, x)
    except (ImportError, RuntimeError, OSError):
        w0 = torch.randn(2 * i, d)
        n = max(2, working_set // (w0.numel() * 4))
        ws = [w0.clone() for _ in range(n)]
        nbytes, kind = w0.numel() * 4, "fp32 torch"
        run = lambda w, x: torch.nn.functional.linear(x, w)
    out = []
    for m in (1, 16):
        x = torch.randn(m, d)
        k = [0]

        def step(x: torch.Tensor = x, k: list[int] = k) -> None:
            for _ in range(8):
                run(ws[k[0] % n], x)
                k[0] += 1

        out.append(round(8 * nbytes / _timed(step, seconds / 2) / 1e9, 2))
    return out[0], out[1], kind


def disk_read_gbps(folder: Path, nbytes: int = 128 << 20) -> float | None:
    """Sequential read rate of a fresh file in ``folder`` with its pages dropped first (plain ``pread``)."""
    path = folder / f".ft-disk-probe-{os.getpid()}"
    try:
        block = os.urandom(1 << 20)
        with path.open("wb") as fh:
            for _ in range(nbytes >> 20):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            buf = bytearray(8 << 20)
            view = memoryview(buf)
            t0 = time.perf_counter()
            off = 0
            while off < nbytes:
                off += os.preadv(fd, [view], off)
            dt = time.perf_counter() - t0
        finally:
            os.close(fd)
        return round(nbytes / dt / 1e9, 2)
    except OSError:
        return None
    finally:
        path.unlink(missing_ok=True)


def gpu_rates(shape: tuple[int, int], nbytes: int = 256 << 20) -> dict[str, float | None]:
    """Host→device GB/s (pinned, pageable) and the device time of one fp16 expert at M=1 (CUDA only)."""
    if not torch.cuda.is_available():
        return {}
    dev = torch.device("cuda")
    out: dict[str, float | None] = {}
    for name, pin in (("h2d_pinned_gbps", True), ("h2d_pageable_gbps", False)):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)

        def copy(dst: torch.Tensor = dst, src: torch.Tensor = src, pin: bool = pin) -> None:
            dst.copy_(src, non_blocking=pin)
            torch.cuda.synchronize()

        out[name] = round(nbytes / _timed(copy, 0.5) / 1e9, 2)
    d, i = shape
    gu = torch.randn(2 * i, d, device=dev, dtype=torch.float16)
    dn = torch.randn(d, i, device=dev, dtype=torch.float16)
    x = torch.randn(1, d, device=dev, dtype=torch.float16)

    def expert() -> None:
        h = x @ gu.T
        (torch.nn.functional.silu(h[:, :i]) * h[:, i:]) @ dn.T
        torch.cuda.synchronize()

    out["device_expert_s"] = _timed(expert, 0.5)
    return out
