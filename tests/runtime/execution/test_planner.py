"""The planner on a scripted cost model, and the real planner on the CPU with a simulated device tier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.execution.cost import CostModel, Rates
from freetoken_agent.runtime.execution.planner import ExecutionPlanner, ExpertNeed
from freetoken_agent.runtime.experts.setup import ResidencyConfig
from freetoken_agent.runtime.memory import Budget
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.runtime.checkpoints import save_checkpoint

MB = 10**6
# a laptop: PCIe 12 GB/s, CPU streams a q4 expert at 20 GB/s for one token but only 2 GB/s (arith.) at 16 tokens
LAPTOP = Rates(copy_gbps=12.0, host_gbps_m1=20.0, host_gbps_m16=2.0, disk_gbps=3.0,
               device_s_fixed=20e-6, device_s_per_token=0.2e-6)


def planner(rates: Rates = LAPTOP) -> ExecutionPlanner:
    return ExecutionPlanner(CostModel(Rates(**vars(rates))), 4 * MB, has_device=True)


def test_decode_computes_cold_experts_on_the_host_when_the_cpu_is_faster() -> None:
    plan = planner().plan([ExpertNeed(e, 1, on_device=e == 0, on_host=True) for e in range(2)])
    assert plan.paths == {0: "resident", 1: "host"}
    # with eight cold experts the host queue grows; the copy engine takes a share but the host keeps most
    plan = planner().plan([ExpertNeed(e, 1, on_device=False, on_host=True) for e in range(8)])
    assert len(plan.experts("host")) > len(plan.experts("fetch"))


def test_prefill_fetches() -> None:
    plan = planner().plan([ExpertNeed(e, 300, on_device=False, on_host=True) for e in range(8)])
    assert plan.experts("fetch") == list(range(8))


def test_decode_fetches_when_the_link_beats_the_cpu() -> None:
    slow_cpu = Rates(**{**vars(LAPTOP), "host_gbps_m1": 1.0})
    plan = planner(slow_cpu).plan([ExpertNeed(e, 1, on_device=False, on_host=True) for e in range(2)])
    assert plan.experts("fetch") == [0, 1]


def test_makespan_splits_work_between_host_and_device() -> None:
    # equal rates: sending everything one way leaves the other idle; the planner uses both
    even = Rates(copy_gbps=10.0, host_gbps_m1=10.0, host_gbps_m16=10.0, device_s_fixed=0.0, device_s_per_token=0.0)
    plan = planner(even).plan([ExpertNeed(e, 1, on_device=False, on_host=True) for e in range(8)])
    assert 2 <= len(plan.experts("fetch")) <= 6 and 2 <= len(plan.experts("host")) <= 6


def test_no_device_room_means_host() -> None:
    plan = planner().plan([ExpertNeed(e, 300, on_device=False, on_host=True) for e in range(4)], device_room=1)
    assert len(plan.experts("fetch")) == 1 and len(plan.experts("host")) == 3


def test_choice_adapts_when_measured_rates_drift() -> None:
    p = planner()
    needs = [ExpertNeed(0, 1, on_device=False, on_host=True)]
    assert p.plan(needs).paths[0] == "host"
    for _ in range(30):  # another process took the cores: host computes now observed at 0.5 GB/s
        p.cost.observe_host(4 * MB, 1, 4 * MB / 0.5e9)
    assert p.plan(needs).paths[0] == "fetch"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("mixtral")
    save_checkpoint("mixtral", folder, seed=5)
    return folder


def test_simulated_device_tier_same_tokens_and_both_paths(model: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    ref = Engine.from_pretrained(model)
    experts = sum(b.gate_up.nbytes + b.down.nbytes for b in ref.decoder.experts if b is not None)
    prompt = list(range(40, 100))
    want = ref.generate(prompt, max_new_tokens=8).token_ids
    cfg = ResidencyConfig(simulate_device=True, rates=Rates(**vars(LAPTOP)), prefetch=False)
    engine = Engine.from_pretrained(model, budget=Budget(device=experts // 4, host=None), residency=cfg)
    assert engine.generate(prompt, max_new_tokens=8).token_ids == want
    stats = engine.stats()["residency"]
    planner_counts = stats["planner"]
    assert planner_counts["fetch"] > 0  # prefill: many tokens per expert
    assert planner_counts["host"] > 0  # decode: one token to a cold expert
    assert stats["tiers"]["device"]["peak"] <= experts // 4
    assert stats["tiers"]["device"]["bytes_in"] > 0


@pytest.mark.parametrize("mode", ["fetch", "host"])
def test_static_modes_on_the_simulated_device(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              mode: str) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    ref = Engine.from_pretrained(model, quant="q4")
    prompt = list(range(7, 30))
    want = ref.generate(prompt, max_new_tokens=6).token_ids
    cfg = ResidencyConfig(simulate_device=True, planner=mode, prefetch=False)
    engine = Engine.from_pretrained(model, quant="q4", budget=Budget(device=200_000), residency=cfg)
    got = engine.generate(prompt, max_new_tokens=6).token_ids
    counts = engine.stats()["residency"]["planner"]
    other = "host" if mode == "fetch" else "fetch"
    assert counts[mode] > 0 and counts[other] == 0
    # the same C kernels run on both tiers (one expert per call instead of the fused layer call): same tokens
    assert got == want


def test_device_slot_dequantize_matches_the_blocks(tmp_path: Path) -> None:
    import torch
    from freetoken_agent.runtime.checkpoint.experts import ExpertTensors
    from freetoken_agent.runtime.experts.backend import ManagedExperts
    from freetoken_agent.runtime.experts.layout import ExpertLayout
    from freetoken_agent.runtime.quant.blocks import quantize

    d, i = 64, 96
    for packed in (True, False):
        layout = ExpertLayout("q4_0", d, i, packed=packed)
        t = ExpertTensors(torch.randn(2 * i, d), torch.randn(d, i))
        pool = torch.zeros(2, layout.stride, dtype=torch.uint8)
        pool[1, : layout.blob_bytes] = layout.encode(t)
        me = ManagedExperts.__new__(ManagedExperts)
        me.layout = layout
        g, w = me._dequantize(layout.views(pool), 1)
        assert torch.equal(g, quantize(t.gate_up, "q4").dequantize())
        assert torch.equal(w, quantize(t.down, "q4").dequantize())


def test_observed_copies_and_reads_update_the_cost_model(model: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    ref = Engine.from_pretrained(model)
    experts = sum(b.gate_up.nbytes + b.down.nbytes for b in ref.decoder.experts if b is not None)
    scripted = Rates(copy_gbps=1e-3, disk_gbps=1e-3, host_gbps_m1=1e-3, host_gbps_m16=1e-3)  # absurdly slow guesses
    cfg = ResidencyConfig(simulate_device=True, rates=Rates(**vars(scripted)), prefetch=False, planner="fetch")
    engine = Engine.from_pretrained(model, budget=Budget(device=experts // 4), residency=cfg)
    engine.generate(list(range(50)), max_new_tokens=4)
    planner = engine.decoder.experts[0].planner
    rates = planner.cost.rates
    assert planner.cost.observations > 0
    assert rates.copy_gbps > 100 * scripted.copy_gbps and rates.disk_gbps > 100 * scripted.disk_gbps


def test_observed_device_time_moves_decode_to_the_host() -> None:
    """A device driven op by op pays milliseconds per expert (an H200: ~16x the built-in 20 us): once timed calls
    say so, a decode step's cold experts stay on the host, where with the guess they were fetched."""
    fast_link = Rates(**{**vars(LAPTOP), "copy_gbps": 50.0, "host_gbps_m1": 4.0})
    before = planner(fast_link).plan([ExpertNeed(e, 1, on_device=False, on_host=True) for e in range(4)])
    assert before.experts("fetch") == [0, 1, 2, 3]
    p = planner(fast_link)
    for _ in range(40):
        p.cost.observe_device(experts=8, tokens=8, seconds=8 * 2e-3)  # decode: 2 ms an expert
    assert p.cost.rates.device_s_fixed == pytest.approx(2e-3, rel=0.01)
    per_token = p.cost.rates.device_s_per_token
    p.cost.observe_device(experts=2, tokens=600, seconds=2 * (2e-3 + 300 * 5e-6))  # prefill: the per-token term
    assert p.cost.rates.device_s_per_token > per_token and p.cost.rates.device_s_fixed == pytest.approx(2e-3, rel=0.01)
    after = p.plan([ExpertNeed(e, 1, on_device=False, on_host=True) for e in range(4)])
    assert len(after.experts("host")) == 3  # 1 ms each on the host; the device takes one (2 ms beside them)
    p.cost.observe_device(experts=0, tokens=0, seconds=1.0)  # nothing timed: nothing learned
    p.cost.observe_device(experts=3, tokens=3, seconds=0.0)
    assert p.cost.rates.device_s_fixed == pytest.approx(2e-3, rel=0.01)


def test_a_device_slower_than_the_host_shares_even_resident_experts() -> None:
    """Adaptive: resident experts go to the device while its queue finishes first; a device measured at 2 ms an
    expert (an H200 dequantizing q4 slots op by op) leaves most of them to the host beside it. A static mode keeps
    every resident expert on the device."""
    needs = [ExpertNeed(e, 1, on_device=True, on_host=True) for e in range(8)]
    assert planner().plan(needs).experts("resident") == list(range(8))  # 20 us an expert: the device takes all
    slow = Rates(**{**vars(LAPTOP), "device_s_fixed": 2e-3, "host_gbps_m1": 4.0})  # the host: 1 ms an expert
    plan = planner(slow).plan(needs)
    assert len(plan.experts("host")) >= 5 and plan.experts("resident")  # both queues busy, the host's the longer
    assert max(plan.host_s, plan.device_s) <= 6e-3 < 8 * 2e-3
    static = ExecutionPlanner(CostModel(Rates(**vars(slow))), 4 * MB, has_device=True, mode="fetch")
    assert static.plan(needs).experts("resident") == list(range(8))
    evicted = [ExpertNeed(e, 1, on_device=True, on_host=False) for e in range(2)]  # the host would read the disk
    assert planner(Rates(**{**vars(slow), "disk_gbps": 0.1})).plan(evicted).experts("resident") == [0, 1]


def test_the_simulated_device_keeps_its_scripted_device_term(model: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a real accelerator's resident steps are timed into the cost model (CUDA events, read a step later): the
    simulated tier computes on the CPU, and learning from it would make its decisions depend on the machine's load.
    ``DeviceTiming`` itself reports the host's wall time where there are no events."""
    import time

    from freetoken_agent.runtime.experts.backend import DeviceTiming

    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    ref = Engine.from_pretrained(model)
    experts = sum(b.gate_up.nbytes + b.down.nbytes for b in ref.decoder.experts if b is not None)
    scripted = Rates(device_s_fixed=3e-5)
    cfg = ResidencyConfig(simulate_device=True, rates=Rates(**vars(scripted)), prefetch=False, planner="fetch")
    engine = Engine.from_pretrained(model, budget=Budget(device=experts), residency=cfg)
    engine.generate(list(range(50)), max_new_tokens=12)
    assert engine.decoder.experts[0].planner.cost.rates.device_s_fixed == scripted.device_s_fixed
    t = DeviceTiming(torch.device("cpu"), experts=3, tokens=3)
    time.sleep(0.01)
    t.stop()
    assert t.seconds() is not None and t.seconds() >= 0.01 and (t.experts, t.tokens) == (3, 3)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    device_fraction=st.floats(0.3, 1.0),
    host_fraction=st.floats(0.4, 1.2),
    policy=st.sampled_from(["lru", "heat"]),
    copy_gbps=st.floats(0.5, 50.0),
    prompt=st.lists(st.integers(0, 511), min_size=1, max_size=30),
)
def test_two_tiers_any_budget_same_tokens(model: Path, tmp_path_factory: pytest.TempPathFactory,
                                          monkeypatch: pytest.MonkeyPatch, device_fraction: float,
                                          host_fraction: float, policy: str, copy_gbps: float,
                                          prompt: list[int]) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path_factory.getbasetemp() / "two-tiers"))
    ref = Engine.from_pretrained(model)
    experts = sum(b.gate_up.nbytes + b.down.nbytes for b in ref.decoder.experts if b is not None)
    held = Engine.from_pretrained(model, budget=Budget()).residency.ledgers["host"].reservations
    dense = held["dense"].nbytes + held["step"].nbytes  # dense weights + a step's working memory
    rates = Rates(**{**vars(LAPTOP), "copy_gbps": copy_gbps})
    cfg = ResidencyConfig(policy=policy, simulate_device=True, rates=rates)
    budget = Budget(device=int(device_fraction * experts), host=dense + int(host_fraction * experts))
    engine = Engine.from_pretrained(model, budget=budget, residency=cfg)
    assert engine.generate(prompt, max_new_tokens=6).token_ids == ref.generate(prompt, max_new_tokens=6).token_ids
    engine.residency.drain()
    for ledger in engine.residency.ledgers.values():
        assert ledger.peak <= ledger.limit


@pytest.mark.parametrize(("arch", "quant"), [("mixtral", "q4"), ("mixtral", "q8"), ("gpt_oss", "q4"), ("ergo", "q8")])
def test_triton_slot_kernels_on_the_simulated_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str,
                                                     quant: str) -> None:
    """Device slots computed by the Triton slot kernels (interpreted on the CPU) from the pool's own bytes give the
    logits of plain torch over the dequantized experts (fp32, sums in another order) and its greedy tokens: prefill
    through the grouped GEMM, decode through the per-pair GEMV; gpt-oss adds expert biases and its clamped
    activation."""
    from freetoken_agent.runtime.kernels.reference import dequantized_reference

    from tests.runtime.arch_configs import save_checkpoint as save_tiny  # every MoE type in transformers

    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / arch
    save_tiny(arch, folder, seed=3)
    prompt = list(range(7, 30))  # 23 tokens x top-2: more pairs than the GEMV takes

    def run(engine: Engine) -> tuple[torch.Tensor, list[int]]:
        full = engine.logits(prompt)
        cache = engine.decoder.new_cache()
        engine.decoder.forward(torch.tensor(prompt[:-1]), cache)
        last = engine.decoder.logits(engine.decoder.forward(torch.tensor(prompt[-1:]), cache))  # 2 pairs: the GEMV
        return torch.cat([full, last]), engine.generate(prompt, max_new_tokens=6).token_ids

    ref = Engine.from_pretrained(folder, quant=quant)
    dequantized_reference(ref.decoder)
    want_logits, want_ids = run(ref)
    monkeypatch.setenv("FREETOKEN_DEVICE_EXPERTS", "triton")
    cfg = ResidencyConfig(simulate_device=True, planner="fetch", prefetch=False)
    engine = Engine.from_pretrained(folder, quant=quant, budget=Budget(device=400_000), residency=cfg)
    assert {b.device_kernel for b in engine.decoder.experts if b is not None} == {"triton"}
    got_logits, got_ids = run(engine)
    assert engine.stats()["residency"]["planner"]["fetch"] > 0
    assert float((got_logits - want_logits).abs().max()) <= 1e-4
    assert got_ids == want_ids


def test_device_experts_setting_is_checked(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from freetoken_agent.runtime.errors import FreeTokenError

    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    monkeypatch.setenv("FREETOKEN_DEVICE_EXPERTS", "cuda-please")
    cfg = ResidencyConfig(simulate_device=True, prefetch=False)
    with pytest.raises(FreeTokenError, match="FREETOKEN_DEVICE_EXPERTS must be auto, torch or triton"):
        Engine.from_pretrained(model, quant="q4", budget=Budget(device=200_000), residency=cfg)
    monkeypatch.setenv("FREETOKEN_DEVICE_EXPERTS", "auto")  # a CPU tier: the per-expert torch path
    engine = Engine.from_pretrained(model, quant="q4", budget=Budget(device=200_000), residency=cfg)
    assert {b.device_kernel for b in engine.decoder.experts if b is not None} == {"torch"}


def test_triton_slot_kernels_run_a_step_in_turns_when_the_pool_cannot_hold_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: Path
) -> None:
    """A planner that sends more experts to the device than its pool holds at once (slots held by copies in
    flight, say): the slot kernels compute what is held, release it and go on — same logits as the oracle."""
    import freetoken_agent.runtime.experts.backend as backend_module
    from freetoken_agent.runtime.kernels.reference import dequantized_reference

    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    monkeypatch.setenv("FREETOKEN_DEVICE_EXPERTS", "triton")
    calls: list[int] = []

    def counted(x: torch.Tensor, w: object, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        calls.append(slots.numel())
        return slots_matmul(x, w, rows, slots)

    slots_matmul = backend_module.slots_matmul
    monkeypatch.setattr(backend_module, "slots_matmul", counted)
    cfg = ResidencyConfig(simulate_device=True, planner="fetch", prefetch=False)
    engine = Engine.from_pretrained(model, quant="q4", budget=Budget(device=60_000), residency=cfg)
    device_pool = engine.decoder.experts[0].store.device
    monkeypatch.setattr(device_pool, "capacity_for_step", lambda: 99)  # the planner sends every expert there
    prompt = list(range(7, 30))
    got = engine.logits(prompt)
    ref = Engine.from_pretrained(model, quant="q4")
    dequantized_reference(ref.decoder)
    assert float((got - ref.logits(prompt)).abs().max()) <= 1e-4
    layers = sum(b is not None for b in engine.decoder.experts)
    assert device_pool.n_slots < 8 and len(calls) > 2 * layers  # more than one turn per layer
    assert engine.stats()["residency"]["planner"]["host"] == 0


def test_a_slot_kernel_that_fails_at_its_first_launch_falls_back_to_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: Path
) -> None:
    """A GPU / triton pairing where the slot kernels do not compile: one warning, the step reruns one expert at a
    time through the torch path, and the engine's tokens are those of the torch path from the start."""
    import freetoken_agent.runtime.experts.backend as backend_module

    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    cfg = ResidencyConfig(simulate_device=True, planner="fetch", prefetch=False)
    prompt = list(range(7, 30))
    monkeypatch.setenv("FREETOKEN_DEVICE_EXPERTS", "torch")
    want = Engine.from_pretrained(model, quant="q4", budget=Budget(device=200_000), residency=cfg).generate(
        prompt, max_new_tokens=4).token_ids

    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("PassManager::run failed")  # what a triton compile error looks like

    monkeypatch.setattr(backend_module, "slots_matmul", broken)
    monkeypatch.setenv("FREETOKEN_DEVICE_EXPERTS", "triton")
    engine = Engine.from_pretrained(model, quant="q4", budget=Budget(device=200_000), residency=cfg)
    with pytest.warns(UserWarning, match="Triton slot kernels failed .*PassManager::run failed"):
        got = engine.generate(prompt, max_new_tokens=4).token_ids
    assert got == want
    assert {b.device_kernel for b in engine.decoder.experts if b is not None} == {"torch"}
