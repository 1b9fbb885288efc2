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
from freetoken_agent.events import PhaseChanged, ToolCallFinished

MODEL = builtin_model_dir()
DENSE, EXPERTS = 13221888, 33030144  # the built-in model's dense and routed-expert bytes (float32)
TASK = "The test in calc.py fails; fix add()."
calls: list[str] = []


@tool(expected_s=2.0)
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


def test_output_is_the_same_with_and_without_the_scheduler(tmp_path: Path) -> None:
    texts = []
    for policy in ("phase", "lru"):
        events = run_agent(load(policy), tmp_path / policy)
        texts.append([(e.name, e.content) for e in events if isinstance(e, ToolCallFinished)])
    assert texts[0] == texts[1] and texts[0]
