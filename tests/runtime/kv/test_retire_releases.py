"""Retired KV pages stop being resident: the budget gives their bytes to the experts (``KVManager.rebalance``)."""

from __future__ import annotations

import sys

import pytest
import torch
from freetoken_agent.runtime.kv.pool import PagePool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resident memory read from /proc")


def _anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon"))


def test_retired_pages_go_back_to_the_os_and_come_back_writable() -> None:
    pool = PagePool(2, 256, 16)  # 2 layers x (K, V) x 256 pages x 16 positions x 8 heads x 128: 64 MiB
    x = torch.randn(256 * 16, 8, 128)
    for layer in range(2):
        pool.write(layer, list(range(256)), 0, (x, x))
    before = _anon_kib()
    retired = pool.retire(200)
    dropped = (before - _anon_kib()) * 1024
    page_bytes = 2 * 2 * 16 * 8 * 128 * 4
    assert retired == 200 and pool.active == 56
    assert dropped >= 0.8 * retired * page_bytes
    assert pool.grow(200) == 200 and pool.active == 256
    y = torch.randn(16, 8, 128)
    page = 255  # retired (taken from the front of the free list first) and back in circulation
    pool.write(0, [page], 0, (y, y))
    k, v = pool.gather(0, [page], 16)
    assert torch.equal(k, y) and torch.equal(v, y)
