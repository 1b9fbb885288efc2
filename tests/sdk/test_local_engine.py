"""LocalEngine around the real runtime engine, on a tiny random qwen3_moe checkpoint built here."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from freetoken_agent import Agent, Limits, LocalEngine, Phase
from freetoken_agent.backends import GenerateRequest, GenerationDone
from freetoken_agent.backends.local import template_messages
from tests.sdk.tiny_checkpoint import shared_tiny_qwen3_moe

pytest.importorskip("freetoken_agent.runtime.engine")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tiny_qwen3_moe(tmp_path_factory)


@pytest.fixture(scope="module")
def backend(tiny: Path) -> LocalEngine:
    import torch

    torch.set_num_threads(1)
    return LocalEngine.from_pretrained(tiny)


def test_renders_with_the_model_template_and_streams(backend: LocalEngine) -> None:
    assert backend.tool_format == "hermes"
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    request = GenerateRequest(messages=[{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
                              tools=tools, max_tokens=12)
    prompt = backend.render(request)
    assert prompt.endswith("<|im_start|>assistant\n") and '"name": "read_file"' in prompt

    async def go() -> list:
        return [e async for e in backend.generate(request)]

    events = anyio.run(go)
    done = events[-1]
    assert isinstance(done, GenerationDone) and done.usage.completion_tokens <= 12
    assert done.usage.prompt_tokens == len(backend.engine.tokenizer.encode(prompt))
    # greedy decoding is reproducible: the same request gives the same text
    again = anyio.run(go)
    assert [getattr(e, "text", None) for e in again] == [getattr(e, "text", None) for e in events]


def test_tool_call_arguments_become_objects_for_templates() -> None:
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    assert template_messages(messages)[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # the input is not changed


def test_agent_on_a_random_model_ends_within_its_limits(backend: LocalEngine, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    agent = Agent.coding(backend, workspace=workspace,
                         limits=Limits(max_steps=2, max_tokens_per_step=16, max_wall_s=120))
    reused_before = backend.engine.stats()["reused_tokens"]
    result = anyio.run(agent.run, "Say hello.")
    assert result.stop_reason in ("done", "max_steps")
    assert 1 <= result.steps <= 2 and 0 < result.usage.completion_tokens <= 32
    stats = result.engine_stats
    assert stats["requests"] >= 1 and stats["phase_hints"]["plan"] >= 1
    assert stats["phase"]["current"] in {p.value for p in Phase}
    if result.steps == 2:  # the second call prefilled only what the first left uncovered
        assert stats["reused_tokens"] - reused_before >= result.usage.prompt_tokens // 3
    pooled = {s.id for s in backend.pooled_sessions}  # key-less requests' sessions (earlier tests) stay pooled
    assert set(backend.engine.kv_manager().sessions) <= pooled  # the run's engine session was closed at the end


def test_sessions_reuse_kv_and_take_tool_pauses(backend: LocalEngine) -> None:
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "first question"}]

    async def turn(session: str) -> str:
        request = GenerateRequest(messages=list(messages), max_tokens=6, session=session)
        return "".join([e.text async for e in backend.generate(request) if hasattr(e, "text")])

    before = backend.engine.stats()["reused_tokens"]
    reply = anyio.run(turn, "conv")
    backend.hint(Phase.TOOL, 30.0, session="conv")
    assert backend.pause_decisions[-1] in ("keep", "offload", "drop")
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "second question"}]
    anyio.run(turn, "conv")
    first_prompt = len(backend.engine.tokenizer.encode(backend.render(GenerateRequest(messages=messages[:2]))))
    assert backend.engine.stats()["reused_tokens"] - before >= first_prompt - 16  # page granularity
    backend.end_session("conv")
    assert set(backend.engine.kv_manager().sessions) <= {s.id for s in backend.pooled_sessions}


def test_next_prompt_extends_the_last_prompt_and_the_output(backend: LocalEngine) -> None:
    """Prefix stability: turn N+1's prompt starts with turn N's prompt + what the model wrote (+ end token), so the
    engine's prefix cache only has to prefill the tool result."""
    from freetoken_agent.chat import parse_tool_calls

    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix"}]
    before = backend.render(GenerateRequest(messages=list(messages)))
    output = 'I will read it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "calc.py"}}\n</tool_call>'
    parsed = parse_tool_calls(output, backend.tool_format)
    messages.append({"role": "assistant", "content": parsed.text, "tool_calls": [
        {"id": "call_1_0", "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for c in parsed.calls]})
    messages.append({"role": "tool", "tool_call_id": "call_1_0", "name": "read_file", "content": "1: x = 1"})
    after = backend.render(GenerateRequest(messages=messages))
    assert after.startswith(before + output + "<|im_end|>")
