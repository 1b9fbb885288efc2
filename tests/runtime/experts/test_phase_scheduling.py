"""Phase scheduling on the built-in model: hints from the agent reach the engine in order, profiles persist,
staging never breaks the budget or the current step, and outputs are token-identical with and without it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.experts.phase import (
    TUNING,
    PhaseScheduler,
    PhaseSchedulingPolicy,
    onset_key,
)
from freetoken_agent.runtime.experts.phase_profiles import PhaseProfiles, profile_path
from freetoken_agent.runtime.experts.setup import ResidencyConfig
from freetoken_agent.runtime.memory import Budget

from freetoken_agent import Agent, Phase, ScriptedBackend
from freetoken_agent.events import PhaseChanged
from tests.sdk.conftest import hermes_call
from tests.runtime.experts.builtin_budget import DENSE, EXPERTS, MODEL, isolated_cache

PROMPT = "<|im_start|>user\nThe test in calc.py fails; fix add().<|im_end|>\n<|im_start|>assistant\n"


cache = pytest.fixture(autouse=True)(isolated_cache)


def budgeted(fraction: float = 0.4, policy: str = "lru") -> Engine:
    return Engine.from_pretrained(MODEL, threads=1, budget=Budget(host=DENSE + int(fraction * EXPERTS)),
                                  residency=ResidencyConfig(policy=policy))


def agent_turns(engine: Engine, scheduler: PhaseScheduler | None) -> list[int]:
    """Three turns the way an agent drives them: plan, code mid-stream, a tool pause, plan again."""
    ids, out = engine.tokenizer.encode(PROMPT), []
    for phase, n in (("plan", 10), ("code", 12), ("tool", 0), ("plan", 10)):
        engine.hint(phase, 1.5 if phase == "tool" else None)
        if n:
            got = engine.generate(ids, max_new_tokens=n).token_ids
            out += got
            ids = ids + got
        if scheduler is not None:
            scheduler.drain()
    return out


def test_hints_reach_the_engine_in_order_with_code_mid_stream(tmp_path: Path) -> None:
    from freetoken_agent import LocalEngine

    engine = budgeted()
    sched = PhaseScheduler.attach(engine)
    local = LocalEngine(engine)
    local._session("run")  # the engine session a LocalEngine keeps per agent run
    streamed: list[int] = [0]

    class Forwarding(ScriptedBackend):  # the scripted model text; hints go LocalEngine → Session → Engine
        def hint(self, phase: Phase, expected_s: float | None = None, session: str | None = None) -> None:
            super().hint(phase, expected_s, session)
            local.hint(phase, expected_s, session="run")
            sched.stats.tokens[f"streamed@{phase.value}"] = streamed[0]

        async def stream_text(self, request: Any) -> Any:
            async for chunk in super().stream_text(request):
                streamed[0] += 1
                yield chunk

    text = "The sign is wrong.\n```python\ndef add(a, b):\n    return a + b\n```\n"
    backend = Forwarding([hermes_call("run_shell", {"command": "echo ok"}, text), "Fixed."])
    (tmp_path / "ws").mkdir()

    async def go() -> list[Any]:
        return [e async for e in Agent.coding(backend, workspace=tmp_path / "ws").stream("fix add")]

    events = anyio.run(go)
    assert [e.phase for e in events if isinstance(e, PhaseChanged)] == [Phase.PLAN, Phase.CODE, Phase.TOOL, Phase.PLAN]
    assert [p for p, _ in sched.stats.hints] == ["plan", "code", "tool", "plan"]
    assert engine.stats()["phase_hints"] == {"plan": 2, "code": 1, "tool": 1}
    assert len(local.pause_decisions) == 1  # the tool hint paused the engine session (keep / offload / drop)
    # the code hint came while the first reply was still streaming: after its plan text, before it ended
    assert 0 < sched.stats.tokens["streamed@code"] < sched.stats.tokens["streamed@tool"]


def test_profiles_fold_turns_persist_and_reload(cache: Path) -> None:
    prof = PhaseProfiles([0, 1], 4, alpha=0.5)
    prof.observe("plan", 0, {1: 3, 2: 1})
    prof.end_turn()
    assert prof.shares["plan"][0] == [0.0, 0.75, 0.25, 0.0] and prof.turns == {"plan": 1}
    prof.observe("plan", 0, [0, 0, 4, 0])
    prof.end_turn()  # EMA over turns: half the old turn, half the new one
    assert prof.shares["plan"][0] == [0.0, 0.375, 0.625, 0.0]
    assert prof.hot_set("plan", 1) == [(0, 2)] and prof.hot_set("code", 3) == []
    path = profile_path(MODEL)
    assert path.parent == cache / "profiles"
    prof.save(path)
    again = PhaseProfiles.load(path, [0, 1], 4)
    assert again.shares == prof.shares and again.turns == prof.turns
    assert PhaseProfiles.load(path, [0, 1, 2], 4).shares == {}  # another shape: a cold start, not an error
    path.write_text("{not json")
    assert PhaseProfiles.load(path, [0, 1], 4).shares == {}


def test_a_new_session_starts_from_the_saved_profile() -> None:
    engine = budgeted()
    first = PhaseScheduler.attach(engine)
    agent_turns(engine, first)
    first.close()
    turns = dict(first.profiles.turns)
    assert turns["plan"] >= 2 and turns["code"] >= 1 and turns[onset_key("code")] >= 1
    second = PhaseScheduler.attach(budgeted())
    assert second.profiles.turns == turns and second.profiles.shares == first.profiles.shares
    assert len(second.plan_stage("code", 8)) == 8  # warm: a code hint would stage at once


def test_output_is_token_identical_and_the_budget_holds() -> None:
    plain = Engine.from_pretrained(MODEL, threads=1)
    reference = agent_turns(plain, None)
    assert agent_turns(budgeted(policy="lru"), None) == reference
    for session in range(2):  # the second session starts warm: staging and pause prefetch really run
        engine = budgeted(0.25)
        sched = PhaseScheduler.attach(engine, read_gbps=1.0)
        assert agent_turns(engine, sched) == reference
        sched.close()
        ledger = engine.residency.ledgers["host"]
        assert ledger.peak <= ledger.limit
        assert engine.residency.host.n_slots * engine.residency.host.layout.stride <= ledger.limit - DENSE
    assert sum(sched.stats.staged.values()) > 0  # staging really ran (pause prefetch: the replay test)
    snap = sched.snapshot()
    assert snap["accuracy"]  # staged experts were scored against what each phase then used
    assert snap["switches"] == {"plan": 2, "code": 1}  # every plan/code hint opened a switch window
    assert set(snap["switch_misses"]) == {"plan", "code"}
    assert 0 <= sum(snap["switch_misses"].values()) <= engine.residency.counters["host"].misses


def test_staging_never_evicts_what_the_current_step_holds() -> None:
    engine = budgeted(0.35)
    sched = PhaseScheduler.attach(engine)
    store, pool = engine.residency, engine.residency.host
    layers, experts = sched.profiles.layers, sched.profiles.experts
    held_key = (layers[0], 0)
    slot = store.acquire_host(held_key)  # in use by "the current step"
    for layer in layers:  # a profile whose code hot set is every other expert: more than the pool holds
        sched.profiles.observe("code", layer, {e: 1 for e in range(1, experts)})
    sched.profiles.end_turn()
    sched.on_hint("code", None)
    sched.drain()
    assert pool.owner[slot] == held_key and pool.slot_of(held_key) == slot
    assert sum(sched.stats.staged.values()) <= int(pool.n_slots * sched.stage_fraction)
    assert len(pool.resident()) <= pool.n_slots
    store.release_host(slot)
    assert store.ledgers["host"].peak <= store.ledgers["host"].limit


def test_policy_keeps_reserved_keys_and_blends_phase_heat() -> None:
    prof = PhaseProfiles([0], 4)
    prof.observe("code", 0, {3: 10, 2: 1})
    prof.end_turn()
    policy = PhaseSchedulingPolicy(prof, top_k=2)
    resident = [(0, 0), (0, 1), (0, 2), (0, 3)]
    for k in resident:
        policy.touch(k)
    policy.observe(0, {0: 512, 1: 512})  # a long prefill chunk: heat is per token, not per chunk
    assert policy.victim(resident, lambda k: True) == (0, 2)  # plan has no profile: the coldest by heat goes
    policy.set_phase("code")  # code's profile outweighs 0.1 of per-token heat (512 raw counts would not)
    assert policy.victim(resident, lambda k: True) == (0, 0)
    policy.reserved = {(0, 0), (0, 1), (0, 2)}
    assert policy.victim(resident, lambda k: True) == (0, 3)
    assert policy.victim(resident, lambda k: k != (0, 3)) == (0, 0)  # reserved only goes when nothing else can
    assert all(t.onset_tokens > 0 and 0 < t.reserve_fraction <= 1 for t in TUNING.values())
    big = [(layer, e) for layer in range(80) for e in range(4)]  # 320 slots: sampled eviction
    policy.reserved = set(big[:300])
    assert policy.victim(big, lambda k: True) in big[300:]
    assert policy.victim(big, lambda k: k == big[5]) == big[5]


def test_replay_benchmark_runs_on_a_real_session(capsys: pytest.CaptureFixture[str]) -> None:
    from freetoken_agent.evals.builtin.data import DEFAULT_DATA_DIR
    from freetoken_agent.evals.perf import phase_replay

    if not DEFAULT_DATA_DIR.is_dir():
        pytest.skip(f"no trajectories at {DEFAULT_DATA_DIR}")
    assert phase_replay.main(["--max-sessions", "1", "--max-tokens", "4000", "--warm-sessions", "1",
                              "--read-gbps", "0.5", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in summary["policies"]}
    assert set(rows) == set(phase_replay.VARIANTS)
    assert all(r["peak_bytes"] <= r["budget_bytes"] for r in rows.values())
    assert all(r["switches"]["plan"] > 0 and r["switches"]["tool"] > 0 for r in rows.values())
    assert isinstance(summary["phase_switch_miss_reduction"], float)
    assert rows["phase+pause"]["phase_scheduler"]["pause_bytes"] > 0
    with pytest.raises(SystemExit, match="--budget must be a fraction"):
        phase_replay.main(["--budget", "2"])


def test_tool_duration_model_and_segments() -> None:
    from freetoken_agent.evals.perf.phase_trace import Trace, segments, tool_seconds

    assert tool_seconds("cd /repo && python -m pytest tests/x.py", 0) == 6.0
    assert tool_seconds("grep -rn foo .", 200_000) == pytest.approx(1.4)
    assert tool_seconds("cat setup.cfg", 0) == 0.05 and tool_seconds("frobnicate", 0) == 0.5
    labels = [None, None, "plan", "plan", "code", "code", None, "tool", "tool", None, "plan"]
    trace = Trace("t", labels, torch.zeros(len(labels), 1, 2, dtype=torch.int16), [0], [2.5])
    segs = segments(trace)
    assert [(s.kind, s.hint) for s in segs] == [("prefill", "plan"), ("decode", None), ("decode", "code"),
                                                ("pause", "tool"), ("pause", None), ("prefill", "plan"),
                                                ("decode", None)]
    assert segs[3].pause_s == 2.5 and segs[5].turn_start


def test_live_benchmark_runs_the_engine_with_each_policy(capsys: pytest.CaptureFixture[str]) -> None:
    from freetoken_agent.evals.builtin.data import DEFAULT_DATA_DIR
    from freetoken_agent.evals.perf import phase_live

    if not DEFAULT_DATA_DIR.is_dir():
        pytest.skip(f"no trajectories at {DEFAULT_DATA_DIR}")
    assert phase_live.main(["--max-sessions", "1", "--max-tokens", "1800", "--warm-sessions", "0", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["policy"], r["lookahead"]) for r in rows] == list(phase_live.ROWS)
    assert all(r["windows"] > 0 and r["hits"] + r["misses"] > 0 for r in rows)
    assert all(r["switch_misses"] == r["plan"] + r["code"] for r in rows)
