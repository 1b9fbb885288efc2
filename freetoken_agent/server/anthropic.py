"""The Anthropic Messages API (``POST /v1/messages``, what Claude Code speaks): requests read into the server's one
conversation form (OpenAI chat messages, which chat templates render), answers written as a message or as the
event stream ``message_start``, ``content_block_start/delta/stop`` (text, thinking, tool use with
``input_json_delta``), ``message_delta``, ``message_stop``, with ``ping`` keep-alives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from collections.abc import AsyncIterator
from typing import Any

from freetoken_agent.backends.base import Constraint, GenerateRequest, GenerationDone
from freetoken_agent.chat import TextDelta, ToolCallFinished
from freetoken_agent.server.fields import Fields, RequestError, stop_list, type_name
from freetoken_agent.server.protocol import (
    IMAGES, ChatCall, Defaults, one_constraint, read_model, sampling_from, strict_names, strict_tools,
)

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
IGNORED = ("metadata", "service_tier", "container", "anthropic_version")


def _text(value: Any, name: str) -> str:
    """A string, or text blocks (``[{"type": "text", "text": ...}]``) joined; images are refused."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise RequestError(f"'{name}' must be a string or an array of content blocks, got {type_name(value)}", name)
    out = []
    for i, raw in enumerate(value):
        block = Fields(raw, f"{name}[{i}]", ignored=("cache_control", "citations"))
        kind = block.str_("type", required=True)
        if kind in ("image", "document", "search_result"):
            raise RequestError(f"'{name}[{i}]': {IMAGES}", f"{name}[{i}]")
        if kind != "text":
            raise RequestError(f"'{name}[{i}].type' must be text here, got {kind[:40]!r}", f"{name}[{i}].type")
        out.append(block.str_("text", required=True) or "")
        block.done()
    return "\n\n".join(out) if name.endswith("system") else "".join(out)


def _user(blocks: list[Any], name: str) -> list[dict[str, Any]]:
    """A user turn: its tool results first (one ``tool`` message each), then its text as one user message."""
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for i, raw in enumerate(blocks):
        block = Fields(raw, f"{name}[{i}]", ignored=("cache_control", "citations"))
        kind = block.str_("type", required=True)
        if kind == "tool_result":
            content = block.raw("content")
            result = _text(content, block.name("content")) if content is not None else ""
            if block.bool_("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": block.str_("tool_use_id", required=True), "content": result})
        elif kind == "text":
            text.append(block.str_("text", required=True) or "")
        elif kind in ("image", "document", "search_result"):
            raise RequestError(f"'{name}[{i}]': {IMAGES}", f"{name}[{i}]")
        else:
            raise RequestError(f"'{name}[{i}].type' {kind[:40]!r} is not a user content block (text, tool_result)",
                               f"{name}[{i}].type")
        block.done()
    if text:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(blocks: list[Any], name: str) -> dict[str, Any]:
    """An assistant turn: text, ``tool_use`` blocks as tool calls, thinking as ``reasoning_content``."""
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, raw in enumerate(blocks):
        block = Fields(raw, f"{name}[{i}]", ignored=("cache_control", "citations", "signature", "caller"))
        kind = block.str_("type", required=True)
        if kind == "text":
            text.append(block.str_("text", required=True) or "")
        elif kind == "tool_use":
            args = block.raw("input")
            if not isinstance(args, dict):
                raise RequestError(f"'{block.name('input')}' must be an object, got {type_name(args)}",
                                   block.name("input"))
            calls.append({"id": block.str_("id", required=True), "type": "function", "function": {
                "name": block.str_("name", required=True), "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "thinking":
            thinking.append(block.str_("thinking", required=True) or "")
        elif kind == "redacted_thinking":
            block.str_("data")  # opaque by definition: nothing the model can read
        else:
            raise RequestError(f"'{name}[{i}].type' {kind[:40]!r} is not an assistant content block "
                               "(text, tool_use, thinking)", f"{name}[{i}].type")
        block.done()
    out: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        out["tool_calls"] = calls
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    return out


def _messages(raw: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        m = Fields(item, f"messages[{i}]")
        role = m.str_("role", required=True, choices=("user", "assistant", "system"))
        content = m.raw("content")
        m.done()
        name = f"messages[{i}].content"
        if role == "system":  # context added mid-conversation: chat templates take a system turn only first
            text = _text(content, name)
            if out and out[-1]["role"] == "user":
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{text}"}
            else:
                out.append({"role": "user", "content": text})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"'{name}' must be a string or an array of content blocks, got {type_name(content)}",
                               name)
        out.extend(_user(content, name) if role == "user" else [_assistant(content, name)])
    return out


def _tools(raw: list[Any]) -> list[dict[str, Any]]:
    tools = []
    for i, item in enumerate(raw):
        t = Fields(item, f"tools[{i}]", ignored=("cache_control",))
        kind = t.str_("type", "custom")
        if kind != "custom":
            raise RequestError(f"'tools[{i}].type' {kind[:60]!r} is not supported: only client tools (with an "
                               "input_schema) run here", f"tools[{i}].type")
        schema = t.raw("input_schema")
        if not isinstance(schema, dict):
            raise RequestError(f"'tools[{i}].input_schema' must be a JSON Schema object", f"tools[{i}].input_schema")
        fn: dict[str, Any] = {"name": t.str_("name", required=True), "parameters": schema}
        if t.has("description"):
            fn["description"] = t.str_("description")
        if t.bool_("strict"):
            fn["strict"] = True
        t.done()
        tools.append({"type": "function", "function": fn})
    return tools


def _tool_choice(f: Fields, tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool, Constraint | None]:
    """The tools ``tool_choice`` leaves, whether one call at most is wanted (``disable_parallel_tool_use``) and the
    forced call (``any``: one of the tools, ``tool``: the named one), which is grammar-constrained."""
    choice = f.obj("tool_choice")
    if choice is None:
        return tools, False, None
    kind = choice.str_("type", required=True, choices=("auto", "any", "tool", "none"))
    single = choice.bool_("disable_parallel_tool_use")
    name = choice.str_("name", required=kind == "tool") if kind == "tool" else None
    choice.done()
    if kind in ("auto", "none"):
        return ([] if kind == "none" else tools), single, None
    if not tools:
        raise RequestError("'tool_choice' forces a tool call but no tools are given", "tool_choice")
    if name is not None and name not in [t["function"]["name"] for t in tools]:
        raise RequestError(f"'tool_choice.name' {name[:80]!r} is not among the tools", "tool_choice.name")
    return tools, single, Constraint("tool_call", name=name, parallel=not single)


def _thinking(f: Fields) -> bool:
    """Whether thinking blocks are wanted (the model's reasoning channel, when it has one, is shown or dropped)."""
    t = f.obj("thinking")
    if t is None:
        return True
    kind = t.str_("type", required=True, choices=("enabled", "disabled", "adaptive"))
    t.int_("budget_tokens", low=0)  # the model reasons as it was trained to; a budget cannot be imposed
    t.done()
    return kind != "disabled"


def _context_management(f: Fields) -> None:
    """Context edits: only ``clear_thinking`` keeping every turn's thinking (a no-op: nothing is cleared)."""
    cm = f.obj("context_management")
    if cm is None:
        return
    for i, raw in enumerate(cm.list_("edits")):
        edit = Fields(raw, f"context_management.edits[{i}]")
        kind = edit.str_("type", required=True)
        if kind != "clear_thinking_20251015" or edit.raw("keep") != "all":
            raise RequestError(f"'context_management.edits[{i}]' is not supported: context editing is not "
                               "implemented (only clear_thinking with keep \"all\", which clears nothing)",
                               f"context_management.edits[{i}]")
        edit.done()
    cm.done()


def _output_config(f: Fields) -> Constraint | None:
    """Output settings: effort ``high`` (the API's default: the model reasons as much as it was trained to) and a
    ``json_schema`` format (grammar-constrained)."""
    oc = f.obj("output_config")
    if oc is None:
        return None
    oc.refuse_unless("effort", "high", "the model's effort cannot be lowered")
    fmt = oc.obj("format")
    oc.done()
    if fmt is None:
        return None
    fmt.str_("type", required=True, choices=("json_schema",))
    schema = fmt.raw("schema")
    if not isinstance(schema, dict):
        raise RequestError("'output_config.format.schema' must be a JSON Schema object", "output_config.format.schema")
    fmt.done()
    return Constraint("json", schema)


@dataclass
class MessagesCall(ChatCall):
    """A Messages request read from its body; ``thinking``: show the model's reasoning as thinking blocks."""

    thinking: bool = True


def messages_request(body: Any, defaults: Defaults, count_only: bool = False) -> MessagesCall:
    """A ``/v1/messages`` (or ``count_tokens``) body read in full: every field checked, honored or refused."""
    f = Fields(body, ignored=IGNORED)
    model = read_model(f)
    if model is None:
        raise RequestError("'model' is required", "model")
    messages = _messages(f.list_("messages", required=True, allow_empty=False))
    if f.has("system"):
        messages.insert(0, {"role": "system", "content": _text(f.raw("system"), "system")})
    tools = _tools(f.list_("tools"))
    strict = strict_names(tools)
    tools, single, forced = _tool_choice(f, tools)
    thinking = _thinking(f)
    f.refuse_unless("mcp_servers", [], "MCP servers are not connected by this server")
    _context_management(f)
    constraint, field = one_constraint(("tool_choice", forced), ("output_config.format", _output_config(f)))
    strict_tools(constraint, strict)
    if count_only:
        f.done()
        return MessagesCall(GenerateRequest(messages=messages, tools=tools), model=model)
    if not f.has("max_tokens"):
        raise RequestError("'max_tokens' is required", "max_tokens")
    sampling = sampling_from(f, defaults, max_keys=("max_tokens",), stop_key=None, temperature_max=1.0)
    sampling["stop"] = stop_list(f.raw("stop_sequences"), "stop_sequences", limit=64)
    stream = f.bool_("stream")
    f.done()
    return MessagesCall(GenerateRequest(messages=messages, tools=tools, constraint=constraint, **sampling), stream,
                        model=model, single_call=single, constraint_field=field, thinking=thinking)


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"input_tokens": prompt, "output_tokens": completion, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}


def _stop(done: GenerationDone, any_call: bool) -> tuple[str, str | None]:
    if done.stop_sequence is not None:
        return "stop_sequence", done.stop_sequence
    return ("tool_use" if any_call else STOP_REASONS.get(done.finish_reason, "end_turn")), None


def tool_id(mid: str, number: int) -> str:
    """A tool-use id unique to this message."""
    return f"toolu_{mid[-12:]}{number:02d}"


async def whole_message(events: AsyncIterator[Any], mid: str, model: str, thinking: bool = True) -> dict[str, Any]:
    """The whole answer as one Messages-API message."""
    content: list[dict[str, Any]] = []
    done, any_call = GenerationDone("stop"), False
    async for number, event in events:
        if isinstance(event, TextDelta) and event.text:
            kind = "thinking" if event.reasoning else "text"
            if event.reasoning and not thinking:
                continue
            if content and content[-1]["type"] == kind:
                content[-1][kind] += event.text
            else:
                content.append({"type": kind, kind: event.text, **({"signature": ""} if event.reasoning else {})})
        elif isinstance(event, ToolCallFinished):
            any_call = True
            content.append({"type": "tool_use", "id": tool_id(mid, number), "name": event.name,
                            "input": event.arguments})
        elif isinstance(event, GenerationDone):
            done = event
    reason, sequence = _stop(done, any_call)
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(done.usage.prompt_tokens, done.usage.completion_tokens)}


async def stream_events(events: AsyncIterator[Any], mid: str, model: str, prompt_tokens: int,
                        thinking: bool = True) -> AsyncIterator[dict[str, Any]]:
    """The answer as Messages-API stream events (dicts with their ``type``)."""
    from freetoken_agent.server.protocol import anext_or_none, chain

    first = await anext_or_none(events)  # the backend accepts or refuses the request before the stream starts
    yield {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": usage(prompt_tokens, 0)}}
    yield {"type": "ping"}
    index, open_kind = -1, None
    done, any_call = GenerationDone("stop"), False

    def close() -> dict[str, Any]:
        return {"type": "content_block_stop", "index": index}

    async for number, event in chain(first, events):
        if isinstance(event, TextDelta) and event.text and (thinking or not event.reasoning):
            kind = "thinking" if event.reasoning else "text"
            if open_kind != kind:
                if open_kind is not None:
                    yield close()
                index, open_kind = index + 1, kind
                block = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
                yield {"type": "content_block_start", "index": index, "content_block": block}
            yield {"type": "content_block_delta", "index": index,
                   "delta": {"type": f"{kind}_delta", kind: event.text}}
        elif isinstance(event, ToolCallFinished):
            if open_kind is not None:
                yield close()
            any_call, index, open_kind = True, index + 1, None
            yield {"type": "content_block_start", "index": index, "content_block": {
                "type": "tool_use", "id": tool_id(mid, number), "name": event.name, "input": {}}}
            yield {"type": "content_block_delta", "index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(event.arguments, ensure_ascii=False)}}
            yield close()
        elif isinstance(event, GenerationDone):
            done = event
    if open_kind is not None:
        yield close()
    reason, sequence = _stop(done, any_call)
    yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
           "usage": {"input_tokens": done.usage.prompt_tokens or prompt_tokens,
                     "output_tokens": done.usage.completion_tokens}}
    yield {"type": "message_stop"}
