"""The real agent loop driven by ScriptedBackend: a multi-step fix, errors as messages, phases, trajectories."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from freetoken_agent import Agent, Phase, ScriptedBackend
from freetoken_agent.events import (
    InvalidOutput, PhaseChanged, RunFinished, StepFinished, TextDelta, ToolCallFinished, ToolCallStarted,
)
from freetoken_agent.tools import tool
from freetoken_agent.trajectory import read_trajectory
from tests.sdk.conftest import hermes_call

CHECK = "python -c 'import calc; assert calc.add(2, 3) == 5'"
QUICK_SCRIPT = [  # like FIX_SCRIPT, with a shell check instead of pytest (faster)
    hermes_call("read_file", {"path": "calc.py"}),
    hermes_call("run_shell", {"command": CHECK}),
    hermes_call("edit_file", {"path": "calc.py", "old_string": "return a - b", "new_string": "return a + b"}),
    hermes_call("run_shell", {"command": CHECK}),
    "Fixed.",
]
FIX_SCRIPT = [
    hermes_call("read_file", {"path": "calc.py"}, "I'll look at the code first.\n"),
    hermes_call("run_tests", {"paths": ["test_calc.py"]}),
    hermes_call("edit_file", {"path": "calc.py", "old_string": "return a - b", "new_string": "return a + b"},
                "add() subtracts; fixing it.\n"),
    hermes_call("run_tests", {"paths": ["test_calc.py"]}),
    "Fixed `add` in calc.py: it subtracted instead of adding. The test passes now.",
]


def _collect(agent: Agent, task: str) -> list:
    async def go() -> list:
        return [event async for event in agent.stream(task)]

    return anyio.run(go)


def test_multi_step_fix_of_a_failing_test(repo: Path, tmp_path: Path) -> None:
    backend = ScriptedBackend(FIX_SCRIPT)
    agent = Agent.coding(backend, workspace=repo, trajectory=tmp_path / "traj.jsonl")
    events = _collect(agent, "The test in test_calc.py fails. Fix the bug.")

    assert (repo / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    result = events[-1].result
    assert isinstance(events[-1], RunFinished)
    assert result.ok and result.steps == 5 and result.stop_reason == "done"
    assert result.final_message.startswith("Fixed `add`")
    finished = [e for e in events if isinstance(e, ToolCallFinished)]
    assert [e.name for e in finished] == ["read_file", "run_tests", "edit_file", "run_tests"]
    assert "return a - b" in finished[0].content
    assert finished[1].data["failed"] == 1 and finished[3].data["passed"] == 1 and finished[3].data["failed"] == 0
    # what the model saw on its last call: the whole conversation, tool results included
    last = backend.requests[-1].messages
    assert [m["role"] for m in last] == ["system", "user"] + ["assistant", "tool"] * 4
    assert last[-1]["tool_call_id"] == "call_4_0" and "1 passed" in last[-1]["content"]
    assert json.loads(last[6]["tool_calls"][0]["function"]["arguments"])["new_string"] == "return a + b"
    assert {t["function"]["name"] for t in backend.requests[0].tools} >= {"read_file", "edit_file", "run_tests"}
    # usage adds up over steps
    steps = [e for e in events if isinstance(e, StepFinished)]
    assert result.usage.completion_tokens == sum(s.usage.completion_tokens for s in steps) > 0
    # the trajectory holds the run, in order, one JSON object per line
    records = list(read_trajectory(tmp_path / "traj.jsonl"))
    assert records[0]["type"] == "run_started" and records[-1]["type"] == "run_finished"
    assert [r["type"] for r in records].count("run_started") == 1 and records[0]["task"].startswith("The test")
    assert records[-1]["stop_reason"] == "done"
    assert sum(r["type"] == "message" for r in records) == len(result.messages) == 11


def test_phase_events_in_order(repo: Path) -> None:
    backend = ScriptedBackend(QUICK_SCRIPT)
    events = _collect(Agent.coding(backend, workspace=repo), "fix it")
    phases = [(e.phase, e.step) for e in events if isinstance(e, PhaseChanged)]
    P, C, T = Phase.PLAN, Phase.CODE, Phase.TOOL
    assert phases == [(P, 1), (T, 1), (P, 2), (T, 2), (P, 3), (C, 3), (T, 3), (P, 4), (T, 4), (P, 5)]
    # the backend got every hint, with the tools' expected durations
    assert backend.hints == [(P, None), (T, None), (P, None), (T, 5.0), (P, None), (C, None), (T, None),
                             (P, None), (T, 5.0), (P, None)]
    # the code phase starts when the edit call opens: before its arguments have streamed, before the tool runs
    kinds = [type(e).__name__ for e in events if not isinstance(e, TextDelta)]
    step3 = kinds[kinds.index("PhaseChanged", kinds.index("ToolCallFinished", kinds.index("ToolCallFinished") + 1)):]
    assert step3[:4] == ["PhaseChanged", "ToolCallStarted", "PhaseChanged", "StepFinished"]


def test_code_block_in_text_switches_to_code_phase(repo: Path) -> None:
    backend = ScriptedBackend(["Here is the fix:\n```python\ndef add(a, b):\n    return a + b\n```\nApply it."])
    events = _collect(Agent.coding(backend, workspace=repo), "show a fix")
    assert [e.phase for e in events if isinstance(e, PhaseChanged)] == [Phase.PLAN, Phase.CODE]


@tool
def flaky(n: int) -> str:
    """Fail on purpose.

    Args:
        n: Any number.
    """
    raise RuntimeError(f"flaky broke on {n}")


def test_bad_calls_reach_the_model_and_the_run_continues(repo: Path) -> None:
    script = [
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "calc.py",}}\n</tool_call>',  # invalid JSON
        hermes_call("delete_everything", {"path": "."}),  # unknown tool
        hermes_call("read_file", {"path": 123, "start_line": "one"}),  # schema violation
        hermes_call("flaky", {"n": 7}),  # the tool raises
        hermes_call("read_file", {"path": "missing.py"}),  # the tool refuses
        "I could not do it.",
    ]
    backend = ScriptedBackend(script)
    agent = Agent.coding(backend, workspace=repo, tools=[flaky])
    events = _collect(agent, "try things")
    result = events[-1].result
    assert result.ok and result.steps == 6

    def seen(call: int) -> str:  # what the model read right after its call number `call`
        return backend.requests[call].messages[-1]["content"]

    assert backend.requests[1].messages[-1]["role"] == "user"
    assert "could not be read" in seen(1) and "JSON" in seen(1)
    assert "Unknown tool 'delete_everything'" in seen(2) and "read_file" in seen(2)
    assert "Invalid arguments for tool 'read_file'" in seen(3)
    assert "flaky broke on 7" in seen(4) and "RuntimeError" in seen(4)
    assert "missing.py" in seen(5)
    finished = [e for e in events if isinstance(e, ToolCallFinished)]
    assert [e.is_error for e in finished] == [True] * 5
    assert finished[0].arguments is None  # the unreadable call never ran


def test_text_without_any_readable_call_is_reported(repo: Path) -> None:
    backend = ScriptedBackend(["<tool_call>\nplease read calc.py\n</tool_call>", "ok"])
    events = _collect(Agent.coding(backend, workspace=repo), "x")
    assert any(isinstance(e, InvalidOutput) for e in events)
    assert "could not be read" in backend.requests[1].messages[-1]["content"]


def test_several_calls_in_one_step_run_in_order(repo: Path) -> None:
    two = hermes_call("read_file", {"path": "calc.py"}) + "\n" + hermes_call("list_files", {"path": "."})
    backend = ScriptedBackend([two, "done"])
    events = _collect(Agent.coding(backend, workspace=repo), "x")
    started = [e.call_id for e in events if isinstance(e, ToolCallStarted)]
    assert started == ["call_1_0", "call_1_1"]
    tool_msgs = [m for m in backend.requests[1].messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == started
    assert "test_calc.py" in tool_msgs[1]["content"]


def test_structured_turns_replay_a_trajectory(repo: Path, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    first = anyio.run(Agent.coding(ScriptedBackend(QUICK_SCRIPT), workspace=repo, trajectory=path).run, "fix")
    assert first.ok
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    replay = ScriptedBackend.from_trajectory(str(path))
    result = anyio.run(Agent.coding(replay, workspace=repo).run, "fix")
    assert result.ok and result.steps == 5 and replay.remaining == 0
    assert (repo / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"


@pytest.mark.parametrize("fmt,call", [
    ("qwen3_coder", "<tool_call>\n<function=read_file>\n<parameter=path>\ncalc.py\n</parameter>\n</function>\n"
                    "</tool_call>"),
    ("harmony", "<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>{\"path\": \"calc.py\"}"
                "<|call|>"),
])
def test_other_formats_drive_the_loop(repo: Path, fmt: str, call: str) -> None:
    final = "done" if fmt != "harmony" else ("<|channel|>analysis<|message|>It adds wrong.<|end|><|start|>assistant"
                                             "<|channel|>final<|message|>done<|return|>")
    backend = ScriptedBackend([call, final], tool_format=fmt)
    result = anyio.run(Agent.coding(backend, workspace=repo).run, "read")
    assert result.ok and result.final_message == "done"
    if fmt == "harmony":  # thinking stays out of the answer, kept beside it
        assert result.messages[-1]["reasoning_content"] == "It adds wrong."
    assert "return a - b" in backend.requests[1].messages[-1]["content"]


def test_tool_output_streams_to_the_watcher(repo: Path) -> None:
    seen: list[tuple[str, str]] = []
    backend = ScriptedBackend([hermes_call("run_shell", {"command": "echo first; echo second"}), "ok"])
    agent = Agent.coding(backend, workspace=repo, on_tool_output=lambda cid, text: seen.append((cid, text)))
    assert anyio.run(agent.run, "x").ok
    assert {cid for cid, _t in seen} == {"call_1_0"}
    assert "".join(t for _c, t in seen).split() == ["first", "second"]


def test_each_run_is_one_backend_session_closed_at_the_end(repo: Path) -> None:
    backend = ScriptedBackend([hermes_call("list_files", {}), "done", "again"])
    agent = Agent.coding(backend, workspace=repo)
    anyio.run(agent.run, "one")
    anyio.run(agent.run, "two")
    sessions = [r.session for r in backend.requests]
    assert sessions[0] == sessions[1] != sessions[2] and sessions[0].startswith("run-")
    assert backend.ended == [sessions[0], sessions[2]]


class PlainBackend:
    """A user backend with only the basic protocol: no sessions, two-argument hints."""

    def __init__(self) -> None:
        self.inner = ScriptedBackend([hermes_call("list_files", {}), "done"])
        self.hints: list = []

    def generate(self, request):  # noqa: ANN001, ANN201
        return self.inner.generate(request)

    def hint(self, phase, expected_s=None):  # noqa: ANN001, ANN201
        self.hints.append(phase)

    def stats(self):  # noqa: ANN201
        return None


def test_a_backend_without_sessions_still_works(repo: Path) -> None:
    backend = PlainBackend()
    result = anyio.run(Agent.coding(backend, workspace=repo).run, "x")
    assert result.ok and backend.hints == [Phase.PLAN, Phase.TOOL, Phase.PLAN]
