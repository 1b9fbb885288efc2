"""A running tool's streamed output is prefilled into the engine session while it runs (issue 8, build item 4):
Agent → ``ctx.on_output`` → ``LocalEngine.stream_tool_output`` → ``Session.prefill`` in the background, so the turn
after the tool prefills only the tail. On the built-in model, whose greedy output calls its ``bash`` tool."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from freetoken_agent.runtime.builtin import BUILTIN_SYSTEM_PROMPT, builtin_model_dir
from freetoken_agent.tools import ToolContext, tool
from freetoken_agent.tools.process import child_env, run_process
from freetoken_agent.tools.shell import run_shell, shell_result_prefix

from freetoken_agent import Agent, Limits, LocalEngine, loop
from freetoken_agent.events import TextDelta, ToolCallFinished

TASK = "<pr_description>\nThe test in calc.py fails; fix add().\n</pr_description>"  # the training sessions' task form
BACKEND: list[LocalEngine] = []  # the engine the scripted tool's output streams into
SCRIPT = "import time\nfor i in range(48):\n    print(f'line {i}: ' + 'x' * 60, flush=True)\n    time.sleep(0.01)\n"


@tool(expected_s=2.0)  # schema as in test_phase_wiring: the model's greedy output calls it
async def bash(ctx: ToolContext, command: str) -> str:
    """Run a shell command (scripted: records the command, prints a fixed failing test run).

    Args:
        command: the command line.
    """
    # whatever the command, a fixed script streams ~3 KB of output
    out = await run_process([sys.executable, "-c", SCRIPT], cwd=str(ctx.workspace.root), env=child_env(ctx.env),
                            timeout_s=30, max_chars=ctx.max_output_chars, on_output=ctx.on_output)
    # A tool that runs longer than the prefill of its own output (real test runs do): on a loaded machine this one's
    # 0.5 s could end before the background prefill catches up, and the turn would then compute the rest itself.
    if BACKEND:
        await anyio.to_thread.run_sync(BACKEND[0].engine.kv_manager().prestage.wait)
    return f"{shell_result_prefix(out.output)}exit code: {out.exit_code}"


bash.stream_prefix = run_shell.stream_prefix  # the same result layout as run_shell: output first, status last


def run_agent(backend: LocalEngine, workspace: Path) -> list[Any]:
    workspace.mkdir(exist_ok=True)
    (workspace / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    agent = Agent(backend, tools=[bash], instructions=BUILTIN_SYSTEM_PROMPT, workspace=workspace,
                  limits=Limits(max_steps=3, max_tokens_per_step=96, max_wall_s=120))

    async def go() -> list[Any]:
        return [e async for e in agent.stream(TASK)]

    return anyio.run(go)


def test_streamed_tool_output_is_prefilled_while_the_tool_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    runs = {}
    for name, every in (("streamed", 512), ("off", 10**9)):
        monkeypatch.setattr(loop, "STREAM_PREFILL_CHARS", every)
        backend = LocalEngine.from_pretrained(builtin_model_dir(), threads=1)
        BACKEND[:] = [backend]
        events = run_agent(backend, tmp_path / name)
        finished = [e for e in events if isinstance(e, ToolCallFinished)]
        ran = [e for e in finished if "line 47" in e.content]  # (the model's first call may be malformed JSON)
        assert ran and ran[0].content.endswith("exit code: 0") and len(events) > events.index(ran[0]) + 2
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        runs[name] = ([(e.name, e.content) for e in finished], text, backend.engine.stats()["kv"])
    (calls, text, kv), (calls_off, text_off, kv_off) = runs["streamed"], runs["off"]
    assert calls == calls_off and text == text_off  # the same tokens either way
    streamed = kv["prestage"]["streamed_tokens"]
    assert streamed > 500 and kv_off["prestage"]["streamed_tokens"] == 0  # ~3 KB of output fed during the run
    assert kv["background_prefill_tokens"] >= streamed
    # what streamed in was not prefilled again by the turn after the tool: it came from the session's own cache
    turn_prefill = kv["prefill_tokens"] - kv["background_prefill_tokens"]
    assert turn_prefill <= kv_off["prefill_tokens"] - streamed + 64
