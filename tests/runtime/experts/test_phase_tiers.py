"""Phase scheduling with a device tier in front of the host tier (simulated in CPU memory): the host tier keeps
what the device tier misses — staging skips device-held keys, and their host copies are evicted first."""

from __future__ import annotations

import pytest
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.experts.phase import PhaseScheduler
from freetoken_agent.runtime.experts.phase_profiles import PhaseProfiles
from freetoken_agent.runtime.experts.setup import ResidencyConfig
from freetoken_agent.runtime.memory import Budget
from tests.runtime.experts.builtin_budget import DENSE, EXPERTS, MODEL, isolated_cache


cache = pytest.fixture(autouse=True)(isolated_cache)


def test_the_host_tier_keeps_what_the_device_tier_misses() -> None:
    engine = Engine.from_pretrained(MODEL, threads=1, budget=Budget(device=int(0.2 * EXPERTS),
                                                                     host=DENSE + int(0.4 * EXPERTS)),
                                    residency=ResidencyConfig(simulate_device=True, prefetch=False))
    store, host, device = engine.residency, engine.residency.host, engine.residency.device
    moe = [i for i, layer in enumerate(engine.spec.layers) if layer.moe is not None]
    profiles = PhaseProfiles(moe, 16)
    for layer in moe:  # code's hot set: experts 0..5 of every layer
        profiles.observe("code", layer, {e: 10 - e for e in range(6)})
    profiles.end_turn()
    sched = PhaseScheduler.attach(engine, profiles)
    assert sched.policy.faster is device
    on_device = [(layer, 0) for layer in moe]
    for key in on_device:  # the device tier holds expert 0 of every layer (its host copy stays too)
        store.release_device(store.acquire_device(key))
    sched.on_hint("code", None)
    sched.drain()
    staged = set(sched._pending)
    assert staged and not staged & set(on_device)  # device-held keys are not staged into host slots
    assert not sched.policy.reserved & set(on_device)  # nor held there through the switch
    assert staged <= {(layer, e) for layer in moe for e in range(1, 6)}
    resident = host.resident()
    victim = sched.policy.victim(resident, lambda k: True)
    assert victim in on_device  # their host copies go first, hot or not
    sched.close()
    assert store.ledgers["host"].peak <= store.ledgers["host"].limit
