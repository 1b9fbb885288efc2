"""Limits end a run cleanly; cancellation stops generation or a running tool promptly and keeps the trajectory whole."""

from __future__ import annotations

import time
from pathlib import Path

import anyio

from freetoken_agent import Agent, Limits, ScriptedBackend
from freetoken_agent.events import PhaseChanged, RunFinished, StepFinished, TextDelta
from freetoken_agent.phases import Phase
from freetoken_agent.trajectory import read_trajectory
from tests.sdk.conftest import hermes_call

LONG = " ".join(f"word{i}" for i in range(400))


def test_step_limit(repo: Path) -> None:
    backend = ScriptedBackend([hermes_call("list_files", {})] * 10)
    result = anyio.run(Agent.coding(backend, workspace=repo, limits=Limits(max_steps=3)).run, "loop")
    assert result.stop_reason == "max_steps" and result.steps == 3 and not result.ok
    assert "step limit (3" in result.error and backend.remaining == 7


def test_token_limit_caps_steps_and_the_run(repo: Path) -> None:
    backend = ScriptedBackend([LONG, LONG, LONG])
    limits = Limits(max_tokens=150, max_tokens_per_step=100)

    async def go() -> list:
        return [e async for e in Agent.coding(backend, workspace=repo, limits=limits).stream("talk")]

    events = anyio.run(go)
    steps = [e for e in events if isinstance(e, StepFinished)]
    assert [(s.finish_reason, s.usage.completion_tokens) for s in steps] == [("length", 100), ("length", 50)]
    assert [r.max_tokens for r in backend.requests] == [100, 50]
    result = events[-1].result
    assert result.stop_reason == "max_tokens" and result.usage.completion_tokens == 150
    # a cut reply is followed by a note asking the model to go on
    assert "cut off" in backend.requests[1].messages[-1]["content"]


def test_wall_time_limit_while_generating(repo: Path) -> None:
    backend = ScriptedBackend([LONG], delay_s=0.02)  # 400 tokens * 20 ms = 8 s if nothing stopped it
    start = time.monotonic()
    result = anyio.run(Agent.coding(backend, workspace=repo, limits=Limits(max_wall_s=0.5)).run, "talk")
    assert result.stop_reason == "wall_time" and "while the model was generating" in result.error
    assert time.monotonic() - start < 3


def test_wall_time_limit_while_a_tool_runs(repo: Path) -> None:
    backend = ScriptedBackend([hermes_call("run_shell", {"command": "sleep 30; echo late > late.txt"}), "never"])
    start = time.monotonic()
    result = anyio.run(Agent.coding(backend, workspace=repo, limits=Limits(max_wall_s=1.0)).run, "sleep")
    assert result.stop_reason == "wall_time" and "'run_shell'" in result.error
    assert time.monotonic() - start < 8
    time.sleep(0.2)
    assert not (repo / "late.txt").exists()


def test_cancel_mid_stream(repo: Path, tmp_path: Path) -> None:
    backend = ScriptedBackend([LONG], delay_s=0.01)
    agent = Agent.coding(backend, workspace=repo, trajectory=tmp_path / "t.jsonl")
    seen: list = []

    async def go() -> None:
        async for event in agent.stream("talk"):
            seen.append(event)
            if sum(isinstance(e, TextDelta) for e in seen) == 5:
                agent.cancel()

    start = time.monotonic()
    anyio.run(go)
    assert time.monotonic() - start < 2
    result = seen[-1].result
    assert isinstance(seen[-1], RunFinished) and result.stop_reason == "cancelled"
    assert sum(isinstance(e, TextDelta) for e in seen) == 5  # generation stopped at once
    records = list(read_trajectory(tmp_path / "t.jsonl"))
    assert records[-1]["type"] == "run_finished" and records[-1]["stop_reason"] == "cancelled"
    text = [r for r in records if r["type"] == "text"]
    assert text and text[0]["text"] == " ".join(LONG.split()[:5])  # what streamed before the cancel was kept


def test_cancel_while_a_tool_runs(repo: Path) -> None:
    backend = ScriptedBackend([hermes_call("run_shell", {"command": "sleep 30"}), "never"])
    agent = Agent.coding(backend, workspace=repo)
    phases: list = []

    async def go() -> object:
        async with anyio.create_task_group() as tg:
            async def cancel_when_tool_runs() -> None:
                while Phase.TOOL not in phases:
                    await anyio.sleep(0.01)
                await anyio.sleep(0.3)
                agent.cancel()

            tg.start_soon(cancel_when_tool_runs)
            result = await agent.run("sleep", on_event=lambda e: isinstance(e, PhaseChanged) and phases.append(e.phase))
        return result

    start = time.monotonic()
    result = anyio.run(go)
    assert result.stop_reason == "cancelled" and "run_shell" in result.error
    assert time.monotonic() - start < 8


def test_outer_cancel_scope_leaves_a_consistent_trajectory(repo: Path, tmp_path: Path) -> None:
    backend = ScriptedBackend([LONG], delay_s=0.01)
    agent = Agent.coding(backend, workspace=repo, trajectory=tmp_path / "t.jsonl")

    async def go() -> None:
        with anyio.move_on_after(0.2):
            await agent.run("talk")

    anyio.run(go)
    records = list(read_trajectory(tmp_path / "t.jsonl"))
    assert records[-1]["type"] == "run_finished" and records[-1]["stop_reason"] == "interrupted"
    assert any(r["type"] == "text" for r in records)


def test_scripted_backend_running_out_ends_the_run(repo: Path) -> None:
    backend = ScriptedBackend([hermes_call("list_files", {})])
    result = anyio.run(Agent.coding(backend, workspace=repo).run, "x")
    assert result.stop_reason == "backend_error" and "no output left" in result.error


def test_cancel_from_another_thread(repo: Path) -> None:
    import threading

    backend = ScriptedBackend([LONG], delay_s=0.01)
    agent = Agent.coding(backend, workspace=repo)
    timer = threading.Timer(0.3, agent.cancel)
    timer.start()
    start = time.monotonic()
    result = anyio.run(agent.run, "talk")
    timer.join()
    assert result.stop_reason == "cancelled" and time.monotonic() - start < 2
