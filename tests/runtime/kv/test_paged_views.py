"""``PagedKVCache`` hands the decoder views of the pool when a sequence's pages are one ascending run, and a gathered
copy otherwise: both must hold exactly what was appended."""

from __future__ import annotations

import torch

from freetoken_agent.runtime.kv.paged import PagedKVCache
from freetoken_agent.runtime.kv.pool import PagePool


def _fill(cache: PagedKVCache, steps: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list]:
    keys, values, last = [], [], []
    for n in steps:
        k, v = torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, 4, generator=gen)
        last = cache.append(0, k, v)
        cache.advance()
        keys.append(k)
        values.append(v)
    return torch.cat(keys), torch.cat(values), last


def test_a_run_of_pages_is_served_as_views_of_the_pool() -> None:
    pool = PagePool(num_layers=1, num_pages=16, page_size=4)
    cache = PagedKVCache(pool, pool.alloc)
    keys, values, (k_all, v_all) = _fill(cache, [5, 1, 1, 6], torch.Generator().manual_seed(0))
    assert cache.pages == list(range(len(cache.pages)))  # a fresh pool hands out ascending ids
    assert torch.equal(k_all, keys) and torch.equal(v_all, values)
    assert k_all.untyped_storage().data_ptr() == pool.data[0][0].untyped_storage().data_ptr()  # no copy


def test_scattered_pages_are_gathered() -> None:
    pool = PagePool(num_layers=1, num_pages=4, page_size=4)  # no free run to move into: the table scatters
    hole = PagedKVCache(pool, pool.alloc)
    _fill(hole, [4], torch.Generator().manual_seed(1))  # takes page 0
    cache = PagedKVCache(pool, pool.alloc)
    gen = torch.Generator().manual_seed(2)
    keys, values, _ = _fill(cache, [4], gen)  # page 1
    blocker = PagedKVCache(pool, pool.alloc)
    _fill(blocker, [4], gen)  # page 2: the run cannot continue
    hole.release()  # page 0 back on the free list: the next page this sequence gets is 0
    more_k, more_v, (k_all, v_all) = _fill(cache, [3, 2], gen)
    assert cache.pages[:2] == [1, 0]
    assert torch.equal(k_all, torch.cat([keys, more_k])) and torch.equal(v_all, torch.cat([values, more_v]))
    assert k_all.untyped_storage().data_ptr() != pool.data[0][0].untyped_storage().data_ptr()
    cache.truncate(3)  # one page left: a run again
    k_all, _ = cache.append(0, torch.zeros(1, 2, 8), torch.zeros(1, 2, 4))
    assert torch.equal(k_all[:3], keys[:3]) and torch.equal(k_all[3], torch.zeros(2, 8))


def test_a_blocked_sequence_moves_into_a_free_run() -> None:
    pool = PagePool(num_layers=1, num_pages=16, page_size=4)
    gen = torch.Generator().manual_seed(4)
    cache = PagedKVCache(pool, pool.alloc)
    keys, values, _ = _fill(cache, [4, 4], gen)  # pages 0, 1 (and a spare)
    blocker = PagedKVCache(pool, pool.alloc)
    _fill(blocker, [4], gen)  # the page after cache's run
    grown = len(cache.pages)
    more_k, more_v, (k_all, v_all) = _fill(cache, [4 * (grown - 2) + 3], gen)  # past the spare: blocked
    assert cache.pages == list(range(cache.pages[0], cache.pages[0] + len(cache.pages)))  # one run again
    assert blocker.pages[0] not in cache.pages
    assert torch.equal(k_all, torch.cat([keys, more_k])) and torch.equal(v_all, torch.cat([values, more_v]))
    assert k_all.untyped_storage().data_ptr() == pool.data[0][0].untyped_storage().data_ptr()  # a view, no copy
    cache.release()
    blocker.release()
    assert pool.num_used == 0


def test_a_sequence_extends_its_run_when_the_next_page_is_free() -> None:
    pool = PagePool(num_layers=1, num_pages=16, page_size=4)
    other = PagedKVCache(pool, pool.alloc)
    gen = torch.Generator().manual_seed(3)
    _fill(other, [4], gen)  # page 0
    cache = PagedKVCache(pool, pool.alloc)
    _fill(cache, [4], gen)  # page 1
    third = PagedKVCache(pool, pool.alloc)
    _fill(third, [4], gen)  # page 2
    third.release()  # page 2 free again, but page 0 is released last: the free list's next pop is 0
    other.release()
    keys, _, (k_all, _) = _fill(cache, [4, 4], gen)
    assert cache.pages == [1, 2, 3]  # took 2 and then 3, not 0
    assert k_all.untyped_storage().data_ptr() == pool.data[0][0].untyped_storage().data_ptr()
    assert pool.take(2) is None and pool.take(99) is None  # in use / out of range
    pool.retire(pool.num_free)
    assert pool.take(0) is None  # retired pages are not free


def test_a_cached_continuation_next_to_the_run_gives_way_when_no_run_is_free() -> None:
    """The radix tree caches a finished turn's continuation in the page right after the shared prompt; a new turn
    over the same prompt must grow there. With no free run to move into, the tree's unpinned leaf on that page is
    dropped and the sequence stays one run (served as views); a page a live sequence holds is never taken."""
    from freetoken_agent.runtime.kv.radix import RadixCache

    pool = PagePool(num_layers=1, num_pages=6, page_size=4)
    tree = RadixCache(pool)
    gen = torch.Generator().manual_seed(3)
    first = PagedKVCache(pool, pool.alloc, tree.evict_page)
    _fill(first, [8, 8], gen)  # pages 0, 1 (the prompt), 2, 3 (a two-page continuation)
    prompt, reply = list(range(8)), list(range(100, 108))
    tree.insert(prompt + reply, first.pages)
    first.release()  # the tree alone holds pages 0-3 now
    blocker = PagedKVCache(pool, pool.alloc)
    _fill(blocker, [4], gen)  # one of pages 4, 5: no run of 3 free pages to move into remains
    second = PagedKVCache(pool, pool.alloc, tree.evict_page)
    second.adopt(tree.match_prefix(prompt).pages, 8)
    keys, values, (k_all, _) = _fill(second, [1], gen)
    assert second.pages == [0, 1, 2] and tree.evicted_pages == 2  # the continuation's branch gave way
    assert k_all.untyped_storage().data_ptr() == pool.data[0][0].untyped_storage().data_ptr()  # still views
    assert pool.refs[blocker.pages[0]] == 1 and blocker.pages[0] not in second.pages  # the live page untouched


def test_a_cached_tail_next_to_the_run_moves_aside_and_the_path_heals() -> None:
    """A request re-sending a cached prompt adopts its full pages and must write the page after them, which the tree
    holds (the prompt's last page and the reply after it). That short tail moves aside, one page at a time as the
    sequence grows (same KV, same nodes), so it grows in place instead of copying its prefix into a free run; when it
    is inserted, the moved nodes take its pages and the cached path is one run again. A page a live sequence holds
    too, or one with more cached pages through it than the grower would copy, does not move."""
    from freetoken_agent.runtime.kv.radix import RadixCache

    pool = PagePool(num_layers=1, num_pages=32, page_size=4)
    tree = RadixCache(pool)
    gen = torch.Generator().manual_seed(5)
    first = PagedKVCache(pool, pool.alloc, tree.evict_page, tree.move_page)
    keys, values, _ = _fill(first, [24, 8], gen)  # pages 0-5 (the prompt), 6-7 (a reply)
    tokens = list(range(24)) + list(range(100, 108))
    tree.insert(tokens, first.pages)
    assert not tree.move_page(5, 10)  # the finished turn still holds it too
    first.release()
    assert not tree.move_page(5, 3)  # three cached pages run through it: a grower of 3 pages copies as little
    second = PagedKVCache(pool, pool.alloc, tree.evict_page, tree.move_page)
    second.adopt(tree.match_prefix(tokens[:24]).pages[:5], 20)  # the prompt's last page is recomputed
    more_k, _, (k_all, _) = _fill(second, [4, 4, 1], gen)  # over pages 5, 6 and 7 of the cached path
    assert second.pages == list(range(8)) and tree.moved_pages == 3 and tree.evicted_pages == 0
    assert torch.equal(k_all, torch.cat([keys[:20], more_k]))
    assert k_all.untyped_storage().data_ptr() == pool.data[0][0].untyped_storage().data_ptr()  # views, one run
    moved = tree.match_prefix(tokens).pages
    assert moved[:5] == list(range(5)) and not set(moved[5:]) & {5, 6, 7} and all(pool.refs[p] == 1 for p in moved[5:])
    k_pages, v_pages = pool.data[0]
    for i, page in enumerate(moved[5:], 5):  # what the tree caches is unchanged
        assert torch.equal(k_pages[page], keys[4 * i : 4 * i + 4])
        assert torch.equal(v_pages[page], values[4 * i : 4 * i + 4])
    # the grower's first 28 positions as the path's tokens (here the same tokens over other KV, to see the pages)
    tree.insert(tokens[:28], second.pages)
    assert tree.match_prefix(tokens).pages == [*range(7), moved[7]] and tree.repointed_pages == 2
    assert pool.refs[moved[5]] == 0 and pool.refs[moved[6]] == 0  # the moved copies went back to the pool
    second.release()
    tree.clear()
    assert pool.num_used == 0 and not tree.move_page(5, 10) and not tree.move_page(-1, 10)


def test_a_long_cached_path_is_not_broken_for_a_short_grower() -> None:
    """A short request branching off a long cached prompt's first page needs that prompt's second page: moving it
    would leave every later request over the long prompt with a page table that is not one run. The short request
    copies its one page into a free run instead, and the long path keeps its pages."""
    from freetoken_agent.runtime.kv.radix import RadixCache

    pool = PagePool(num_layers=1, num_pages=32, page_size=4)
    tree = RadixCache(pool)
    gen = torch.Generator().manual_seed(6)
    long = PagedKVCache(pool, pool.alloc, tree.evict_page, tree.move_page)
    _fill(long, [40], gen)
    tokens = list(range(40))
    tree.insert(tokens, long.pages)
    long.release()
    path = tree.match_prefix(tokens).pages
    short = PagedKVCache(pool, pool.alloc, tree.evict_page, tree.move_page)
    short.adopt(path[:1], 4)
    keys, _, (k_all, _) = _fill(short, [2], gen)
    assert tree.moved_pages == 0 and tree.match_prefix(tokens).pages == path == list(range(10))
    assert short.pages[0] != 0 and short.pages == list(range(short.pages[0], short.pages[0] + len(short.pages)))
    short.release()
    tree.clear()
    assert pool.num_used == 0
