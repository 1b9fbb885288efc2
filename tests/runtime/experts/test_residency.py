"""Experts under a memory budget: same tokens as the unbudgeted engine, budget never exceeded, disk tier works."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.experts.setup import ResidencyConfig
from freetoken_agent.runtime.memory import Budget, BudgetExceededError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.runtime.checkpoints import save_checkpoint

NEW = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3moe")
    save_checkpoint("qwen3_moe", folder, seed=3)
    return folder


@pytest.fixture(scope="module")
def reference(model: Path) -> Engine:
    return Engine.from_pretrained(model)


@pytest.fixture(scope="module")
def q4_reference(model: Path) -> Engine:
    return Engine.from_pretrained(model, quant="q4")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path_factory.getbasetemp() / "ftcache"))


def expert_bytes(engine: Engine) -> int:
    return sum(b.gate_up.nbytes + b.down.nbytes for b in engine.decoder.experts if b is not None)


def dense_bytes(model: Path) -> int:
    """The dense weights and a step's working memory: what the budget holds besides experts and KV."""
    e = Engine.from_pretrained(model, budget=Budget())
    held = e.residency.ledgers["host"].reservations
    return held["dense"].nbytes + held["step"].nbytes


def kv_room(model: Path) -> int:
    """Host bytes for the KV pool's first growth step (16 pages of 16 positions): the KV lives in the same budget
    and takes its pages from the expert-slot pool, so a budget sized for the experts alone leaves it none."""
    return Engine.from_pretrained(model).kv_bytes_per_token() * 16 * 16


def check_budget(engine: Engine) -> None:
    for ledger in engine.residency.ledgers.values():
        if ledger.limit is not None:
            assert ledger.peak <= ledger.limit


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    fraction=st.floats(0.2, 1.2),
    policy=st.sampled_from(["lru", "heat", "phase"]),
    prefetch=st.booleans(),
    quant=st.sampled_from(["none", "q4"]),
    prompt=st.lists(st.integers(0, 511), min_size=1, max_size=40),
)
def test_budgeted_tokens_match_unbudgeted(model: Path, reference: Engine, q4_reference: Engine, fraction: float,
                                          policy: str, prefetch: bool, quant: str, prompt: list[int]) -> None:
    ref = q4_reference if quant == "q4" else reference
    want = ref.generate(prompt, max_new_tokens=NEW).token_ids
    experts = ref.quant.quant_bytes if quant == "q4" else expert_bytes(reference)
    host = dense_bytes(model) + int(fraction * experts) + kv_room(model)
    try:
        engine = Engine.from_pretrained(model, quant=quant, budget=Budget(host=host),
                                        residency=ResidencyConfig(policy=policy, prefetch=prefetch))
    except BudgetExceededError:
        assert fraction < 0.3  # only budgets below one MoE step's experts may refuse
        return
    assert engine.generate(prompt, max_new_tokens=NEW).token_ids == want
    assert torch.equal(engine.logits(prompt), ref.logits(prompt))  # bitwise, not just the same argmax
    engine.residency.drain()
    check_budget(engine)
    stats = engine.stats()["residency"]
    assert stats["tiers"]["host"]["peak"] <= host
    if fraction < 0.5:  # the pool cannot hold every expert: experts were evicted and re-read from disk
        assert stats["tiers"]["host"]["evictions"] > 0


def test_experts_three_times_the_host_budget_stream_from_disk(model: Path, reference: Engine) -> None:
    prompt = [5, 17, 300, 41, 9, 77, 128, 3]
    want = reference.generate(prompt, max_new_tokens=16).token_ids
    experts = expert_bytes(reference)
    host = dense_bytes(model) + experts // 3
    engine = Engine.from_pretrained(model, budget=Budget(host=host),
                                    residency=ResidencyConfig(policy="lru", drop_page_cache=True))
    assert engine.generate(prompt, max_new_tokens=16).token_ids == want
    engine.residency.drain()
    stats = engine.stats()["residency"]
    host_tier = stats["tiers"]["host"]
    assert host_tier["slots"] * host_tier["slot_bytes"] <= experts // 3
    assert stats["tiers"]["disk"]["bytes_read"] > experts  # more than every expert once: it streamed
    assert host_tier["misses"] > 0 and host_tier["evictions"] > 0
    check_budget(engine)
    # the experts were never loaded as a whole: the engine holds no expert tensor outside the slot pool
    assert all(lw.moe is None or lw.moe.experts.gate_up.numel() == 0 for lw in engine.decoder.weights.layers)


@pytest.mark.parametrize("quant", ["q4", "q8"])
def test_quantized_experts_from_the_disk_tier(model: Path, quant: str) -> None:
    ref = Engine.from_pretrained(model, quant=quant)
    prompts = [[1, 2, 3], [400, 12, 99, 250, 7, 7, 7], list(range(30, 60))]
    host = dense_bytes(model) + expert_bytes(Engine.from_pretrained(model)) // 12 + kv_room(model)
    engine = Engine.from_pretrained(model, quant=quant, budget=Budget(host=host),
                                    residency=ResidencyConfig(policy="heat"))
    for p in prompts:
        assert engine.generate(p, max_new_tokens=NEW).token_ids == ref.generate(p, max_new_tokens=NEW).token_ids
    stats = engine.stats()["residency"]
    assert stats["tiers"]["host"]["slots"] < 24  # fewer slots than experts (3 layers x 8)
    check_budget(engine)


def test_budget_too_small_is_one_clear_error(model: Path) -> None:
    with pytest.raises(BudgetExceededError, match="too small"):
        Engine.from_pretrained(model, budget=Budget(host=dense_bytes(model) + 1000))
    with pytest.raises(BudgetExceededError, match="dense weights alone"):
        Engine.from_pretrained(model, budget=Budget(host=1000))


def test_pinned_experts_are_never_evicted(model: Path, reference: Engine) -> None:
    pins = ((0, 0), (1, 3), (2, 7))
    host = dense_bytes(model) + expert_bytes(reference) // 4 + kv_room(model)
    engine = Engine.from_pretrained(model, budget=Budget(host=host), residency=ResidencyConfig(pin=pins))
    prompt = list(range(100, 140))
    assert engine.generate(prompt, max_new_tokens=NEW).token_ids == reference.generate(prompt, max_new_tokens=NEW).token_ids
    assert all(engine.residency.host.is_ready(k) for k in pins)
    assert engine.stats()["residency"]["tiers"]["host"]["evictions"] > 0


def test_kv_expert_boundary_moves_without_reloading(model: Path, reference: Engine) -> None:
    host = dense_bytes(model) + expert_bytes(reference) // 2
    engine = Engine.from_pretrained(model, budget=Budget(host=host), residency=ResidencyConfig(pin=((1, 1),)))
    prompt = [9, 8, 7, 6, 5]
    want = reference.generate(prompt, max_new_tokens=NEW).token_ids
    ledger = engine.residency.ledgers["host"]
    slots = engine.residency.host.n_slots
    stride = engine.residency.host.layout.stride
    moved = ledger.move("experts", "kv", 3 * stride)
    assert moved == 3 * stride and engine.residency.host.n_slots == slots - 3
    assert ledger.reservations["kv"].nbytes == 3 * stride and ledger.used <= host
    assert engine.residency.host.is_ready((1, 1))  # pins survive the move
    assert engine.generate(prompt, max_new_tokens=NEW).token_ids == want
    assert engine.residency.grow_host(2 * stride) == 2 * stride
    assert engine.residency.host.n_slots == slots - 1
    assert engine.generate(prompt, max_new_tokens=NEW).token_ids == want
    assert ledger.peak <= host
    ledger.move("experts", "kv", host)  # asks for everything: keeps what one step needs (top-2) plus the pin
    assert engine.residency.host.n_slots == 2 + 1
    assert engine.generate(prompt, max_new_tokens=NEW).token_ids == want


def test_phase_hint_switches_the_phase_policy(model: Path, reference: Engine) -> None:
    host = dense_bytes(model) + expert_bytes(reference) // 2
    engine = Engine.from_pretrained(model, budget=Budget(host=host), residency=ResidencyConfig(policy="phase"))
    engine.hint("plan")
    engine.generate([1, 2, 3, 4], max_new_tokens=4)
    engine.hint("code")
    engine.generate(list(range(300, 340)), max_new_tokens=4)
    policy = engine.residency.host.policy
    assert policy.phase == "code"
    plan_hot, code_hot = policy.hot_set("plan", 24), policy.hot_set("code", 24)
    assert plan_hot and code_hot and plan_hot != code_hot


def test_per_layer_pools_cap_each_layer(model: Path, reference: Engine) -> None:
    host = dense_bytes(model) + expert_bytes(reference) // 2 + kv_room(model)
    engine = Engine.from_pretrained(model, budget=Budget(host=host),
                                    residency=ResidencyConfig(pools="layer", prefetch=False))
    prompt = list(range(60, 110))
    assert engine.generate(prompt, max_new_tokens=NEW).token_ids == reference.generate(prompt, max_new_tokens=NEW).token_ids
    pool = engine.residency.host
    share = pool.n_slots // 3
    assert pool.per_layer == share
    per_layer = {layer: sum(1 for k in pool.table if k[0] == layer) for layer in range(3)}
    assert all(0 < n <= share for n in per_layer.values()), per_layer
    assert pool.layer_count == per_layer
