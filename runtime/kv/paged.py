"""A sequence's KV cache over pool pages, with the same interface the decoder uses for the contiguous cache.

The page table maps position ``p`` to page ``pages[p // page_size]``. Pages may be shared with the radix tree or
other sessions (reference counted); writing into a shared page first copies it (copy-on-write), so a shared page is
never modified.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from freetoken_agent.runtime.kv.cache import RecurrentStates
from freetoken_agent.runtime.kv.pool import PagePool


SPARE_PAGES = 16
"""Pages a sequence takes beyond its need when it moves into a run (bounds what one sequence holds unused)."""


class PagedKVCache(RecurrentStates):
    """Page-table view of one sequence. ``alloc`` supplies fresh pages (and may evict to find one).

    Recurrent layers (hybrid models) keep their per-sequence state here too, outside the pages.
    """

    def __init__(self, pool: PagePool, alloc: Callable[[], int], reclaim: Callable[[int], bool] | None = None,
                 move: Callable[[int, int], bool] | None = None) -> None:
        """``move(page, limit)``: free that page by moving a cache's copy of it elsewhere (the radix tree's
        ``move_page``) when that is cheaper than copying our ``limit`` pages into a free run, so the sequence grows
        into it and stays one run; ``reclaim(page)``: free it by dropping what a cache holds there (``evict_page``),
        the last resort when neither a move nor a free run to relocate into is possible."""
        self.pool, self._alloc, self._reclaim, self._move = pool, alloc, reclaim, move
        self.pages: list[int] = []
        self.length = 0
        self._pending = 0
        self._prepared: tuple[int, int] | None = None
        self._run = False
        """The page table is one ascending run of page ids: the cached positions are a view of the pool."""
        self._dtypes: dict[int, list[torch.dtype]] = {}
        """Per layer, the dtypes its parts were appended in (what ``cached`` widens a 16-bit pool's parts to)."""
        self._init_states()

    def _pages_changed(self) -> None:
        p = self.pages
        self._run = bool(p) and p[-1] - p[0] == len(p) - 1 and p == list(range(p[0], p[0] + len(p)))

    def reserve(self, n: int) -> None:
        """Make positions ``length..length+n`` writable: private last page, enough pages (may raise
        ``OutOfPages``; pages taken before that stay with this cache). The scheduler reserves every row of a step
        before the forward, so a forward never runs out of pages halfway through its layers."""
        ps, pool = self.pool.page_size, self.pool
        first = self.length // ps
        if first < len(self.pages) and pool.refs[self.pages[first]] > 1:
            fresh = self._alloc()
            pool.copy_page(self.pages[first], fresh)
            pool.decref(self.pages[first])
            self.pages[first] = fresh
        while len(self.pages) * ps < self.length + n:
            # the page after our last one when it is free: the sequence stays one run, served as views of the pool
            page = pool.take(self.pages[-1] + 1) if self.pages else None
            if page is None and self.pages and self._move is not None and self._move(self.pages[-1] + 1,
                                                                                      len(self.pages)):
                page = pool.take(self.pages[-1] + 1)  # the cache's copy of the next page moved aside
            if page is None and self.pages and self._relocate(-(-(self.length + n) // ps)):
                continue
            if page is None and self.pages and self._reclaim is not None and self._reclaim(self.pages[-1] + 1):
                page = pool.take(self.pages[-1] + 1)  # no run was free: the cached continuation next to ours goes
            self.pages.append(self._alloc() if page is None else page)
        self._prepared = (self.length, n)
        self._pages_changed()

    def _relocate(self, need: int) -> bool:
        """Move this sequence into a run of free pages with room to grow (up to ``SPARE_PAGES`` beyond ``need``).

        Sequences that grow side by side take interleaved page ids, and a page table that is not one run is
        gathered — every cached position copied — at every layer of every step. One copy now (amortized: each move
        also takes spare pages) keeps attention on views of the pool. False when no such run is free.
        """
        pool = self.pool
        count = need + min(len(self.pages), SPARE_PAGES)
        first = pool.take_run(count)
        if first is None:
            count = need
            first = pool.take_run(count)
        if first is None:
            return False
        pool.copy_to_run(self.pages, first)
        for old in self.pages:
            pool.decref(old)
        self.pages = list(range(first, first + count))
        return True

    def append(self, layer: int, *parts: torch.Tensor, stored: bool = False) -> list[torch.Tensor]:
        """Write this step's ``parts`` and return every cached position of each (see ``KVCache.append``).

        ``stored``: return the tensors as the pool stores them (a 16-bit pool: fp16/bf16, for attention that reads
        them as is); else in the dtype of ``parts`` (widened copies of a 16-bit pool's parts).
        """
        n = parts[0].shape[0]
        if self._prepared != (self.length, n):
            self.reserve(n)
        self.pool.write(layer, self.pages, self.length, parts)
        self._pending = n
        self._dtypes[layer] = [p.dtype for p in parts]
        if self._run:  # no copy: a decode step over a long context would otherwise copy every cached position
            out = self.pool.view(layer, self.pages[0], self.length + n)
        else:
            out = self.pool.gather(layer, self.pages, self.length + n)
        return out if stored else [t.to(p.dtype) for t, p in zip(out, parts)]

    def direct_rows(self, n: int) -> list[list[torch.Tensor] | None] | None:
        """For a writer that fills the pool's rows itself (the fused decode step, ``model/fused.py``): reserve
        positions ``length..length+n`` and return, per layer, its stored parts as flat views whose row 0 is this
        sequence's position 0 (None for a layer the pool holds nothing of yet); None when the page table is not one
        run. Each layer written this way is then reported with ``wrote_rows``."""
        if self._prepared != (self.length, n):
            self.reserve(n)
        if not self._run:
            return None
        first, pool = self.pages[0], self.pool
        return [None if store is None else [buf[first:].reshape(-1, *buf.shape[2:]) for buf in store]
                for store in pool.data]

    def wrote_rows(self, layer: int, n: int, dtypes: list[torch.dtype]) -> None:
        """Positions ``length..length+n`` of ``layer`` were written through ``direct_rows`` (parts computed in
        ``dtypes``): what ``append`` records."""
        self._pending = n
        self._dtypes[layer] = dtypes

    def cached(self, layer: int, stored: bool = False) -> list[torch.Tensor]:
        """Every position ``layer`` holds, this forward's appends included (see ``KVCache.cached``); a 16-bit pool's
        floating parts widened to fp32 unless ``stored``."""
        n = self.length + self._pending
        if self._run:
            out = self.pool.view(layer, self.pages[0], n)
        else:
            out = self.pool.gather(layer, self.pages, n)
        if stored or self.pool.kv_dtype is None:
            return out
        dtypes = self._dtypes.get(layer, [torch.float32] * len(out))
        return [t.to(d) if t.is_floating_point() else t for t, d in zip(out, dtypes)]

    def advance(self) -> None:
        self.length += self._pending
        self._pending = 0
        self._prepared = None
        self._commit_states()

    def adopt(self, pages: list[int], length: int) -> None:
        """Replace the contents with shared ``pages`` covering ``length`` positions (takes references)."""
        self.release()
        for page in pages:
            self.pool.incref(page)
        self.pages, self.length = list(pages), length
        self._pages_changed()

    def truncate(self, length: int) -> None:
        """Forget positions ≥ ``length``; pages no longer needed are released."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        keep = -(-length // self.pool.page_size)
        for page in self.pages[keep:]:
            self.pool.decref(page)
        del self.pages[keep:]
        self.length = length
        self._prepared = None
        self._pages_changed()

    def rollback(self, length: int) -> None:
        """Forget positions ≥ ``length`` (rejected draft tokens) but keep the pages: they are this sequence's own,
        and the next step writes into them again (releasing and re-taking them every verify step would also risk
        losing the run's next page to another sequence). ``truncate`` or ``release`` gives them back."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll a cache of {self.length} positions back to {length}")
        self.length = length
        self._prepared = None

    def release(self) -> None:
        self.truncate(0)
        self.clear_states()

    def nbytes(self) -> int:
        return len(self.pages) * self.pool.bytes_per_page() + self.states_nbytes()
