"""Elastic memory: the KV pool and the expert-slot pool share one budget; a growing context takes memory from the
expert pool (which evicts slots), closing the session gives it back — outputs identical throughout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.experts.setup import ResidencyConfig
from freetoken_agent.runtime.kv import KVConfig
from freetoken_agent.runtime.memory import Budget
from tests.runtime.checkpoints import save_checkpoint

pytest.importorskip("transformers")


def test_long_session_on_a_fixed_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    save_checkpoint("qwen3_moe", tmp_path / "m", seed=3)
    reference = Engine.from_pretrained(tmp_path / "m")
    experts = sum(b.gate_up.nbytes + b.down.nbytes for b in reference.decoder.experts if b is not None)
    held = Engine.from_pretrained(tmp_path / "m", budget=Budget()).residency.ledgers["host"].reservations
    limit = held["dense"].nbytes + held["step"].nbytes + int(0.8 * experts)
    engine = Engine.from_pretrained(tmp_path / "m", budget=Budget(host=limit),
                                    residency=ResidencyConfig(policy="lru", kv_reserve=0))
    manager = engine.kv_manager(KVConfig(page_size=4))
    ledger = engine.residency.ledgers["host"]
    assert manager.elastic is not None and manager.pool.active == 0
    slots_before = engine.residency.host.n_slots

    g = torch.Generator().manual_seed(0)
    conv = torch.randint(0, 512, (24,), generator=g).tolist()
    session = engine.session()
    slots_seen = [slots_before]
    for _ in range(8):
        reply = session.generate(conv, max_new_tokens=4, stop_token_ids=[])
        assert reply.token_ids == reference.generate(conv, max_new_tokens=4, stop_token_ids=[]).token_ids
        slots_seen.append(engine.residency.host.n_slots)
        assert ledger.used <= limit and ledger.peak <= limit
        conv = conv + reply.token_ids + torch.randint(0, 512, (20,), generator=g).tolist()

    kv = engine.stats()["kv"]
    assert kv["kv_grown_bytes"] > 0 and manager.pool.active * manager.elastic.bytes_per_page <= \
        ledger.reservations["kv"].nbytes
    assert slots_seen[-1] < slots_before  # the context grew, the expert pool shrank
    assert all(b <= a for a, b in zip(slots_seen, slots_seen[1:]))

    session.close()  # idle pages go back to the expert pool
    manager.radix.clear()
    manager.rebalance()
    assert engine.stats()["kv"]["kv_returned_bytes"] > 0
    assert engine.residency.host.n_slots > slots_seen[-1]
    assert ledger.peak <= limit
    assert engine.generate(conv, max_new_tokens=4, stop_token_ids=[]).token_ids == \
        reference.generate(conv, max_new_tokens=4, stop_token_ids=[]).token_ids


def test_an_unlimited_budget_never_caps_the_kv_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no limit on the tier, the elastic pool grows without taking bytes from the experts' reservation: a
    context far larger than the expert pool runs (it was refused as "KV pool is full" once the experts' bytes were
    all moved over, so a long request's fate depended on how many expert slots the store had chosen)."""
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    save_checkpoint("qwen3_moe", tmp_path / "m", seed=3, max_position_embeddings=4096)
    engine = Engine.from_pretrained(tmp_path / "m", budget=Budget(), residency=ResidencyConfig(policy="lru"))
    manager = engine.kv_manager()
    ledger = engine.residency.ledgers["host"]
    experts_before = ledger.reservations["experts"].nbytes
    prompt = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    n = 3000
    out = engine.generate(prompt, max_new_tokens=n, stop_token_ids=[])
    assert len(out.token_ids) == n
    assert manager.pool.active * manager.elastic.bytes_per_page > experts_before  # more KV than the experts held
    assert ledger.reservations["experts"].nbytes == experts_before  # and none of it taken from them
    engine.close()


def test_a_limited_tier_without_an_expert_pool_lends_its_free_bytes() -> None:
    """A GPU engine whose experts stay on the host (``--cpu-moe``) has a device limit but no expert pool there: the
    KV pool grows from the tier's free bytes up to the limit (it stopped at 0 pages: "KV pool is full" on the first
    prompt) and is refused only past the limit."""
    from freetoken_agent.runtime.kv.pool import OutOfPages
    from freetoken_agent.runtime.kv.session import ElasticKV, KVManager
    from freetoken_agent.runtime.memory import MemoryBudget

    per_page = 4 * 2 * 2 * 8 * 4  # page of 4 positions x (K + V) x 2 heads x 8 dims x fp32, per layer
    ledger = MemoryBudget("device", limit=1000 + 40 * per_page * 2)  # two layers
    ledger.reserve("dense", 1000)
    manager = KVManager(2, KVConfig(page_size=4, device_pages=1), "cpu", ElasticKV(ledger.reserve("kv"), 2 * per_page))
    pages = []
    with pytest.raises(OutOfPages):
        for _ in range(100):
            pages.append(manager.alloc())
    assert len(pages) == 32  # grown 16 pages at a time while a whole step fit under the limit
    assert ledger.used <= ledger.limit and manager.elastic.grown_bytes == 32 * 2 * per_page
