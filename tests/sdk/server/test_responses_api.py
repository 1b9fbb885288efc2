"""``/v1/responses`` spoken to by the official ``openai`` client and the OpenAI Agents SDK over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest

from freetoken_agent import ScriptedBackend
from freetoken_agent.server import serve_in_thread
from tests.sdk.conftest import hermes_call

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file.", "strict": False, "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


@pytest.fixture
def served() -> Iterator[tuple[ScriptedBackend, openai.OpenAI, str]]:
    backend = ScriptedBackend([])
    with serve_in_thread(backend, "tiny-moe") as url:
        yield backend, openai.OpenAI(base_url=url, api_key="unused", max_retries=0), url


def test_function_call_round_trip_with_previous_response_id(served) -> None:
    backend, client, _url = served
    backend.turns += [hermes_call("read_file", {"path": "calc.py"}, "Reading."), "It adds."]
    first = client.responses.create(model="tiny-moe", instructions="Be terse.", input="what is in calc.py?",
                                    tools=TOOLS)
    assert first.status == "completed" and [item.type for item in first.output] == ["message", "function_call"]
    call = first.output[1]
    assert call.name == "read_file" and json.loads(call.arguments) == {"path": "calc.py"}
    assert first.output_text == "Reading." and first.usage.output_tokens > 0
    second = client.responses.create(model="tiny-moe", previous_response_id=first.id, tools=TOOLS, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "def add(a, b): ..."}])
    assert second.output_text == "It adds." and second.previous_response_id == first.id
    seen = backend.requests[1].messages  # the stored conversation (instructions do not carry over), the output
    assert [m["role"] for m in seen] == ["user", "assistant", "tool"]
    assert seen[1]["tool_calls"][0]["id"] == call.call_id and seen[2]["content"] == "def add(a, b): ..."
    assert client.responses.retrieve(first.id).id == first.id


def test_streamed_events(served) -> None:
    backend, client, _url = served
    backend.turns.append(hermes_call("read_file", {"path": "a.py"}, "Let me see."))
    events = list(client.responses.create(model="tiny-moe", input="go", tools=TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == "Let me see." and final.output[1].name == "read_file"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Let me see."


def test_item_list_input_and_incomplete(served) -> None:
    backend, client, _url = served
    backend.turns.append("one two three four five")
    reply = client.responses.create(model="tiny-moe", max_output_tokens=2, store=False, input=[
        {"role": "developer", "content": "Count."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]}])
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output_text == "one two"
    assert backend.requests[0].messages == [{"role": "system", "content": "Count."}, {"role": "user", "content": "go"}]
    with pytest.raises(openai.NotFoundError, match="no stored response"):  # store: false keeps nothing
        client.responses.create(model="tiny-moe", previous_response_id=reply.id, input="more")


def test_refusals_name_the_field(served) -> None:
    _backend, _client, url = served
    for body, field in [({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
                        ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format"),  # scripted: no grammar
                        ({"input": [{"type": "message", "role": "user", "content": [
                            {"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0]"),
                        ({"input": "x", "frobnicate": 1}, "frobnicate"),
                        ({"input": 5}, "input")]:
        reply = httpx.post(f"{url}/responses", json={"model": "tiny-moe", **body})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, body


def test_the_agents_sdk_runs_a_tool_round_trip(served) -> None:
    agents = pytest.importorskip("agents")
    backend, _client, url = served
    backend.turns += [hermes_call("add", {"a": 2, "b": 3}), "2 + 3 = 5"]
    seen: list[tuple[int, int]] = []

    @agents.function_tool(strict_mode=False)
    def add(a: int, b: int) -> int:
        """Add two integers."""
        seen.append((a, b))
        return a + b

    async def run() -> Any:
        # the client is closed inside its own event loop: left to the garbage collector, its connection pool's
        # close lands on whatever loop runs then (another test's) after this one is gone: "Event loop is closed"
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            model = agents.OpenAIResponsesModel("tiny-moe", client)
            agent = agents.Agent(name="adder", instructions="Use the tool.", tools=[add], model=model)
            return await agents.Runner.run(agent, "add 2 and 3", run_config=agents.RunConfig(tracing_disabled=True))

    result = anyio.run(run)
    assert result.final_output == "2 + 3 = 5" and seen == [(2, 3)]
    outputs = [m for m in backend.requests[1].messages if m["role"] == "tool"]
    assert outputs and outputs[0]["content"] == "5"
