"""A preallocated pool of fixed-size KV pages for one memory tier.

A page holds ``page_size`` consecutive positions for every layer. Per layer, the pool keeps one tensor per cached
part (GQA: keys [P, page, Hkv, Dh] and values [P, page, Hkv, Dv]; MLA: latent [P, page, rank] and rotary key
[P, page, R]). Part shapes are learned from the first write, so any mixer that caches per-position tensors works.
Control is integers only: page ids, reference counts, a free list.

``kv_dtype`` (fp16 / bf16 / fp8, or None: as written) is the storage type of every floating part: a 16-bit pool
holds twice the positions of an fp32 one in the same bytes, an fp8 (float8 e4m3fn) pool four times, and attention
reads it as is (``runtime/kernels/ops.py``). fp16 writes saturate at ±65504 (an overflowing key becomes the largest
half, not inf), fp8 writes at ±448 (e4m3fn has no infinity: a cast past 464 gives NaN). Page copies (copy-on-write,
runs, host offload) move the stored bits unchanged.

Legend: P pages in the pool, S positions of a sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from freetoken_agent.runtime.errors import FreeTokenError, OptionError
from freetoken_agent.runtime.kernels import hugepages
from freetoken_agent.runtime.memory import release_pages

KV_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
             "fp8": torch.float8_e4m3fn}
"""``kv_dtype`` option values → the pool's storage type (None: the model's compute dtype, as written). ``fp8`` is
float8 e4m3fn: a quarter of fp32's bytes, 3 mantissa bits (each stored value within 1/16 of the written one, relative),
writes saturate at ±448."""
_KV_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float8_e4m3fn": "fp8",
               "e4m3": "fp8", "fp8_e4m3": "fp8"}

DEFAULT_KV_DTYPE: torch.dtype | None = None
"""What ``auto`` stores: the model's compute dtype (None). 16 bits are opt-in (``--kv-dtype fp16``): half the KV memory
and bytes read per decode step (measured on a loaded 2-vCPU AVX2 EPYC, one pool thread: the decode kernel 1.1-1.4x
faster at 1k-8k keys with 32/4 heads of 128; decode of a 24-layer synthetic MoE at q4 after 4,096 tokens 1.33x,
``evals/perf/bench_kv_dtype.py``), and fp16 is the 16-bit type to pick (3 more mantissa bits than bf16: logits ~10x
closer to an fp32 cache on the oracle checkpoints, tests/runtime/kv/test_kv16.py; F16C widens it faster). It is not
the default because an fp32 model then no longer matches transformers to 1e-4, and a prefix reused from the cache
matches one computed again only to ~1e-3 in the logits (the rounding to 16 bits turns last-bit differences of
chunked prefill into visible steps), where an fp32 cache keeps them within 1e-4: reproducible greedy output across
cache hits is worth more by default than the long-context speed-up.
``$FREETOKEN_KV_DTYPE`` (auto/fp32/bf16/fp16/fp8) overrides what ``auto`` means."""
KV_DTYPE_ENV = "FREETOKEN_KV_DTYPE"


def _parse_kv_dtype(kv_dtype: str | torch.dtype | None) -> str:
    if isinstance(kv_dtype, torch.dtype):
        for name, dt in KV_DTYPES.items():
            if dt == kv_dtype:
                return name
        raise OptionError(f"unsupported KV cache dtype {kv_dtype}; use one of: {', '.join(KV_DTYPES)}")
    name = "auto" if kv_dtype is None else _KV_ALIASES.get(str(kv_dtype).lower(), str(kv_dtype).lower())
    if name not in KV_DTYPES:
        raise OptionError(f"unknown KV cache dtype {kv_dtype!r}; use one of: {', '.join(KV_DTYPES)}")
    return name


def resolve_kv_dtype(kv_dtype: str | torch.dtype | None, device: torch.device | str,
                     compute_dtype: torch.dtype) -> torch.dtype | None:
    """The storage dtype for a ``kv_dtype`` option (``auto``/``fp32``/``bf16``/``fp16``/``fp8``; torch dtypes too); None
    means "as written" (the compute dtype). ``auto``: ``$FREETOKEN_KV_DTYPE`` when set, else
    ``DEFAULT_KV_DTYPE`` (the compute dtype). Raises ``OptionError`` for anything else."""
    import os

    name = _parse_kv_dtype(kv_dtype)
    if name == "auto":
        env = os.environ.get(KV_DTYPE_ENV, "").strip()
        if env:
            try:
                name = _parse_kv_dtype(env)
            except OptionError as exc:
                raise OptionError(f"${KV_DTYPE_ENV}: {exc}") from None
    if name == "auto":
        return DEFAULT_KV_DTYPE
    return KV_DTYPES[name]


FP16_MAX = 65504.0
FP8_MAX = 448.0
SATURATE = {torch.float16: FP16_MAX, torch.float8_e4m3fn: FP8_MAX}
"""Storage types whose writes clamp to their largest finite value first (a cast past it gives inf, or NaN for
e4m3fn, which has no infinity)."""


class OutOfPages(FreeTokenError):
    """The KV pool has no free page left (after eviction); raise the KV budget or shorten the context."""


class FreePages:
    """The free page ids of a pool: O(1) to take a given page or the most recently freed one, and a run of ``n``
    consecutive ids found at C speed (``bytearray.find`` over a map of free ids).

    ``map[p]`` is 1 while page ``p`` is free; ``stack`` holds freed ids, newest last (a page freed recently is
    likely still in cache), with stale entries (taken by id since) skipped when popped and dropped when the stack
    outgrows the pool."""

    def __init__(self, num_pages: int, free: list[int]) -> None:
        self.map = bytearray(num_pages)
        self.stack: list[int] = []
        self.count = 0
        for page in free:
            self.add(page)

    def __len__(self) -> int:
        return self.count

    def add(self, page: int) -> None:
        if self.map[page]:
            raise ValueError(f"page {page} is already free")
        self.map[page] = 1
        self.count += 1
        self.stack.append(page)
        if len(self.stack) > 2 * len(self.map) + 64:  # stale entries (from `discard`) outgrew the pool: compact
            live: list[int] = []
            seen: set[int] = set()
            for p in reversed(self.stack):  # newest first: a page freed twice keeps its latest place
                if self.map[p] and p not in seen:
                    seen.add(p)
                    live.append(p)
            self.stack = live[::-1]

    def discard(self, page: int) -> bool:
        """Take ``page`` off the free set; False when it was not free."""
        if not (0 <= page < len(self.map)) or not self.map[page]:
            return False
        self.map[page] = 0
        self.count -= 1
        return True

    def pop(self) -> int:
        """The most recently freed page still free."""
        while self.stack:
            page = self.stack.pop()
            if self.map[page]:
                self.map[page] = 0
                self.count -= 1
                return page
        raise IndexError("no free page")

    def run(self, n: int) -> int | None:
        """The first id of the lowest run of ``n`` consecutive free pages (taken off the set), else None."""
        first = self.map.find(b"\x01" * n) if 0 < n <= self.count else -1
        if first < 0:
            return None
        self.map[first : first + n] = bytes(n)
        self.count -= n
        return first

    def highest(self, n: int) -> list[int]:
        """Up to ``n`` free pages, highest ids first (taken off the set)."""
        out: list[int] = []
        end = len(self.map)
        while len(out) < n:
            page = self.map.rfind(1, 0, end)
            if page < 0:
                break
            self.map[page] = 0
            self.count -= 1
            out.append(page)
            end = page
        return out


class PagePool:
    """Fixed pool of ``num_pages`` pages on ``device``; pages are reference counted."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, device: torch.device | str = "cpu",
                 tier: str = "device", active: int | None = None, kv_dtype: torch.dtype | None = None) -> None:
        """``num_pages`` is the capacity (page ids); ``active`` pages (default: all) are in circulation.
        ``kv_dtype``: storage type of floating parts (None: the type they are written in).

        An elastic pool starts with fewer active pages and ``grow``s / ``retire``s them as its memory reservation
        changes. Storage is reserved lazily at capacity size: on the CPU untouched pages cost no physical memory,
        and only active pages are ever written.
        """
        if num_pages < 1 or page_size < 1:
            raise ValueError("a page pool needs at least one page of at least one position")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.device, self.tier = torch.device(device), tier
        self.kv_dtype = kv_dtype
        self.data: list[list[torch.Tensor] | None] = [None] * num_layers
        self.refs = [0] * num_pages
        active = num_pages if active is None else max(0, min(active, num_pages))
        self._free = FreePages(num_pages, list(range(active - 1, -1, -1)))
        self._dormant = list(range(num_pages - 1, active - 1, -1))
        """Page ids out of circulation (never activated, or retired)."""
        self._index_memo: dict[tuple[Any, ...], Any] = {}
        """Index tensors on the pool's device by what they index (``_indices``)."""

    # ------------------------------------------------------------------------------------------------ accounting

    @property
    def active(self) -> int:
        """Pages in circulation (used + free): what the pool's memory reservation pays for."""
        return self.num_pages - len(self._dormant)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.active - len(self._free)

    def grow(self, n: int) -> int:
        """Put up to ``n`` more pages in circulation; returns how many."""
        n = min(n, len(self._dormant))
        for _ in range(n):
            self._free.add(self._dormant.pop())
        return n

    def retire(self, n: int) -> int:
        """Take up to ``n`` free pages out of circulation; returns how many. A CPU pool gives their bytes back to the
        OS (``memory.release_pages``): the budget moves retired pages' bytes to the experts, so they must stop being
        resident; a page put back in circulation reads zeros until it is written, as a fresh one would."""
        retired = self._free.highest(n)  # the top of the id range: low ids stay dense for runs
        self._dormant.extend(retired)
        if retired and self.device.type == "cpu":
            for store in self.data:
                for buf in store or ():
                    if not buf.is_pinned():
                        for page in retired:
                            release_pages(buf[page])
        return n

    def take(self, page: int) -> int | None:
        """Page ``page`` with reference count 1 if it is free (a sequence extending its run of ids), else None."""
        if not 0 <= page < self.num_pages or self.refs[page] or not self._free.discard(page):
            return None  # in use, or dormant (not on the free list)
        self.refs[page] = 1
        return page

    def take_run(self, n: int) -> int | None:
        """The first of ``n`` consecutive free pages, all taken with reference count 1; None when there is no such
        run (the free list is fragmented or short). Never evicts anything."""
        first = self._free.run(n)
        if first is not None:
            for page in range(first, first + n):
                self.refs[page] = 1
        return first

    def alloc(self) -> int:
        """A fresh page with reference count 1; raises ``OutOfPages`` when none is free."""
        if not self._free:
            raise OutOfPages(f"KV pool ({self.tier}) is full: all {self.active} pages of {self.page_size} "
                             "positions are in use")
        page = self._free.pop()
        self.refs[page] = 1
        return page

    def incref(self, page: int) -> None:
        assert self.refs[page] > 0, f"incref of free page {page}"
        self.refs[page] += 1

    def decref(self, page: int) -> None:
        assert self.refs[page] > 0, f"decref of free page {page}"
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self._free.add(page)

    # ------------------------------------------------------------------------------------------------ data

    def _layer(self, layer: int, parts: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        store = self.data[layer]
        if store is None:
            # Normal (not inference-mode) tensors: pages are written both inside the decoder's inference mode and
            # outside it (tier moves), which inference tensors would forbid.
            with torch.inference_mode(False):
                store = [self._storage((self.num_pages, self.page_size, *p.shape[1:]), self.storage_dtype(p.dtype))
                         for p in parts]
            self.data[layer] = store
        return store

    def _storage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One part's storage. On the CPU, a part of 2 MiB or more lies in 2 MiB pages (``kernels/hugepages.py``):
        decode attention reads a long context's rows at a stride of every kv head, 4 KiB pages gave a TLB miss every
        few rows (the decode kernel over 8,192 fp16 keys of 16/4 heads x 128, 2 threads: 1.04-1.21x faster from 2 MiB
        pages; a whole model's decode there: within the machine's noise, ``evals/perf/RESULTS.md``). Untouched memory
        still costs nothing; written memory is committed 2 MiB at a time instead of 4 KiB."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.device.type == "cpu" and nbytes >= hugepages.HUGE:
            return hugepages.empty(nbytes).view(dtype).view(shape)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """How a part written as ``dtype`` is stored."""
        return self.kv_dtype if self.kv_dtype is not None and dtype.is_floating_point else dtype

    def write(self, layer: int, pages: list[int], start: int, parts: tuple[torch.Tensor, ...]) -> None:
        """Write ``parts`` (each [n, ...]) at sequence positions ``start..start+n`` of the page table ``pages``."""
        store = self._layer(layer, parts)
        n, ps = parts[0].shape[0], self.page_size
        first = start // ps
        run, skip = tuple(pages[first : (start + n - 1) // ps + 1]), start - first * ps

        def make() -> tuple[torch.Tensor, torch.Tensor]:
            pos = torch.arange(skip, skip + n)
            return (torch.tensor(run, dtype=torch.long)[pos // ps].to(self.device), (pos % ps).to(self.device))

        page_idx, offset = self._indices(("write", run, skip, n), make)
        for buf, p in zip(store, parts):
            top = SATURATE.get(buf.dtype)
            if top is not None and p.dtype != buf.dtype:
                p = p.clamp(-top, top)
            buf[page_idx, offset] = p.to(device=buf.device, dtype=buf.dtype)

    def gather(self, layer: int, pages: list[int], length: int) -> list[torch.Tensor]:
        """The first ``length`` positions of a page table, as contiguous tensors [S, ...]."""
        store = self.data[layer]
        assert store is not None, f"layer {layer} has never been written"
        run = tuple(pages[: -(-length // self.page_size)])
        idx = self._indices(("gather", run), lambda: torch.tensor(run, dtype=torch.long, device=self.device))
        return [buf[idx].reshape(-1, *buf.shape[2:])[:length] for buf in store]

    def _indices(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """``make()``'s index tensors for ``key``, made once: every layer of a step writes and gathers the same
        positions, and on an accelerator each index made from host values is a host-to-device copy that waits for
        the device (one per step instead of one per layer and call). Values depend on the key alone; at most 256 are
        kept."""
        got = self._index_memo.get(key)
        if got is None:
            if len(self._index_memo) >= 256:
                self._index_memo.clear()
            got = self._index_memo[key] = make()
        return got

    def view(self, layer: int, first: int, length: int) -> list[torch.Tensor]:
        """``gather`` for a page table that is the run ``first, first + 1, ...``: views into the pool, no copy."""
        store = self.data[layer]
        assert store is not None, f"layer {layer} has never been written"
        n = -(-length // self.page_size)
        return [buf[first : first + n].reshape(-1, *buf.shape[2:])[:length] for buf in store]

    def copy_page(self, src: int, dst: int, other: PagePool | None = None) -> None:
        """Copy page ``src`` of ``other`` (default: this pool) into page ``dst`` of this pool, every layer."""
        source = other or self
        for layer in range(self.num_layers):
            s = source.data[layer]
            if s is None:
                continue
            d = self._layer(layer, tuple(t[0] for t in s))
            with torch.no_grad():
                for dt, st in zip(d, s):
                    dt[dst].copy_(st[src], non_blocking=True)

    def copy_to_run(self, pages: list[int], first: int) -> None:
        """Copy pages ``pages`` of this pool into ``first, first + 1, ...`` (every layer, one indexed copy each)."""
        if not pages:
            return
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        for store in self.data:
            if store is None:
                continue
            with torch.no_grad():
                for buf in store:
                    buf[first : first + len(pages)] = buf[idx]

    def bytes_per_page(self) -> int:
        return sum(t[0].numel() * t.element_size() for store in self.data if store for t in store)
