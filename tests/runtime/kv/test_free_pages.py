"""The pool's free set (``FreePages``): every operation against a plain reference (a list and a scan), under random
interleavings, and the paths that use it: a rolled-back draft keeps its sequence's pages, a session's cache gives
back what it holds beyond its length."""

from __future__ import annotations

import random

import pytest
import torch

from freetoken_agent.runtime.kv.paged import PagedKVCache
from freetoken_agent.runtime.kv.pool import FreePages, PagePool


def _reference_run(free: set[int], n: int, size: int) -> int | None:
    for first in range(size - n + 1):
        if all(p in free for p in range(first, first + n)):
            return first
    return None


def test_free_pages_match_a_plain_reference_under_random_operations() -> None:
    rng = random.Random(7)
    size = 97
    fp = FreePages(size, list(range(size - 1, -1, -1)))
    free, order = set(range(size)), list(range(size - 1, -1, -1))  # order: freed, newest last
    for _ in range(6000):
        op = rng.random()
        if op < 0.3 and free:  # pop: the most recently freed page still free
            expect = next(p for p in reversed(order) if p in free)
            assert fp.pop() == expect
            free.discard(expect)
        elif op < 0.55:  # take a given page
            page = rng.randrange(-2, size + 2)
            assert fp.discard(page) == (page in free)
            free.discard(page)
        elif op < 0.7:  # a run of n
            n = rng.randrange(1, 9)
            first = _reference_run(free, n, size)
            assert fp.run(n) == first
            if first is not None:
                free -= set(range(first, first + n))
        elif op < 0.75:  # the highest ids
            n = rng.randrange(0, 4)
            expect = sorted(free, reverse=True)[:n]
            assert fp.highest(n) == expect
            free -= set(expect)
        else:  # free a used page
            used = [p for p in range(size) if p not in free]
            if used:
                page = rng.choice(used)
                fp.add(page)
                free.add(page)
                order.append(page)
        assert len(fp) == len(free)
        assert len(fp.stack) <= 2 * size + 65  # stale entries are dropped as they pile up
    if not free:
        fp.add(0)
        free.add(0)
    with pytest.raises(ValueError, match="already free"):  # a double free is a bug, never a silent duplicate
        fp.add(min(free))


def test_an_empty_free_set_says_so() -> None:
    fp = FreePages(4, [])
    assert len(fp) == 0 and fp.run(1) is None and fp.highest(3) == []
    with pytest.raises(IndexError):
        fp.pop()
    assert fp.run(0) is None and fp.run(5) is None


def test_a_pool_retires_its_highest_free_pages_and_runs_stay_low() -> None:
    pool = PagePool(num_layers=1, num_pages=12, page_size=2)
    held = [pool.alloc() for _ in range(3)]
    assert held == [0, 1, 2]  # a fresh pool hands out ascending ids
    assert pool.retire(4) == 4 and pool.active == 8
    assert pool.take(11) is None and pool.take(7) == 7  # 8-11 retired, 7 still in circulation
    assert pool.take_run(3) == 3  # 3, 4, 5
    assert pool.take_run(2) is None  # only 6 is free now
    assert pool.grow(2) == 2 and pool.take_run(2) == 8  # 8 and 9 back: a run with nothing after 7 is free
    assert pool.num_used == 10 - 1


def test_a_rolled_back_row_keeps_its_pages_and_the_session_end_gives_spares_back() -> None:
    pool = PagePool(num_layers=1, num_pages=16, page_size=4)
    cache = PagedKVCache(pool, pool.alloc)
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 4, generator=gen)
    cache.append(0, k, v)
    cache.advance()
    row_k, row_v = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 4, generator=gen)
    cache.append(0, row_k, row_v)  # a verify row: positions 6-10, into a third page
    cache.advance()
    pages, used = list(cache.pages), pool.num_used
    cache.rollback(7)  # one draft kept: positions 7-10 forgotten, their pages kept
    assert cache.length == 7 and cache.pages == pages and pool.num_used == used
    k2, v2 = torch.randn(4, 2, 8, generator=gen), torch.randn(4, 2, 4, generator=gen)
    k_all, v_all = cache.append(0, k2, v2)  # the next row writes into the same pages: no page taken
    cache.advance()
    assert cache.pages == pages and pool.num_used == used
    assert torch.equal(k_all, torch.cat([k, row_k[:1], k2])) and torch.equal(v_all, torch.cat([v, row_v[:1], v2]))
    cache.rollback(9)
    cache.truncate(cache.length)  # what the scheduler does before a session keeps the cache
    assert len(cache.pages) == 3 and pool.num_used == 3
    with pytest.raises(ValueError, match="roll"):
        cache.rollback(10)
    cache.release()
    assert pool.num_used == 0
