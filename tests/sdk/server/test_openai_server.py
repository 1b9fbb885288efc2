"""The OpenAI-compatible server, spoken to by the official ``openai`` client over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anyio
import openai
import pytest

from freetoken_agent import Agent, OpenAICompatible, ScriptedBackend
from freetoken_agent.server import serve_in_thread
from tests.sdk.conftest import hermes_call

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
MESSAGES = [{"role": "user", "content": "read calc.py"}]


@pytest.fixture
def served() -> Iterator[tuple[ScriptedBackend, openai.OpenAI]]:
    backend = ScriptedBackend([])
    with serve_in_thread(backend, "tiny-moe") as url:
        yield backend, openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def test_models(served) -> None:
    _backend, client = served
    assert [m.id for m in client.models.list().data] == ["tiny-moe"]


def test_chat_with_a_tool_call(served) -> None:
    backend, client = served
    backend.turns.append(hermes_call("read_file", {"path": "calc.py"}, "Reading it."))
    reply = client.chat.completions.create(model="tiny-moe", messages=MESSAGES, tools=TOOLS, max_tokens=50)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Reading it."
    call = choice.message.tool_calls[0]
    assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"path": "calc.py"}
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens == 2
    assert backend.requests[0].tools == TOOLS and backend.requests[0].max_tokens == 50


def test_streamed_chat_with_tool_calls(served) -> None:
    backend, client = served
    backend.turns.append("Two calls. " + hermes_call("read_file", {"path": "a.py"}) + hermes_call(
        "read_file", {"path": "b.py"}))
    stream = client.chat.completions.create(model="tiny-moe", messages=MESSAGES, tools=TOOLS, stream=True,
                                            stream_options={"include_usage": True})
    text, calls, finish, usage, chunks = "", {}, None, None, 0
    for chunk in stream:
        chunks += 1
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for part in choice.delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
    assert text == "Two calls. " and finish == "tool_calls" and chunks > 5
    assert [(c["name"], json.loads(c["arguments"])) for _i, c in sorted(calls.items())] == [
        ("read_file", {"path": "a.py"}), ("read_file", {"path": "b.py"})]
    assert usage.completion_tokens > 0


def test_streamed_plain_text_and_length(served) -> None:
    backend, client = served
    backend.turns.append("one two three four five six")
    pieces = [c.choices[0] for c in client.chat.completions.create(
        model="tiny-moe", messages=MESSAGES, stream=True, max_tokens=3) if c.choices]
    assert "".join(p.delta.content or "" for p in pieces) == "one two three"
    assert pieces[-1].finish_reason == "length"


def test_unreadable_call_comes_back_as_text(served) -> None:
    backend, client = served
    backend.turns.append('<tool_call>\n{"name": "read_file", "arguments": {"path": }}\n</tool_call>')
    reply = client.chat.completions.create(model="tiny-moe", messages=MESSAGES, tools=TOOLS)
    assert reply.choices[0].message.tool_calls is None
    assert '"path": }' in reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"


def test_completions(served) -> None:
    backend, client = served
    backend.turns += ["return a + b", "x y z"]
    reply = client.completions.create(model="tiny-moe", prompt="def add(a, b):\n    ", max_tokens=16)
    assert reply.choices[0].text == "return a + b" and reply.choices[0].finish_reason == "stop"
    assert backend.requests[0].prompt == "def add(a, b):\n    "
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-moe", prompt="p", max_tokens=2, stream=True))
    assert streamed == "x y"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"messages": []}, "'messages' must not be empty"),
    ({"messages": MESSAGES, "temperature": 9}, "'temperature' must be a number in [0.0, 2.0]"),
    ({"messages": MESSAGES, "max_tokens": 0}, "'max_tokens' must be an integer in [1, "),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "'messages[0].role' must be one of system, developer"),
])
def test_bad_requests_get_one_clear_400(served, kwargs: dict, message: str) -> None:
    _backend, client = served
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-moe", **kwargs)
    assert info.value.status_code == 400 and message in str(info.value)


def test_agent_runs_against_the_server_with_openai_compatible(repo: Path) -> None:
    check = "python -c 'import calc; assert calc.add(2, 3) == 5'"
    model = ScriptedBackend([
        hermes_call("read_file", {"path": "calc.py"}, "Let me read it."),
        hermes_call("edit_file", {"path": "calc.py", "old_string": "return a - b", "new_string": "return a + b"}),
        hermes_call("run_shell", {"command": check}),
        "Fixed the sign in add().",
    ])
    with serve_in_thread(model, "tiny-moe") as url:
        result = anyio.run(Agent.coding(OpenAICompatible(url), workspace=repo).run, "fix add")
    assert result.ok and result.steps == 4 and result.final_message == "Fixed the sign in add()."
    assert (repo / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    assert result.usage.completion_tokens > 0
    # the server saw the whole conversation each time, every request extending the previous one (prefix-stable)
    seen = [r.messages for r in model.requests]
    for before, after in zip(seen, seen[1:]):
        assert after[: len(before)] == before
    tool_results = [m for m in seen[-1] if m["role"] == "tool"]
    assert tool_results[-1]["content"].endswith("exit code: 0")


def test_openai_compatible_reports_an_unreachable_server(repo: Path) -> None:
    backend = OpenAICompatible("http://127.0.0.1:9/v1", model="m")
    result = anyio.run(Agent.coding(backend, workspace=repo).run, "x")
    assert result.stop_reason == "backend_error" and "cannot talk to http://127.0.0.1:9/v1" in result.error


def test_streamed_bad_call_then_good_call(served) -> None:
    backend, client = served
    backend.turns.append('<tool_call>\n{"name": "read_file", "arguments": {"path": }}\n</tool_call>'
                         + hermes_call("read_file", {"path": "ok.py"}))
    calls, text = {}, ""
    for chunk in client.chat.completions.create(model="tiny-moe", messages=MESSAGES, tools=TOOLS, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for part in choice.delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
    # the unreadable call comes back as text; the good one is call 0 with complete arguments
    assert list(calls) == [0] and json.loads(calls[0]["arguments"]) == {"path": "ok.py"}
    assert '"path": }' in text


def test_completions_need_a_text_backend() -> None:
    with serve_in_thread(OpenAICompatible("http://127.0.0.1:9/v1", model="m"), "proxy") as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="serves chat completions only"):
            client.completions.create(model="proxy", prompt="x")


def test_a_request_without_tools_gets_no_tool_calls(served) -> None:
    """What a model writes in its call syntax stays text when the request declared no tools (the hosted APIs never
    answer with a call to a tool the client did not offer; Claude Code would answer it with "No such tool")."""
    backend, client = served
    written = "Let me look. " + hermes_call("bash", {"command": "ls"})
    backend.turns.append(written)
    reply = client.chat.completions.create(model="tiny-moe", messages=MESSAGES, max_tokens=50)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == written
    backend.turns.append(written)
    stream = client.chat.completions.create(model="tiny-moe", messages=MESSAGES, stream=True)
    parts = [(c.delta.content or "", c.delta.tool_calls) for chunk in stream for c in chunk.choices]
    assert "".join(text for text, _ in parts) == written and not any(calls for _, calls in parts)
