"""Onset scripts: per-position profiles after a hint, staged at the hint and one position ahead of each token."""

from __future__ import annotations

import pytest
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.experts.phase import PhaseScheduler
from freetoken_agent.runtime.experts.phase_profiles import PhaseProfiles
from freetoken_agent.runtime.experts.phase_script import AHEAD, script_key, script_keys
from freetoken_agent.runtime.experts.setup import ResidencyConfig
from freetoken_agent.runtime.memory import Budget
from tests.runtime.experts.builtin_budget import DENSE, EXPERTS, MODEL, isolated_cache


cache = pytest.fixture(autouse=True)(isolated_cache)


def turn(sched: PhaseScheduler, layers: list[int], tokens: int) -> None:
    """A plan turn: its prefill (experts 0, 1 everywhere), then generated token ``i`` on experts ``i + 2`` and 15."""
    sched.on_hint("plan", None)
    for layer in layers:
        sched.observe_counts(layer, {0: 5, 1: 5}, 5)
    for i in range(tokens):
        for layer in layers:
            sched.observe_counts(layer, {i + 2: 1, 15: 1}, 1)
    sched.on_hint("tool", None)
    sched.drain()  # slots still being read cannot be evicted: let this turn's staging land


def test_positions_are_profiled_and_staged_just_ahead() -> None:
    engine = Engine.from_pretrained(MODEL, threads=1, budget=Budget(host=DENSE + int(0.4 * EXPERTS)),
                                    residency=ResidencyConfig(prefetch=False))
    layers = [i for i, layer in enumerate(engine.spec.layers) if layer.moe is not None]
    sched = PhaseScheduler.attach(engine, PhaseProfiles(layers, 16), pause_prefetch=False)
    for _ in range(3):
        turn(sched, layers, 6)
    prof = sched.profiles
    assert prof.shares[script_key("plan", None)][layers[0]][:2] == [0.5, 0.5]
    assert script_keys(prof, "plan", 3) == [k for layer in layers for k in ((layer, 5), (layer, 15))]
    assert script_key("plan", 6) not in prof.shares and script_key("tool", None) not in prof.shares
    sched.on_hint("plan", None)  # the next turn: its prefill's and first AHEAD tokens' experts are staged first
    sched.drain()
    opening = [k for p in (None, *range(AHEAD)) for k in script_keys(prof, "plan", p)]
    assert set(opening) <= set(sched.policy.reserved)
    assert all(engine.residency.host.slot_of(k) is not None for k in opening)
    third = {(layer, AHEAD + 2) for layer in layers}  # what generated token AHEAD routes to
    for layer in layers:
        sched.observe_counts(layer, {0: 5, 1: 5}, 5)
    for i in range(AHEAD):  # token i is routed: token i + AHEAD's experts are read now
        for layer in layers:
            sched.observe_counts(layer, {i + 2: 1, 15: 1}, 1)
    sched.drain()
    assert third <= set(sched.policy.reserved)
    assert all(engine.residency.host.slot_of(k) is not None for k in third)
    sched.close()
    assert engine.residency.ledgers["host"].peak <= engine.residency.ledgers["host"].limit
