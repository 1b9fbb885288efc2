"""The llama.cpp peer of ``freetoken bench suite``: opening a GGUF, and holding its memory-mapped file to a budget.

``open_llama`` opens a GGUF with ``llama-cpp-python`` either as llama.cpp runs by default (``repack=True``: Q4_0
experts are repacked into anonymous memory for its AVX-512 kernels, so the whole model sits in RAM) or as
``llama-cli --no-repack`` does (``repack=False``: every weight is used in place from the ``mmap`` of the file, so
the OS page cache decides what is resident — the configuration a model larger than RAM needs).

``MappedBudget`` emulates a memory limit for that mapping. This process cannot create a memory cgroup of its own
(the only writable cgroup tree belongs to the sandbox's process manager), so between decode steps it measures the
file's resident pages (``mincore``) and, when they exceed the budget, evicts whole experts — the pages dropped from
the mapping (``madvise(MADV_PAGEOUT)``) and from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``) — picked at
random among the resident ones until the file fits. Random replacement is what LRU reduces to under the uniform
routing of random weights; a kernel under a cgroup limit would instead reclaim while the step runs, and its
eviction time would count, which here it does not: the emulation is, if anything, kind to llama.cpp.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

METHOD = ("emulated limit: after every decode step the GGUF's resident pages (mincore) are cut back to the budget "
          "by evicting random resident experts (madvise MADV_PAGEOUT + posix_fadvise DONTNEED); no memory cgroup "
          "could be created here; llama.cpp opened with --no-repack so experts are read from the mmap")  # fmt: skip

_MADV_PAGEOUT = 21  # reclaim the mapped pages now (Linux >= 5.4); MADV_DONTNEED would only unmap them
_MADV_NORMAL, _MADV_RANDOM, _MADV_DONTNEED = 0, 1, 4
_PAGE = mmap.PAGESIZE


@contextlib.contextmanager
def _extra_buffers(enabled: bool) -> Iterator[None]:
    """``llama-cpp-python`` has no argument for ``use_extra_bufts`` (``llama-cli --no-repack``): while this context
    is open, the model parameters it builds start from defaults with that field set."""
    import llama_cpp.llama_cpp as low

    original = low.llama_model_default_params

    def defaults() -> Any:
        params = original()
        params.use_extra_bufts = enabled
        return params

    low.llama_model_default_params = defaults
    try:
        yield
    finally:
        low.llama_model_default_params = original


def open_llama(gguf_path: Path, threads: int, n_ctx: int, n_batch: int = 512, repack: bool = True) -> Any:
    """A ``llama_cpp.Llama`` over ``gguf_path`` (mmap on; ``repack=False`` = ``--no-repack``), quiet."""
    import llama_cpp

    with _extra_buffers(repack):
        return llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                               n_threads=threads, n_threads_batch=threads, use_mmap=True, verbose=False)


def _mapping(path: Path) -> tuple[int, int, int]:
    """(start address, file offset, length) of this process's largest mapping of ``path``."""
    best = (0, 0, 0)
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == str(path):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if hi - lo > best[2]:
                best = (lo, int(parts[2], 16), hi - lo)
    if not best[2]:
        raise RuntimeError(f"{path} is not memory-mapped by this process (was the model opened with mmap?)")
    return best


def expert_ranges(gguf_path: Path) -> list[tuple[int, int]]:
    """(file offset, bytes) of every expert's slice of every ``*_exps`` tensor, page-aligned outward."""
    import gguf

    out = []
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        if "_exps" not in t.name:
            continue
        experts = int(t.shape[-1])  # GGUF lists dimensions innermost first: [row bytes.., rows, experts]
        each = int(t.n_bytes) // experts
        for e in range(experts):
            lo = (int(t.data_offset) + e * each) // _PAGE * _PAGE
            hi = -(-(int(t.data_offset) + (e + 1) * each) // _PAGE) * _PAGE
            out.append((lo, hi - lo))
    return out


def supported() -> str | None:
    """None when ``MappedBudget`` can run here, else why not (it needs Linux: /proc/self/maps, mincore, madvise)."""
    if not sys.platform.startswith("linux"):
        return f"the emulated memory limit needs Linux (/proc, mincore, madvise); this is {sys.platform}"
    return None


class MappedBudget:
    """Holds the resident pages of a memory-mapped GGUF to ``budget`` bytes by evicting random resident experts.

    Call ``enforce()`` between decode steps; ``peak`` is the most the file held before an eviction, ``evicted``
    the bytes dropped so far. ``drop_all()`` empties the file from memory (a cold start).
    """

    def __init__(self, gguf_path: Path, budget: int, seed: int = 0) -> None:
        self.path, self.budget = Path(gguf_path), budget
        self.addr, self.offset, self.length = _mapping(self.path)
        # expert ranges relative to the mapping, clipped to it
        self.experts = [(o - self.offset, n) for o, n in expert_ranges(self.path) if o >= self.offset]
        self.peak = self.evicted = 0
        self._rng = random.Random(seed)
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._pages = (self.length + _PAGE - 1) // _PAGE
        self._vec = (ctypes.c_ubyte * self._pages)()
        self._fd = os.open(self.path, os.O_RDONLY)
        os.fsync(self._fd)  # a freshly written file's dirty pages cannot be evicted until they are on disk

    def _resident_pages(self) -> np.ndarray:
        if self._libc.mincore(ctypes.c_void_p(self.addr), ctypes.c_size_t(self.length), self._vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed on the GGUF mapping")
        return np.frombuffer(self._vec, dtype=np.uint8) & 1

    def resident(self) -> int:
        """Bytes of the file in memory now."""
        return int(self._resident_pages().sum()) * _PAGE

    def _evict(self, offset: int, nbytes: int) -> None:
        """Drop ``nbytes`` at ``offset`` (relative to the mapping) from the mapping and from the page cache."""
        nbytes = min(nbytes, self.length - offset)
        addr, size = ctypes.c_void_p(self.addr + offset), ctypes.c_size_t(nbytes)
        if self._libc.madvise(addr, size, _MADV_PAGEOUT) != 0:  # kernels before 5.4: unmap, then drop below
            self._libc.madvise(addr, size, _MADV_DONTNEED)
        os.posix_fadvise(self._fd, self.offset + offset, nbytes, os.POSIX_FADV_DONTNEED)

    def access(self, random_access: bool) -> None:
        """``MADV_RANDOM`` on the mapping (no read-around on a fault: only the touched pages are read) or back to
        ``MADV_NORMAL`` (the kernel reads around each fault, up to the device's ``read_ahead_kb``)."""
        advice = _MADV_RANDOM if random_access else _MADV_NORMAL
        if self._libc.madvise(ctypes.c_void_p(self.addr), ctypes.c_size_t(self.length), advice) != 0:
            raise OSError(ctypes.get_errno(), "madvise failed on the GGUF mapping")

    def drop_all(self) -> None:
        self._evict(0, self.length)

    def enforce(self) -> int:
        """Evict random resident experts until the file fits the budget; returns the bytes evicted now."""
        pages = self._resident_pages().copy()
        held = int(pages.sum()) * _PAGE
        self.peak = max(self.peak, held)
        if held <= self.budget:
            return 0
        order = list(range(len(self.experts)))
        self._rng.shuffle(order)
        freed = 0
        for i in order:
            if held - freed <= self.budget:
                break
            offset, nbytes = self.experts[i]
            span = pages[offset // _PAGE : (offset + nbytes) // _PAGE]  # neighbours may share an edge page
            if span.any():
                self._evict(offset, nbytes)
                freed += int(span.sum()) * _PAGE
                span[:] = 0
        self.evicted += freed
        return freed

    def close(self) -> None:
        os.close(self._fd)
