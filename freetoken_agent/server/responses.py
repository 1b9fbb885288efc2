"""The OpenAI Responses API (``POST /v1/responses``, what Codex CLI and the OpenAI Agents SDK speak): a string or
item-list input with ``instructions`` and function tools is read into chat messages; the answer is output items
(``reasoning``, ``message``, ``function_call``) as one response object or as typed ``response.*`` stream events.
Responses are stored (unless ``store: false``) so a later request can continue one by ``previous_response_id``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from freetoken_agent.backends.base import Constraint, GenerateRequest, GenerationDone, LogprobsDelta
from freetoken_agent.chat import TextDelta, ToolCallFinished
from freetoken_agent.server.fields import Fields, RequestError, type_name
from freetoken_agent.server.protocol import (
    IGNORED, IMAGES, ChatCall, Defaults, anext_or_none, arguments_text, chain, logprob_entry, new_id, one_constraint,
    read_model, logit_controls, response_format, sampling_from, strict_names, strict_tools, tool_choice,
    tool_function,
)

STORE_SIZE = 256
"""Responses kept for ``previous_response_id`` (oldest dropped first)."""
LOGPROBS = "message.output_text.logprobs"
"""The ``include`` entry that asks for the log probabilities of the output text (``top_logprobs`` asks too)."""


@dataclass
class StoredResponse:
    """A finished response: its wire body and the conversation it ends (chat messages, its output included)."""

    body: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore:
    """The last ``STORE_SIZE`` stored responses by id (thread-safe)."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(rid)

    def put(self, rid: str, item: StoredResponse) -> None:
        with self._lock:
            self._items[rid] = item
            while len(self._items) > self.size:
                self._items.popitem(last=False)


@dataclass
class ResponsesCall(ChatCall):
    """A Responses request read from its body, with what its response echoes back."""

    echo: dict[str, Any] = field(default_factory=dict)
    store: bool = True
    namespaces: dict[str, str] = field(default_factory=dict)
    """Tool name → the namespace it was declared in (calls to it name the namespace too)."""


def _content(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise RequestError(f"'{name}' must be a string or an array of content parts, got {type_name(value)}", name)
    out = []
    for i, raw in enumerate(value):
        part = Fields(raw, f"{name}[{i}]", ignored=("annotations", "logprobs"))
        kind = part.str_("type", required=True)
        if kind in ("input_image", "input_file", "input_audio", "image_url"):
            raise RequestError(f"'{name}[{i}]': {IMAGES}", f"{name}[{i}]")
        if kind not in ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"):
            raise RequestError(f"'{name}[{i}].type' {kind[:40]!r} is not a known content type", f"{name}[{i}].type")
        out.append(part.str_("refusal" if kind == "refusal" else "text", required=True) or "")
        part.done()
    return "".join(out)


def _items(raw: list[Any], messages: list[dict[str, Any]]) -> None:
    """Append the input items to ``messages`` (consecutive function calls join one assistant message)."""
    reasoning: list[str] = []
    for i, item in enumerate(raw):
        name = f"input[{i}]"
        f = Fields(item, name, ignored=("id", "status"))
        kind = f.str_("type", "message")
        if kind == "message":
            role = f.str_("role", required=True, choices=("user", "assistant", "system", "developer"))
            text = _content(f.raw("content"), f.name("content"))
            f.done()
            if role == "assistant":
                messages.append({"role": "assistant", "content": text})
                if reasoning:
                    messages[-1]["reasoning_content"], reasoning = "".join(reasoning), []
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            f.str_("namespace")  # the tool's name is unique across namespaces here
            call = {"id": f.str_("call_id", required=True), "type": "function", "function": {
                "name": f.str_("name", required=True), "arguments": arguments_text(f.raw("arguments") or "{}",
                                                                                f.name("arguments"))}}
            f.done()
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":  # calls after a message join its assistant turn
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
            if reasoning:
                last["reasoning_content"], reasoning = "".join(reasoning), []
        elif kind == "function_call_output":
            output = f.raw("output")
            messages.append({"role": "tool", "tool_call_id": f.str_("call_id", required=True),
                             "content": _content(output if output is not None else "", f.name("output"))})
            f.done()
        elif kind == "reasoning":
            for key in ("summary", "content"):
                parts = f.raw(key)
                if parts is not None:
                    reasoning.append(_content(parts, f.name(key)))
            f.str_("encrypted_content")
            f.done()
        else:
            raise RequestError(f"'{name}.type' {kind[:40]!r} is not supported (message, function_call, "
                               "function_call_output, reasoning)", f"{name}.type")


def _tools(raw: list[Any], namespaces: dict[str, str], path: str = "tools") -> list[dict[str, Any]]:
    """Function tools as chat-template tools; a ``namespace`` groups function tools (its name is recorded in
    ``namespaces`` per tool, and calls to them carry it back)."""
    tools = []
    for i, item in enumerate(raw):
        t = Fields(item, f"{path}[{i}]")
        kind = t.str_("type", required=True)
        if kind == "namespace" and path == "tools":
            group = t.str_("name", required=True) or ""
            t.str_("description")
            inner = _tools(t.list_("tools"), namespaces, t.name("tools"))
            t.done()
            for tool in inner:
                namespaces.setdefault(tool["function"]["name"], group)
            tools.extend(inner)
            continue
        if kind != "function":
            hint = ' (Codex: web_search = "disabled")' if kind.startswith("web_search") else ""
            raise RequestError(f"'{path}[{i}].type' {kind[:60]!r} is not supported: only function tools run "
                               f"here{hint}", f"{path}[{i}].type")
        tools.append(tool_function(t))  # name, description, parameters, strict sit on the tool itself
    return tools


def _text_format(f: Fields) -> Constraint | None:
    text = f.obj("text")
    if text is None:
        return None
    constraint = response_format(text.raw("format"), "text.format", flat=True)
    text.refuse_unless("verbosity", "medium", "the model's verbosity cannot be set")
    text.done()
    return constraint


def responses_request(body: Any, defaults: Defaults, store: ResponseStore) -> ResponsesCall:
    """A ``/v1/responses`` body read in full: every field checked, honored or refused."""
    f = Fields(body, ignored=(*IGNORED, "client_metadata"))
    model = read_model(f)
    messages: list[dict[str, Any]] = []
    previous_id = f.str_("previous_response_id")
    if previous_id is not None:
        stored = store.get(previous_id)
        if stored is None:
            raise RequestError(f"no stored response {previous_id[:80]!r} (responses are kept while the server runs, "
                               f"the last {store.size})", "previous_response_id", 404, "not_found_error")
        messages = [m for m in stored.messages if m["role"] != "system"]
    instructions = f.str_("instructions")
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    given = f.raw("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        _items(given, messages)
    else:
        raise RequestError(f"'input' must be a string or an array of items, got {type_name(given)}", "input")
    tool_list = f.list_("tools")
    namespaces: dict[str, str] = {}
    tools = _tools(tool_list, namespaces)
    strict = strict_names(tools)
    single = not f.bool_("parallel_tool_calls", True)
    tools, forced = tool_choice(f.raw("tool_choice"), tools, not single)
    constraint, field = one_constraint(("tool_choice", forced), ("text.format", _text_format(f)))
    strict_tools(constraint, strict)
    reasoning = f.obj("reasoning")
    if reasoning is not None:  # the model reasons as it was trained to; effort and summaries cannot be set
        reasoning.refuse_unless("effort", None, "the model's reasoning effort cannot be set")
        reasoning.str_("summary")
        reasoning.str_("generate_summary")
        reasoning.done()
    stream = f.bool_("stream")
    keep = f.bool_("store", True)
    f.refuse_unless("background", False, "responses run in the foreground")
    f.refuse_unless("truncation", "disabled", "the conversation is never truncated")
    f.refuse_unless("max_tool_calls", None, "the number of tool calls cannot be capped")
    include = f.list_("include", limit=64)
    if not all(isinstance(entry, str) for entry in include):  # others (reasoning.encrypted_content, ...): no effect
        raise RequestError("'include' must be an array of strings", "include")
    top = f.int_("top_logprobs", 0, low=0, high=20)
    logprobs = top if top or LOGPROBS in include else None
    f.refuse_unless("conversation", None, "conversations are kept by previous_response_id only")
    controls, used = logit_controls(f)
    sampling = sampling_from(f, defaults, max_keys=("max_output_tokens",), stop_key=None)
    f.done()
    echo = {"instructions": instructions, "tools": tool_list, "tool_choice": f.body.get("tool_choice") or "auto",
            "parallel_tool_calls": not single, "temperature": sampling["temperature"], "top_p": sampling["top_p"],
            "max_output_tokens": sampling["max_tokens"] if sampling["strict_length"] else None,
            "previous_response_id": previous_id, "store": keep,
            "text": {"format": (f.body.get("text") or {}).get("format") or {"type": "text"}},
            "truncation": "disabled", "metadata": f.body.get("metadata") or {},
            "reasoning": {"effort": None, "summary": None}, "top_logprobs": top}
    if used is None and logprobs is not None:
        used = "top_logprobs" if top else "include"
    request = GenerateRequest(messages=messages, tools=tools, constraint=constraint, logprobs=logprobs, **controls,
                              **sampling)
    return ResponsesCall(request, stream, model=model, single_call=single, constraint_field=field, echo=echo,
                         store=keep, namespaces=namespaces, logits_field=used)


class ResponseRun:
    """One response being produced: output items from backend events, the response object, and its storing."""

    def __init__(self, call: ResponsesCall, model: str, store: ResponseStore) -> None:
        self.call, self.model, self.store = call, model, store
        self.id = new_id("resp").replace("-", "_")
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.seq = 0

    def body(self, status: str, done: GenerationDone | None = None) -> dict[str, Any]:
        """The response object (``in_progress`` while streaming, then ``completed`` or ``incomplete``)."""
        usage = None
        if done is not None:
            u = done.usage
            usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": u.prompt_tokens + u.completion_tokens}
        text = "".join(p["text"] for item in self.output if item["type"] == "message" for p in item["content"])
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": list(self.output), "output_text": text, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "usage": usage, "user": None, **self.call.echo}

    def finish(self, done: GenerationDone) -> dict[str, Any]:
        status = "incomplete" if done.finish_reason == "length" else "completed"
        body = self.body(status, done)
        if self.call.store:
            self.store.put(self.id, StoredResponse(body, self._conversation()))
        return body

    def _conversation(self) -> list[dict[str, Any]]:
        """The request's conversation with this response's output appended as an assistant turn."""
        text = "".join(p["text"] for item in self.output if item["type"] == "message" for p in item["content"])
        turn: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [{"id": item["call_id"], "type": "function", "function": {
            "name": item["name"], "arguments": item["arguments"]}} for item in self.output
            if item["type"] == "function_call"]
        if calls:
            turn["tool_calls"] = calls
        return [*self.call.request.messages, turn]

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    async def whole(self, events: AsyncIterator[Any]) -> dict[str, Any]:
        """The finished response object."""
        async for item in self.stream(events):
            if item["type"] in ("response.completed", "response.incomplete"):
                return item["response"]
        raise AssertionError("the response stream ended without a final event")

    async def stream(self, events: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
        """Typed ``response.*`` events; the last is ``response.completed`` (or ``response.incomplete``).

        With log probabilities asked for, each ``response.output_text.delta`` carries those of the tokens generated
        since the previous delta (the tokens whose text it carries) and the message's ``output_text`` part collects
        them; tokens of reasoning, of tool calls and an end-of-sequence token are no output text and have none."""
        pending: list[Any] = []
        first = await anext_or_none(events)  # the backend accepts or refuses the request before the stream starts
        yield self.event("response.created", response=self.body("in_progress"))
        yield self.event("response.in_progress", response=self.body("in_progress"))
        done = GenerationDone("stop")
        current: dict[str, Any] | None = None  # the open message or reasoning item
        async for number, event in chain(first, events):
            if isinstance(event, LogprobsDelta):
                pending.extend(event.entries)
            elif isinstance(event, TextDelta) and event.text:
                kind = "reasoning" if event.reasoning else "message"
                if current is None or current["type"] != kind:
                    if current is not None:
                        for out in self._close(current):
                            yield out
                    current = self._open(kind)
                    for out in self._opened(current):
                        yield out
                part = current["content"][0]
                part["text"] += event.text
                delta_kind = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                extra = {}
                if kind == "message":
                    extra["logprobs"] = [logprob_entry(t) for t in pending]
                    part["logprobs"].extend(extra["logprobs"])
                pending = []
                yield self.event(delta_kind, item_id=current["id"], output_index=len(self.output) - 1,
                                 content_index=0, delta=event.text, **extra)
            elif isinstance(event, ToolCallFinished):
                pending = []
                if current is not None:
                    for out in self._close(current):
                        yield out
                    current = None
                args = json.dumps(event.arguments, ensure_ascii=False)
                item = {"type": "function_call", "id": f"fc_{self.id[-16:]}{number:02d}",
                        "call_id": f"call_{self.id[-16:]}{number:02d}", "name": event.name, "arguments": args,
                        "status": "completed"}
                if event.name in self.call.namespaces:
                    item["namespace"] = self.call.namespaces[event.name]
                self.output.append(item)
                index = len(self.output) - 1
                yield self.event("response.output_item.added", output_index=index,
                                 item={**item, "arguments": "", "status": "in_progress"})
                yield self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                 delta=args)
                yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 name=event.name, arguments=args)
                yield self.event("response.output_item.done", output_index=index, item=item)
            elif isinstance(event, GenerationDone):
                done = event
        if current is not None:
            for out in self._close(current):
                yield out
        body = self.finish(done)
        yield self.event(f"response.{body['status']}", response=body)

    def _open(self, kind: str) -> dict[str, Any]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": f"rs_{self.id[-16:]}{len(self.output):02d}", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        else:
            item = {"type": "message", "id": f"msg_{self.id[-16:]}{len(self.output):02d}", "role": "assistant",
                    "status": "in_progress", "content": [{"type": "output_text", "text": "", "annotations": [],
                                                          "logprobs": []}]}
        self.output.append(item)
        return item

    def _opened(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        index = len(self.output) - 1
        empty = {**item, "content": []}
        out = [self.event("response.output_item.added", output_index=index, item=empty)]
        part = {**item["content"][0], "text": ""}
        if "logprobs" in part:
            part["logprobs"] = []  # the item's own list fills as the text comes
        out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                              content_index=0, part=part))
        return out

    def _close(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        index = self.output.index(item)
        item["status"] = "completed"
        part = item["content"][0]
        done_kind = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": part["logprobs"]}
        return [self.event(done_kind, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                           **extra),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]
