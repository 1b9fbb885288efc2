"""``/v1/messages`` spoken to by the official ``anthropic`` client over real HTTP (scripted model output)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import pytest

from freetoken_agent import ScriptedBackend
from freetoken_agent.server import serve_in_thread
from tests.sdk.conftest import hermes_call

TOOLS = [{"name": "read_file", "description": "Read a file.", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
MESSAGES = [{"role": "user", "content": "read calc.py"}]


@pytest.fixture
def served() -> Iterator[tuple[ScriptedBackend, anthropic.Anthropic, str]]:
    backend = ScriptedBackend([], context_length=500)
    with serve_in_thread(backend, "tiny-moe") as url:
        yield backend, anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="unused", max_retries=0), url


def test_a_tool_use_round_trip(served) -> None:
    backend, client, _url = served
    backend.turns += [hermes_call("read_file", {"path": "calc.py"}, "Reading it."), "It adds two numbers."]
    first = client.messages.create(model="tiny-moe", max_tokens=64, system="You are terse.", messages=MESSAGES,
                                   tools=TOOLS)
    assert first.stop_reason == "tool_use" and first.role == "assistant"
    text, use = first.content
    assert text.type == "text" and text.text == "Reading it."
    assert use.type == "tool_use" and use.name == "read_file" and use.input == {"path": "calc.py"}
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    second = client.messages.create(model="tiny-moe", max_tokens=64, tools=TOOLS, messages=[
        *MESSAGES, {"role": "assistant", "content": [c.model_dump() for c in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "def add(a, b): ..."},
                                     {"type": "text", "text": "and?"}]}])
    assert second.stop_reason == "end_turn" and second.content[0].text == "It adds two numbers."
    # what the model saw: the system prompt, the call it made, the tool's result, then the user's text
    seen = backend.requests[1]
    assert seen.tools[0]["function"]["name"] == "read_file" and seen.max_tokens == 64
    assert [m["role"] for m in seen.messages] == ["user", "assistant", "tool", "user"]
    assert seen.messages[1]["tool_calls"][0]["function"]["name"] == "read_file"
    assert seen.messages[2] == {"role": "tool", "tool_call_id": use.id, "content": "def add(a, b): ..."}
    assert backend.requests[0].messages[0] == {"role": "system", "content": "You are terse."}


def test_streaming_event_sequence_and_accumulated_message(served) -> None:
    backend, client, url = served
    backend.turns.append(hermes_call("read_file", {"path": "a.py"}, "Let me look."))
    with client.messages.stream(model="tiny-moe", max_tokens=64, messages=MESSAGES, tools=TOOLS) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].text == "Let me look."
    assert final.content[1].input == {"path": "a.py"} and final.usage.output_tokens > 0
    # the raw wire sequence: message_start, ping, text block, tool block with input_json_delta, delta, stop
    backend.turns.append(hermes_call("read_file", {"path": "b.py"}, "Again."))
    with httpx.stream("POST", f"{url}/messages", json={"model": "tiny-moe", "max_tokens": 64, "stream": True,
                                                        "messages": MESSAGES, "tools": TOOLS}) as r:
        events = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[-2:] == ["message_delta", "message_stop"]
    assert events.count("content_block_start") == events.count("content_block_stop") == 2
    assert "message_start" in kinds and "content_block_delta" in kinds


def test_stop_sequences_and_max_tokens(served) -> None:
    backend, client, _url = served
    backend.turns += ["alpha beta END gamma", "one two three four"]
    stopped = client.messages.create(model="tiny-moe", max_tokens=64, messages=MESSAGES, stop_sequences=["END"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "END"
    assert stopped.content[0].text == "alpha beta "
    cut = client.messages.create(model="tiny-moe", max_tokens=2, messages=MESSAGES)
    assert cut.stop_reason == "max_tokens" and cut.content[0].text == "one two"


def test_count_tokens(served) -> None:
    backend, client, _url = served
    counted = client.messages.count_tokens(model="tiny-moe", messages=[{"role": "user", "content": "a b c d"}],
                                           system="s t")
    assert counted.input_tokens == 6 and not backend.requests  # counted by the backend, nothing generated


def test_errors_are_in_anthropics_shape(served) -> None:
    _backend, client, url = served
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-nonexistent", max_tokens=8, messages=MESSAGES)
    assert "claude-nonexistent" in str(info.value) and info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        client.messages.create(model="tiny-moe", max_tokens=8, messages=[{"role": "user", "content": "w " * 600}])
    with pytest.raises(anthropic.BadRequestError, match="images, audio and files are not supported"):
        client.messages.create(model="tiny-moe", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    missing = httpx.post(f"{url}/messages", json={"model": "tiny-moe", "messages": MESSAGES})
    assert missing.status_code == 400 and missing.json()["error"]["message"] == "'max_tokens' is required"
    reply = httpx.post(f"{url}/messages", json={"model": "tiny-moe", "max_tokens": 8, "messages": MESSAGES,
                                                "temperature": 1.5})
    assert reply.status_code == 400 and reply.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "'temperature' must be a number in [0.0, 1.0], got 1.5"}}


def test_think_tags_become_thinking_blocks(served) -> None:
    backend, client, _url = served
    backend.turns += ["<think>The sign is wrong.</think>Fixed it.", "<think>Again.</think>Done."]
    reply = client.messages.create(model="tiny-moe", max_tokens=64, messages=MESSAGES)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in reply.content] == [
        ("thinking", "The sign is wrong."), ("text", "Fixed it.")]
    with client.messages.stream(model="tiny-moe", max_tokens=64, messages=MESSAGES) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == "Again."


def test_think_splitter_holds_partial_tags() -> None:
    from freetoken_agent.chat import TextDelta
    from freetoken_agent.chat.think import ThinkSplitter

    splitter, out = ThinkSplitter(), []
    for piece in ["<th", "ink>a", "b</th", "in", "k>c <", "d"]:
        out += splitter.feed(TextDelta(piece))
    out += splitter.finish()
    merged: list[tuple[bool, str]] = []
    for d in out:
        if merged and merged[-1][0] == d.reasoning:
            merged[-1] = (d.reasoning, merged[-1][1] + d.text)
        else:
            merged.append((d.reasoning, d.text))
    assert merged == [(True, "ab"), (False, "c <d")]
