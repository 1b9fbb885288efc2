"""Phase scheduling with no user code: Agent → LocalEngine → engine Session → PhaseScheduler, on the built-in model
under a memory budget, with a scripted ``bash`` tool and the system prompt the model was trained with (so its greedy
output calls ``bash``: plan → code mid-stream → tool → plan)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from freetoken_agent.runtime.builtin import BUILTIN_SYSTEM_PROMPT, builtin_model_dir
from freetoken_agent.runtime.experts.phase_profiles import profile_path
from freetoken_agent.runtime.experts.setup import ResidencyConfig
from freetoken_agent.runtime.memory import Budget
from freetoken_agent.tools import tool

from freetoken_agent import Agent, Limits, LocalEngine
from freetoken_agent.events import PhaseChanged, TextDelta, ToolCallFinished

MODEL = builtin_model_dir()
from tests.runtime.experts.builtin_budget import DENSE, EXPERTS  # dense + a step's memory, experts
TASK = "<pr_description>\nThe test in calc.py fails; fix add().\n</pr_description>"  # the training sessions' task form
calls: list[str] = []


# A long expected pause: a pausing session then always drops its KV (the recompute estimate, tokens over the
# measured prefill rate, stays far below it however loaded the machine is), so what pre-staging saves does not
# depend on the measured rate (at 2 s a loaded machine kept the KV instead and the saving changed).
@tool(expected_s=600.0)
def bash(command: str) -> str:
    """Run a shell command (scripted: records the command, prints a fixed failing test run).

    Args:
        command: the command line.
    """
    calls.append(command)
    return "F\n===== FAILURES =====\nassert add(2, 3) == 5\nE  assert -1 == 5\n1 failed in 0.01s"


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    calls.clear()
    return tmp_path / "cache"


def load(policy: str, **kwargs: Any) -> LocalEngine:
    return LocalEngine.from_pretrained(MODEL, threads=1, budget=Budget(host=DENSE + int(0.4 * EXPERTS)),
                                       residency=ResidencyConfig(policy=policy), **kwargs)


def run_agent(backend: LocalEngine, workspace: Path, steps: int = 4) -> list[Any]:
    workspace.mkdir(exist_ok=True)
    (workspace / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    agent = Agent(backend, tools=[bash], instructions=BUILTIN_SYSTEM_PROMPT, workspace=workspace,
                  limits=Limits(max_steps=steps, max_tokens_per_step=96, max_wall_s=120))

    async def go() -> list[Any]:
        return [e async for e in agent.stream(TASK)]

    return anyio.run(go)


def test_a_phase_policy_engine_schedules_the_agent_with_no_user_code(tmp_path: Path, cache: Path) -> None:
    backend = load("phase")
    assert backend.scheduler is not None  # attached by LocalEngine: the residency policy is phase
    assert backend.engine.stats()["phase"]["scheduler"] is True
    events = run_agent(backend, tmp_path / "ws")
    assert calls, "the built-in model is expected to call the scripted bash tool"
    phases = [e.phase.value for e in events if isinstance(e, PhaseChanged)]
    assert phases[0] == "plan" and {"tool", "code"} <= set(phases)
    stats = backend.engine.stats()
    phase, kv = stats["phase"], stats["kv"]
    assert phase["current"] == phases[-1] and phase["hints"] == sum(stats["phase_hints"].values())
    # every model call opened a switch window; its misses and stall were counted against the store's
    assert phase["switches"]["plan"] == stats["phase_hints"]["plan"] >= 2
    assert 0 < sum(phase["switch_misses"].values()) <= stats["residency"]["tiers"]["host"]["misses"]
    assert phase["tokens"]["plan"] > 0 and phase["profile_turns"]["plan"] >= 2
    assert len(phase["ttft_s"]) == kv["turns"] == stats["phase_hints"]["plan"]  # TTFT of every turn
    # the tool pause warmed the tool-result framing in the prefix cache
    assert kv["prestage"]["runs"] >= 1 and kv["prestage"]["prefixes"] >= 1
    # the run's end saved the routing profile: the next process starts warm
    assert profile_path(MODEL).is_file()
    again = load("phase")
    assert again.scheduler is not None and again.scheduler.profiles.turns == backend.scheduler.profiles.turns


def test_a_phase_agnostic_policy_gets_no_scheduler_unless_asked(tmp_path: Path) -> None:
    plain = load("lru")
    assert plain.scheduler is None and plain.engine.stats()["phase"] == {"current": None, "scheduler": False,
                                                                        "ttft_s": []}
    assert load("lru", phase_scheduling=True).scheduler is not None
    unbudgeted = LocalEngine.from_pretrained(MODEL, threads=1)
    assert unbudgeted.scheduler is None
    from freetoken_agent.runtime.errors import FreeTokenError

    with pytest.raises(FreeTokenError, match="memory budget"):
        LocalEngine(unbudgeted.engine, phase_scheduling=True)


def test_output_is_the_same_with_and_without_the_scheduler_and_kv_prestaging(tmp_path: Path) -> None:
    runs = {}
    for name, policy, prestage in (("phase", "phase", True), ("lru", "lru", True), ("cold", "phase", False)):
        backend = load(policy)
        backend.engine.kv_manager().prestage.enabled = prestage
        events = run_agent(backend, tmp_path / name)
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        runs[name] = ([(e.name, e.content) for e in events if isinstance(e, ToolCallFinished)], text,
                      backend.engine.stats()["kv"])
    assert runs["phase"][:2] == runs["lru"][:2] == runs["cold"][:2] and runs["phase"][0]
    hot, cold = runs["phase"][2], runs["cold"][2]
    # the framings warmed during the pauses are prefilled there, not at the turns after them
    assert hot["prestage"]["prefilled_tokens"] > 0 and cold["prestage"]["prefilled_tokens"] == 0
    assert hot["prefill_tokens"] < cold["prefill_tokens"]
    assert hot["prefix_hit_tokens"] - cold["prefix_hit_tokens"] == cold["prefill_tokens"] - hot["prefill_tokens"]


def test_the_expected_prompt_is_a_token_prefix_of_the_next_one() -> None:
    from freetoken_agent.backends import GenerateRequest
    from freetoken_agent.backends.local import MARK

    backend = LocalEngine.from_pretrained(MODEL, threads=1)
    schemas = [bash.schema()]
    call = {"id": "call_1_0", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    messages = [{"role": "system", "content": BUILTIN_SYSTEM_PROMPT}, {"role": "user", "content": TASK},
                {"role": "assistant", "content": "THOUGHT: look.", "tool_calls": [call]}]
    result = {"role": "tool", "tool_call_id": "call_1_0", "name": "bash", "content": "calc.py\ntest_calc.py"}
    full = backend.engine.tokenizer.encode(backend.render(GenerateRequest(messages=[*messages, result],
                                                                          tools=schemas)))
    known = backend.prefix_ids([*messages, {**result, "content": MARK}], schemas)
    history = backend.engine.tokenizer.encode(backend.engine.render_chat(messages, schemas,
                                                                         add_generation_prompt=False))
    assert full[: len(known)] == known and len(known) > len(history)  # the framing is part of what is warmed


def test_the_agent_commands_default_to_phase_scheduling_under_a_budget() -> None:
    import argparse

    from freetoken_agent.cli.run import agent_engine_kwargs

    def kwargs(**flags: Any) -> dict[str, Any]:
        base = {"quant": "none", "device_memory": None, "host_memory": None, "residency_policy": None}
        return agent_engine_kwargs(argparse.Namespace(**{**base, **flags}))

    assert kwargs() == {}  # no budget: the unbudgeted load path, no scheduler
    assert kwargs(host_memory="64MB")["residency"].policy == "phase"
    assert kwargs(host_memory="64MB", residency_policy="lru")["residency"].policy == "lru"
