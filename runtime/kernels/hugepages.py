"""Weight memory in 2 MiB pages: a decode step streams every expert and dense weight it uses once, and with 4 KiB
pages each 4 KiB of a weight costs a TLB miss (a page walk the hardware prefetcher cannot run ahead of).

Measured on this machine (``freetoken bench kernels`` shapes, M = 1, weights cycled through 256 MiB): a Q4_0
768x2048 GEMV took 34.5 us from 2 MiB pages against 45.5 us from 4 KiB pages on one thread (32.5 / 35 us on two),
1536x4096 107 / 118 us on two threads. The expert cache file is mapped with 4 KiB pages (its filesystem cannot
map page-cache folios as 2 MiB pages for a private mapping: MADV_COLLAPSE returns EINVAL), so weights the kernels
stream are copied into anonymous memory marked ``MADV_HUGEPAGE`` (Linux's transparent huge pages in "madvise"
mode, the common default). Elsewhere, or when the kernel refuses, this is ordinary memory.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from typing import Any

import torch

HUGE = 2 << 20
MADV_HUGEPAGE = 14
_libc: list[ctypes.CDLL | None] = []


def _madvise(addr: int, length: int) -> bool:
    if not _libc:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            libc = None
        _libc.append(libc)
    return _libc[0] is not None and _libc[0].madvise(addr, length, MADV_HUGEPAGE) == 0


def describe() -> str:
    """One line for ``freetoken doctor``: whether weights go to 2 MiB pages here, and the kernel's THP mode."""
    if not enabled():
        return "off (FREETOKEN_HUGEPAGES=0)" if sys.platform.startswith("linux") else "not on this OS"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "asked for (MADV_HUGEPAGE); transparent huge pages unavailable: 4 KiB pages"
    if mode == "never":
        return "asked for, but transparent huge pages are off (mode never): 4 KiB pages"
    return f"yes: expert and dense weights marked MADV_HUGEPAGE (transparent huge pages: {mode})"


def enabled() -> bool:
    """Whether weights go to 2 MiB pages: Linux, and not turned off with ``FREETOKEN_HUGEPAGES=0``."""
    return sys.platform.startswith("linux") and os.environ.get("FREETOKEN_HUGEPAGES", "1") not in ("0", "off")


FIT_SHARE = 0.75  # of MemAvailable a copy into 2 MiB pages may take; beyond it weights stay where they are


def fits(nbytes: int) -> bool:
    """Whether a copy of ``nbytes`` leaves room (``FIT_SHARE`` of ``MemAvailable``). A file mapping's pages are
    clean and the kernel can drop them under pressure; an anonymous copy cannot be dropped (no swap here), so a model
    larger than RAM must keep its mapping rather than be killed for memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return nbytes <= FIT_SHARE * int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return False


def empty(nbytes: int) -> torch.Tensor:
    """An uninitialized ``uint8 [nbytes]`` tensor starting on a 2 MiB boundary of anonymous memory marked for
    transparent huge pages (ordinary ``torch.empty`` where that is unavailable). The mapping lives as long as any
    view of the tensor."""
    if nbytes <= 0 or not enabled():
        return torch.empty(max(0, nbytes), dtype=torch.uint8)
    try:
        m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return torch.empty(nbytes, dtype=torch.uint8)
    whole = torch.frombuffer(m, dtype=torch.uint8)  # holds a reference to the mmap
    start = (-whole.data_ptr()) % HUGE
    out = whole[start : start + nbytes]
    _madvise(out.data_ptr(), min((nbytes + HUGE - 1) // HUGE * HUGE, len(m) - start))  # whole 2 MiB pages, in the map
    return out


def arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors copied into one 2 MiB-page allocation (each 64-byte aligned), in order: many small weights
    share pages instead of each rounding up to 2 MiB."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += (n + 63) // 64 * 64
    buf = empty(total)
    out = []
    for t, off, n in zip(tensors, offsets, sizes):
        dst = buf[off : off + n]
        dst.copy_(t.contiguous().reshape(-1).view(torch.uint8))
        out.append(dst.view(t.dtype).view(t.shape))
    return out


BIG_WEIGHT = 1 << 20  # values from which a dense weight moves (norms, biases, small routers stay put)


def adopt_dense(weights: Any) -> int:
    """Move the big 2-D dense weights of loaded CPU ``ModelWeights`` (attention projections, dense and shared MLPs,
    routers, the lm_head — tied embeddings stay tied) into one 2 MiB-page arena; returns the bytes moved.
    Quantized weights (``QuantLinear``) and experts are handled where they are made."""
    if not enabled():
        return 0
    tables: list[dict[str, Any]] = []
    for lw in weights.layers:
        tables += [lw.attn, lw.mlp or {}]
        if lw.moe is not None:
            tables += [lw.moe.shared or {}, lw.moe.router]
    found: dict[int, torch.Tensor] = {}

    def big(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.dim() == 2 and t.device.type == "cpu" and t.numel() >= BIG_WEIGHT

    for table in tables:
        for t in table.values():
            if big(t):
                found.setdefault(id(t), t)
    if big(weights.lm_head):
        found.setdefault(id(weights.lm_head), weights.lm_head)
    total = sum(t.numel() * t.element_size() for t in found.values())
    if not found or not fits(total):  # the copy briefly doubles these weights
        return 0
    moved = dict(zip(found, arena(list(found.values()))))
    for table in tables:
        for name, t in list(table.items()):
            if isinstance(t, torch.Tensor) and id(t) in moved:
                table[name] = moved[id(t)]
    if id(weights.lm_head) in moved:
        if weights.embed is weights.lm_head:
            weights.embed = moved[id(weights.lm_head)]
        weights.lm_head = moved[id(weights.lm_head)]
    return total
