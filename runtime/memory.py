"""One hard memory budget per tier (``device``, ``host``), shared by dense weights, the KV pool and expert slots.

A ``MemoryBudget`` is the ledger of one tier: named ``Reservation`` objects draw bytes from it, and the sum of what
they hold can never exceed the limit (``reserve``/``grow`` raise ``BudgetExceededError`` instead). Order of
claims (see DESIGN §4.5): dense weights first, then the KV pool and the expert-slot pool. The boundary between the
two pools moves at run time with ``MemoryBudget.move(src, dst, nbytes)``: the source's ``on_shrink`` callback must
free the bytes first (the expert pool evicts slots), so the limit holds at every instant.

``Budget`` bundles the two tiers; it is built from user flags (``--device-memory 8GB --host-memory 16GB``) via
``Budget.from_strings`` or from the hardware probe. ``None`` limits mean "unlimited" (still accounted).

What the host budget does not cover is the process itself: the interpreter, torch, the runtime's modules and C
kernels, a tokenizer. (A step's working memory — activations, attention score blocks, the kernels' scratch, logits —
is in the budget: the ``step`` reservation, ``runtime.model.workspace.step_bytes``.) ``PROCESS_FLOOR_MB`` is that
floor as measured (``evals/perf/load_memory.py``: peak resident memory of a process that imported all of it and loaded a
tokenizer); a whole budgeted process — first load, later loads, prefill and decode — fits in the host budget plus
it (``tests/runtime/test_memory_cap.py`` runs one under a hard cap of exactly that plus a stated margin). A budget
below what a model needs to run at all (``runtime.experts.setup.minimum_memory``) is refused before anything is
loaded (``BudgetTooSmallError``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from freetoken_agent.runtime.errors import FreeTokenError

if TYPE_CHECKING:
    import torch

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


PROCESS_FLOOR_MB = 260
"""Host memory a budgeted process takes beyond its budget: measured 230-250 MiB peak RSS with Python 3.11, torch
2.13 (CPU), the runtime and its C kernels and a tokenizer loaded (``python -m freetoken_agent.evals.perf.load_memory``
prints it as ``floor``). A step's working memory is not part of it: the budget sets it aside (measured ~40 MiB for a
512-token prefill chunk of a hidden-2048 model with 16/4 heads of 128 and 64 experts, bounded at 63-90 MiB)."""


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
HEAP_RETURN_BYTES = 256 * 2**10
"""Blocks this big or bigger come from the OS and go back to it when freed, once ``bound_heap`` ran."""


def bound_heap() -> bool:
    """Make freed memory go back to the OS: blocks of ``HEAP_RETURN_BYTES`` or more are mapped and unmapped one by
    one (a fixed ``M_MMAP_THRESHOLD``), and the heap's free memory is given back now (``malloc_trim``).

    glibc raises its threshold after every large free (up to 32 MiB), so the float tensors a load makes and drops —
    one layer's dense weights before they are quantized, one expert on its way to the cache file — land in the heap
    afterwards and stay there, fragmented between the buffers that live on: measured, a warm budgeted load held 83 MiB
    of anonymous memory beyond its 80 MB budget, and a second load in the same process stacked on the first's. With
    the threshold fixed, 1 MiB more. Process-wide and one-way (a budgeted load calls it); a few microseconds more per
    large allocation. Returns False where the C library is not glibc (nothing is changed there).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, HEAP_RETURN_BYTES))
    trim(0)
    return ok


_MADV_DONTNEED = 4  # Linux madvise advice


def release_pages(t: torch.Tensor) -> bool:
    """Give the whole pages of a contiguous CPU tensor's bytes back to the OS now: its resident memory drops and
    the bytes read as zeros until written again (``madvise(MADV_DONTNEED)``; the partial pages at either end are
    kept). For memory the tensor keeps but a ledger no longer pays for (a slot pool shrunk in place); not for pinned
    (page-locked) memory. Returns False where it cannot (not Linux, not a contiguous CPU tensor): nothing is released
    then."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu" or not t.is_contiguous():
        return False
    page = mmap.PAGESIZE
    start = t.data_ptr()
    lo, hi = -(-start // page) * page, (start + t.numel() * t.element_size()) // page * page
    if hi <= lo:
        return True
    try:
        madvise = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise(lo, hi - lo, _MADV_DONTNEED) == 0


class BudgetExceededError(FreeTokenError):
    """A claim would take a tier past its limit (a bug in the caller's sizing, or a budget too small)."""


class BudgetTooSmallError(BudgetExceededError):
    """The budget is below what the model needs to run at all (dense weights, one MoE step's expert slots, the KV
    reserve): raised before loading, with the size that would do."""


def parse_bytes(text: str | int) -> int:
    """``"64MB"`` / ``"8GB"`` / ``"1.5GiB"`` / ``"4096"`` → bytes (decimal units; ``KiB/MiB/GiB`` binary)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise FreeTokenError(f"cannot read memory size {text!r}; write e.g. 64MB, 8GB or 1.5GiB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise FreeTokenError(f"memory size must be positive, got {text!r}")
    return int(value)


def format_bytes(n: float | None) -> str:
    """Human-readable bytes (binary units), ``unlimited`` for None."""
    if n is None:
        return "unlimited"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class Reservation:
    """Bytes one owner holds in a tier. ``grow``/``shrink`` change it; the tier's limit is checked on growth."""

    def __init__(self, budget: MemoryBudget, name: str, on_shrink: Callable[[int], int] | None = None) -> None:
        self.budget, self.name, self.nbytes = budget, name, 0
        self.on_shrink = on_shrink
        """``(nbytes) -> freed``: asked by ``MemoryBudget.move`` to free memory and shrink this reservation."""

    def grow(self, nbytes: int) -> None:
        self.budget._claim(self, nbytes)

    def shrink(self, nbytes: int) -> None:
        self.budget._claim(self, -min(nbytes, self.nbytes))

    def __repr__(self) -> str:
        return f"Reservation({self.budget.tier}/{self.name}: {format_bytes(self.nbytes)})"


class MemoryBudget:
    """The ledger of one memory tier: a hard ``limit`` (or None), named reservations, current and peak use."""

    def __init__(self, tier: str, limit: int | None) -> None:
        self.tier, self.limit = tier, limit
        self.reservations: dict[str, Reservation] = {}
        self.used = 0
        self.peak = 0
        self.moves: list[tuple[str, str, int]] = []
        """Every boundary move ``(src, dst, bytes)``, in order (shown in stats)."""
        self._lock = threading.Lock()

    @property
    def free(self) -> int | None:
        return None if self.limit is None else self.limit - self.used

    def reserve(self, name: str, nbytes: int = 0, on_shrink: Callable[[int], int] | None = None) -> Reservation:
        """A new named reservation holding ``nbytes`` (raises ``BudgetExceededError`` when they do not fit)."""
        if name in self.reservations:
            raise ValueError(f"{self.tier} budget already has a reservation named {name!r}")
        r = Reservation(self, name, on_shrink)
        self._claim(r, nbytes)
        self.reservations[name] = r
        return r

    def release(self, name: str) -> None:
        r = self.reservations.pop(name, None)
        if r is not None:
            self._claim(r, -r.nbytes)

    def _claim(self, r: Reservation, delta: int) -> None:
        with self._lock:
            if delta > 0 and self.limit is not None and self.used + delta > self.limit:
                raise BudgetExceededError(
                    f"{self.tier} memory budget {format_bytes(self.limit)} exceeded: {r.name} asks "
                    f"{format_bytes(delta)} more with {format_bytes(self.used)} in use"
                )
            r.nbytes += delta
            self.used += delta
            self.peak = max(self.peak, self.used)

    def move(self, src: str, dst: str, nbytes: int) -> int:
        """Move up to ``nbytes`` from reservation ``src`` to ``dst`` (the KV ↔ expert-slot boundary).

        ``src.on_shrink(nbytes)``, when set, frees what it can and shrinks ``src`` itself (returns the bytes freed);
        only those move. Returns them.
        """
        s, d = self.reservations[src], self.reservations[dst]
        if s.on_shrink is not None:  # the owner frees memory and shrinks its own reservation
            freed = s.on_shrink(nbytes)
        else:
            freed = min(nbytes, s.nbytes)
            s.shrink(freed)
        d.grow(freed)
        self.moves.append((src, dst, freed))
        return freed

    def snapshot(self) -> dict[str, object]:
        return {
            "limit": self.limit, "used": self.used, "peak": self.peak,
            "reservations": {n: r.nbytes for n, r in self.reservations.items()},
            "moves": [list(m) for m in self.moves[-8:]],
        }


@dataclass
class Budget:
    """Memory limits per tier in bytes (None = unlimited). ``device`` is unused on a CPU-only machine."""

    device: int | None = None
    host: int | None = None

    @classmethod
    def from_strings(cls, device: str | None = None, host: str | None = None) -> Budget:
        """From CLI flags such as ``--device-memory 8GB --host-memory 16GB`` (missing flags: unlimited)."""
        return cls(parse_bytes(device) if device else None, parse_bytes(host) if host else None)

    @property
    def limited(self) -> bool:
        return self.device is not None or self.host is not None

    def ledgers(self) -> dict[str, MemoryBudget]:
        """Fresh ledgers for both tiers (one per engine)."""
        return {"device": MemoryBudget("device", self.device), "host": MemoryBudget("host", self.host)}
