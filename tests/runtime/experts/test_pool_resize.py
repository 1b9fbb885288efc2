"""Slot pool resizes (the KV <-> expert boundary): in place within the allocated tensor, the memory given back to
the OS, the experts below the new end kept; a reallocation drops every view over the old tensor first."""

from __future__ import annotations

import sys

import pytest
import torch
from freetoken_agent.runtime.experts.layout import ExpertLayout
from freetoken_agent.runtime.experts.policies import make_policy
from freetoken_agent.runtime.experts.pool import SlotPool
from freetoken_agent.runtime.memory import MemoryBudget, release_pages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are given back with Linux madvise")


def _filled(n: int, limit_slots: int = 8) -> tuple[SlotPool, MemoryBudget, dict[tuple[int, int], torch.Tensor]]:
    """A float pool of ``n`` slots (~384 KiB each) under a ledger of ``limit_slots``, every slot holding a random
    expert of layer 0."""
    layout = ExpertLayout("float32", 256, 128)
    ledger = MemoryBudget("host", limit_slots * layout.stride)
    pool = SlotPool("host", layout, n, "cpu", ledger.reserve("experts"), make_policy("lru"))
    content = {}
    for e in range(n):
        s = pool.claim((0, e))
        assert s is not None
        content[(0, e)] = torch.randint(0, 256, (layout.stride,), dtype=torch.uint8)
        pool.data[s].copy_(content[(0, e)])
        pool.ready(s)
    return pool, ledger, content


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))


@linux
def test_release_pages_gives_memory_back_and_reads_zeros() -> None:
    t = torch.full((64 << 20,), 7, dtype=torch.uint8)  # 64 MiB, every page touched
    before = _rss_anon()
    assert release_pages(t[8 << 20 :])
    assert before - _rss_anon() > 48 << 20
    assert int(t[: 4 << 20].min()) == 7 and int(t[16 << 20 : -4096].max()) == 0  # the partial page at the end is kept
    assert not release_pages(t[::2])  # not contiguous: nothing released


@linux
def test_shrink_and_grow_in_place_keep_the_experts_below_the_end() -> None:
    pool, ledger, content = _filled(6)
    ptr, stride = pool.data.data_ptr(), pool.layout.stride
    reallocated = []
    pool.on_reallocate.append(lambda: reallocated.append(True))
    assert pool.resize(3) == 3 * stride
    assert pool.data.data_ptr() == ptr and pool.n_slots == 3 and pool.capacity == 6 and not reallocated
    assert ledger.used == 3 * stride and ledger.peak <= ledger.limit
    for key, want in content.items():
        s = pool.slot_of(key)
        if s is None:
            continue
        assert s < 3 and pool.is_ready(key) and torch.equal(pool.data[s], want)  # kept bytes are intact
    assert len(pool.resident()) == 3 and not pool.free
    assert pool.resize(5) == -2 * stride  # grows back in place: two free slots, the three experts still there
    assert pool.data.data_ptr() == ptr and sorted(pool.free) == [3, 4] and len(pool.resident()) == 3
    assert ledger.used == 5 * stride and not reallocated
    s = pool.claim((1, 0))
    assert s is not None and s in (3, 4)  # a free slot, no eviction
    pool.abandon(s)


def test_growth_past_the_tensor_reallocates_after_views_are_dropped() -> None:
    pool, ledger, _ = _filled(4)
    views = {"data": pool.data[:2]}  # a holder of a view over the pool, as a layer's experts backend is
    pool.on_reallocate.append(views.clear)
    generation = pool.generation
    pool.resize(7)
    assert not views and pool.capacity == pool.n_slots == 7 and pool.generation == generation + 1
    assert not pool.resident() and ledger.used == 7 * pool.layout.stride and ledger.peak <= ledger.limit


def test_resize_refuses_while_slots_are_busy() -> None:
    pool, _, _ = _filled(3)
    pool.use(0)
    with pytest.raises(RuntimeError, match="in use"):
        pool.resize(2)
