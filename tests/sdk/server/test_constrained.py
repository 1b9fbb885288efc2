"""Grammar-constrained decoding on the built-in model over real HTTP: a forced tool call always parses and its
arguments always validate against the tool's schema; a json_schema response always validates — at temperature 1,
over many seeds (what the unconstrained model writes for the same requests mostly does not)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

pytest.importorskip("llguidance")

from freetoken_agent.backends.local import LocalEngine  # noqa: E402
from freetoken_agent.runtime.models import resolve_model  # noqa: E402
from freetoken_agent.server import serve_in_thread  # noqa: E402

EDIT = {"type": "object", "properties": {
    "path": {"type": "string", "maxLength": 24},
    "line": {"type": "integer", "minimum": 1, "maximum": 9999},
    "mode": {"enum": ["insert", "replace"]}}, "required": ["path", "line", "mode"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "edit_line", "description": "Edit one line.", "parameters": EDIT}},
         {"type": "function", "function": {"name": "run_tests", "description": "Run the tests.", "parameters": {
             "type": "object", "properties": {"k": {"type": "string", "maxLength": 12}}, "required": ["k"],
             "additionalProperties": False}}}]
ANSWER = {"type": "object", "properties": {
    "verdict": {"enum": ["bug", "feature", "question"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    "files": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["verdict", "confidence", "files"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "The add() function in calc.py returns a - b. Fix it."}]
SEEDS = range(6)


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    import torch

    torch.set_num_threads(1)
    backend = LocalEngine.from_pretrained(resolve_model("builtin"))
    with serve_in_thread(backend, "builtin") as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)


def test_required_tool_choice_always_gives_a_schema_valid_call(client: openai.OpenAI) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in SEEDS:
        reply = client.chat.completions.create(model="builtin", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, temperature=1.0, seed=seed,
                                               max_tokens=120)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, (seed, choice)
        call = choice.message.tool_calls[0].function
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_a_named_tool_is_the_one_called(client: openai.OpenAI) -> None:
    for seed in SEEDS[:3]:
        reply = client.chat.completions.create(
            model="builtin", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=60,
            tool_choice={"type": "function", "function": {"name": "run_tests"}})
        calls = reply.choices[0].message.tool_calls
        assert calls and {c.function.name for c in calls} == {"run_tests"}
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])


def test_json_schema_responses_always_validate(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "triage", "schema": ANSWER, "strict": True}}
    for seed in SEEDS:
        reply = client.chat.completions.create(model="builtin", messages=MESSAGES, response_format=fmt,
                                               temperature=1.0, seed=seed, max_tokens=120)
        assert reply.choices[0].finish_reason == "stop", reply
        jsonschema.validate(json.loads(reply.choices[0].message.content), ANSWER)
    # the Responses API's text.format takes the same constraint (seeded like the above: unseeded, a sampled number
    # could run past the token limit now and then, and a cut document is no JSON)
    for seed in SEEDS:
        out = client.responses.create(model="builtin", input="Triage: add() subtracts.", temperature=1.0,
                                      max_output_tokens=120, extra_body={"seed": seed},
                                      text={"format": {"type": "json_schema", "name": "triage", "schema": ANSWER}})
        assert out.status == "completed", out
        jsonschema.validate(json.loads(out.output_text), ANSWER)


def test_unconstrained_output_is_what_the_constraint_fixes(client: openai.OpenAI) -> None:
    """The same requests without a constraint: the model's own text is rarely valid (so the tests above test
    the grammar, not the model)."""
    valid = 0
    for seed in SEEDS[:3]:
        text = client.chat.completions.create(model="builtin", messages=MESSAGES, temperature=1.0, seed=seed,
                                              max_tokens=40).choices[0].message.content or ""
        try:
            jsonschema.validate(json.loads(text), ANSWER)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    assert valid < 3
