"""OpenAI wire shapes: reading requests, writing responses and stream chunks (plain dicts, no framework)."""

from __future__ import annotations

import json
import time
import uuid
import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from freetoken_agent.backends.base import Constraint, GenerateRequest, TokenLogprobs
from freetoken_agent.server.fields import Fields, RequestError, stop_list, type_name

__all__ = ["ChatCall", "RequestError", "chat_request", "completion_request", "envelope", "error_body", "new_id",
           "usage_dict", "anext_or_none", "chain", "merged", "choice_request", "logprob_entry", "chat_logprobs",
           "text_logprobs"]


IMAGES = "images, audio and files are not supported: the model reads text only"
IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
"""Fields accepted without effect: bookkeeping for a hosted service that a local server has no use for."""


@dataclass
class ChatCall:
    """A request read from a body, and how to answer it."""

    request: GenerateRequest
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    single_call: bool = False
    """``parallel_tool_calls: false``: the answer ends after the first tool call."""
    constraint_field: str | None = None
    """The field that asked for ``request.constraint`` (named when a backend cannot enforce it)."""
    logits_field: str | None = None
    """The first logits-level control the request sets (named when a backend cannot honor them)."""
    n: int = 1
    """Choices to generate (independent samples, streamed or not; see :func:`choice_request`)."""


def choice_request(request: GenerateRequest, index: int) -> GenerateRequest:
    """The request of choice ``index`` of an ``n``-choice request: seed ``seed + index`` (mod 2**63), so choices
    differ from one another and a request with a seed reproduces every one of them; without a seed each choice
    draws its own."""
    if not index or request.seed is None:
        return request
    return replace(request, seed=(request.seed + index) % 2**63)


def read_model(f: Fields) -> str | None:
    """The ``model`` field (checked against the served model by the app)."""
    return f.str_("model")


def logit_controls(f: Fields) -> tuple[dict[str, Any], str | None]:
    """Penalties (OpenAI's frequency/presence and the ``repetition_penalty`` extension of vLLM and llama.cpp),
    ``logit_bias`` and ``min_p`` (checked), and the first of them set to a non-neutral value (the field named when a
    backend cannot honor logits-level controls)."""
    repetition = f.num("repetition_penalty", 1.0, 0.0, 10.0)
    if repetition == 0:
        raise RequestError("'repetition_penalty' must be greater than 0 (1 is off)", "repetition_penalty")
    out: dict[str, Any] = {"frequency_penalty": f.num("frequency_penalty", 0.0, -2.0, 2.0),
                           "presence_penalty": f.num("presence_penalty", 0.0, -2.0, 2.0),
                           "min_p": f.num("min_p", 0.0, 0.0, 1.0), "repetition_penalty": repetition}
    bias = f.raw("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > 1024:
            raise RequestError("'logit_bias' must be an object of at most 1024 token ids to numbers", "logit_bias")
        clean: dict[int, float] = {}
        for key, value in bias.items():
            if not key.isdigit() or len(key) > 9 or isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not -100 <= value <= 100:
                raise RequestError(f"'logit_bias' maps token ids to numbers in [-100, 100]; got {key[:20]!r}: "
                                   f"{value!r:.40}", "logit_bias")
            clean[int(key)] = float(value)
        out["logit_bias"] = clean
    used = next((k for k in ("repetition_penalty", "frequency_penalty", "presence_penalty", "min_p", "logit_bias")
                 if out.get(k) and (k != "repetition_penalty" or out[k] != 1.0)), None)
    return out, used


@dataclass(frozen=True)
class Defaults:
    """What a request that leaves a field out gets: the server's completion length and the model's own sampling
    defaults (its ``generation_config.json``; greedy when it has none)."""

    max_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0


def sampling_from(f: Fields, defaults: Defaults, max_keys: tuple[str, ...] = ("max_completion_tokens",
                  "max_tokens"), stop_key: str | None = "stop", temperature_max: float = 2.0) -> dict[str, Any]:
    """Sampling fields shared by every endpoint, checked: max tokens (the first of ``max_keys`` present),
    temperature, top_p, top_k, seed, stop strings; fields left out take ``defaults``."""
    max_tokens = None
    for key in max_keys:
        value = f.int_(key, low=1)
        max_tokens = value if max_tokens is None else max_tokens
    seed = f.int_("seed")
    top_k = f.int_("top_k", defaults.top_k, low=-1, high=1_000_000)
    out = {"max_tokens": max_tokens or defaults.max_tokens, "strict_length": max_tokens is not None,
           "temperature": f.num("temperature", min(defaults.temperature, temperature_max), 0.0, temperature_max),
           "top_p": f.num("top_p", defaults.top_p, 0.0, 1.0), "top_k": max(top_k or 0, 0), "seed": seed}
    if stop_key is not None:
        out["stop"] = stop_list(f.raw(stop_key), f.name(stop_key))
    return out


def _text_parts(value: Any, name: str) -> str:
    """Chat content: a string, null, or text parts (``[{"type": "text", "text": ...}]``) joined."""
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise RequestError(f"'{name}' must be a string or an array of content parts, got {type_name(value)}", name)
    out = []
    for i, raw in enumerate(value):
        part = Fields(raw, f"{name}[{i}]")
        kind = part.str_("type", required=True)
        if kind in ("image_url", "input_audio", "file", "image", "input_image", "input_file"):
            raise RequestError(f"'{name}[{i}]': {IMAGES}", f"{name}[{i}]")
        if kind not in ("text", "input_text", "output_text", "refusal"):
            raise RequestError(f"'{name}[{i}].type' {kind!r} is not a known content part type", f"{name}[{i}].type")
        out.append(part.str_("refusal" if kind == "refusal" else "text", required=True) or "")
        part.raw("annotations")
        part.raw("cache_control")
        part.done()
    return "".join(out)


def arguments_text(value: Any, name: str) -> str:
    """Tool-call arguments: a JSON string (OpenAI) or an object, returned as a string."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        raise RequestError(f"'{name}' must be a string of JSON, got {type_name(value)}", name)
    return value


def _tool_calls(value: Any, name: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise RequestError(f"'{name}' must be an array of tool calls, got {type_name(value)}", name)
    calls = []
    for i, raw in enumerate(value):
        call = Fields(raw, f"{name}[{i}]")
        call.str_("type", "function", choices=("function",))
        fn = call.obj("function")
        if fn is None:
            raise RequestError(f"'{name}[{i}].function' is required", f"{name}[{i}].function")
        entry = {"id": call.str_("id") or f"call_{i}", "type": "function", "function": {
            "name": fn.str_("name", required=True), "arguments": arguments_text(fn.raw("arguments") or "{}",
                                                                            fn.name("arguments"))}}
        fn.done()
        call.done()
        calls.append(entry)
    return calls


def chat_message(raw: Any, name: str) -> dict[str, Any]:
    """One OpenAI chat message, checked and normalized (content as text)."""
    m = Fields(raw, name)
    role = m.str_("role", required=True, choices=("system", "developer", "user", "assistant", "tool"))
    out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": _text_parts(m.raw("content"), m.name("content"))}
    if m.has("name"):
        out["name"] = m.str_("name")
    if role == "assistant":
        if m.has("tool_calls"):
            out["tool_calls"] = _tool_calls(m.raw("tool_calls"), m.name("tool_calls"))
        if m.has("reasoning_content"):
            out["reasoning_content"] = m.str_("reasoning_content")
        m.refuse_unless("refusal", None, "send the refusal as content")
    if role == "tool":
        out["tool_call_id"] = m.str_("tool_call_id", required=True)
    m.done()
    return out


def function_tool(raw: Any, name: str) -> dict[str, Any]:
    """One ``{"type": "function", "function": {name, description, parameters}}`` tool, checked."""
    t = Fields(raw, name)
    t.str_("type", "function", choices=("function",))
    fn = t.obj("function")
    if fn is None:
        raise RequestError(f"'{name}.function' is required", f"{name}.function")
    tool = tool_function(fn)
    t.done()
    return tool


def tool_function(fn: Fields) -> dict[str, Any]:
    """The function part of a tool (name, description, JSON-Schema parameters) as a chat-template tool."""
    out: dict[str, Any] = {"name": fn.str_("name", required=True)}
    if fn.has("description"):
        out["description"] = fn.str_("description")
    params = fn.raw("parameters")
    if params is not None and not isinstance(params, dict):
        raise RequestError(f"'{fn.name('parameters')}' must be a JSON Schema object", fn.name("parameters"))
    out["parameters"] = params if params is not None else {"type": "object", "properties": {}}
    if fn.bool_("strict"):
        out["strict"] = True
    fn.done()
    return {"type": "function", "function": out}


def strict_names(tools: list[dict[str, Any]], path: str = "tools") -> list[str]:
    """The fields of the tools marked strict (for ``strict_tools``); the marks are taken off the tools."""
    names = []
    for i, tool in enumerate(tools):
        if tool["function"].pop("strict", False):
            names.append(f"{path}[{i}].strict")
    return names


NO_GRAMMAR = "constrained decoding, which this backend lacks"


def tool_choice(choice: Any, tools: list[dict[str, Any]], parallel: bool, name: str = "tool_choice",
                ) -> tuple[list[dict[str, Any]], Constraint | None]:
    """The tools ``tool_choice`` leaves and the constraint it asks for: ``auto`` keeps the tools, ``none`` drops
    them, ``required`` forces a call to one of them, a named function forces that one (grammar-constrained)."""
    if choice is None or choice == "auto":
        return tools, None
    if choice == "none":
        return [], None
    if choice == "required":
        forced = None
    elif isinstance(choice, dict):
        f = Fields(choice, name)
        f.str_("type", required=True, choices=("function",))
        fn = f.obj("function")
        forced = fn.str_("name", required=True) if fn is not None else f.str_("name", required=True)
        if fn is not None:
            fn.done()
        f.done()
        if forced not in [t["function"]["name"] for t in tools]:
            raise RequestError(f"'{name}' names {str(forced)[:80]!r}, which is not among the tools", name)
    else:
        raise RequestError(f"'{name}' must be \"auto\", \"none\", \"required\" or a named function", name)
    if not tools:
        raise RequestError(f"'{name}' forces a tool call but no tools are given", name)
    return tools, Constraint("tool_call", name=forced, parallel=parallel)


def response_format(value: Any, name: str = "response_format", flat: bool = False) -> Constraint | None:
    """The JSON constraint of a response format (None for plain text). ``flat``: the Responses API's
    ``text.format`` shape (name and schema beside the type, not under ``json_schema``)."""
    if value is None:
        return None
    f = Fields(value, name)
    kind = f.str_("type", required=True, choices=("text", "json_object", "json_schema"))
    if kind == "text":
        f.done()
        return None
    if kind == "json_object":
        f.done()
        return Constraint("json", {"type": "object"})
    spec = f if flat else f.obj("json_schema")
    if spec is None:
        raise RequestError(f"'{name}.json_schema' is required", f"{name}.json_schema")
    spec.str_("name")
    spec.str_("description")
    spec.bool_("strict")  # the output always follows the schema, strict or not
    schema = spec.raw("schema")
    if not isinstance(schema, dict):
        raise RequestError(f"'{spec.name('schema')}' must be a JSON Schema object", spec.name("schema"))
    spec.done()
    if not flat:
        f.done()
    return Constraint("json", schema)


def one_constraint(*named: tuple[str, Constraint | None]) -> tuple[Constraint | None, str | None]:
    """The one constraint given and the field that asked for it (two at once are refused)."""
    given = [(field, c) for field, c in named if c is not None]
    if len(given) > 1:
        raise RequestError(f"'{given[0][0]}' and '{given[1][0]}' cannot both constrain the output", given[1][0])
    return (given[0][1], given[0][0]) if given else (None, None)


def strict_tools(constraint: Constraint | None, strict: list[str]) -> None:
    """Strict tools are honored when the call is grammar-constrained (a forced call); else refused by name."""
    if strict and (constraint is None or constraint.kind != "tool_call"):
        raise RequestError(f"'{strict[0]}' is not supported: strict arguments are guaranteed only for a forced "
                           "call (tool_choice required or named)", strict[0])


def _stream_options(f: Fields, stream: bool) -> bool:
    opts = f.obj("stream_options")
    if opts is None:
        return False
    usage = opts.bool_("include_usage")
    opts.bool_("include_obfuscation")
    opts.done()
    if not stream:
        raise RequestError("'stream_options' is only allowed with 'stream': true", "stream_options")
    return usage


def chat_request(body: Any, defaults: Defaults) -> ChatCall:
    """A ``/v1/chat/completions`` body read in full (every field checked, honored or refused)."""
    f = Fields(body, ignored=IGNORED)
    model = read_model(f)
    messages = [chat_message(m, f"messages[{i}]") for i, m in enumerate(f.list_("messages", required=True,
                                                                                 allow_empty=False))]
    tools = [function_tool(t, f"tools[{i}]") for i, t in enumerate(f.list_("tools"))]
    strict = strict_names(tools)
    single = not f.bool_("parallel_tool_calls", True)
    tools, forced = tool_choice(f.raw("tool_choice"), tools, not single)
    constraint, field = one_constraint(("tool_choice", forced),
                                       ("response_format", response_format(f.raw("response_format"))))
    strict_tools(constraint, strict)
    stream = f.bool_("stream")
    usage = _stream_options(f, stream)
    n = f.int_("n", 1, low=1, high=16)
    top = f.int_("top_logprobs", 0, low=0, high=20)
    logprobs = top if f.bool_("logprobs") else None
    if top and logprobs is None:
        raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    controls, used = logit_controls(f)
    f.refuse_unless("reasoning_effort", None, "the model's reasoning effort cannot be set")
    f.refuse_unless("modalities", ["text"], "text output only")
    sampling = sampling_from(f, defaults)
    f.done()
    request = GenerateRequest(messages=messages, tools=tools, constraint=constraint, logprobs=logprobs, **controls,
                              **sampling)
    return ChatCall(request, stream, usage, model, single, field, used or ("logprobs" if logprobs is not None
                                                                           else None), n)


def completion_request(body: Any, defaults: Defaults) -> ChatCall:
    """A ``/v1/completions`` body (one prompt) read in full."""
    f = Fields(body, ignored=IGNORED)
    model = read_model(f)
    prompt = f.raw("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("'prompt' must be a string (one prompt per request)", "prompt")
    stream = f.bool_("stream")
    usage = _stream_options(f, stream)
    f.refuse_unless("echo", False, "the prompt is not echoed")
    f.refuse_unless("best_of", 1, "one candidate per request")
    f.refuse_unless("suffix", None, "fill-in-the-middle is not supported")
    logprobs = f.int_("logprobs", None, low=0, high=5)
    n = f.int_("n", 1, low=1, high=16)
    controls, used = logit_controls(f)
    sampling = sampling_from(f, defaults, max_keys=("max_tokens",))
    f.done()
    request = GenerateRequest(prompt=prompt, logprobs=logprobs, **controls, **sampling)
    return ChatCall(request, stream, usage, model, logits_field=used or ("logprobs" if logprobs is not None else None),
                    n=n)


async def anext_or_none(events: AsyncIterator[Any]) -> Any:
    """The first item of ``events`` (None when it is empty): pulling it makes the backend accept or refuse the
    request before a streamed response starts."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``first`` (unless None), then the rest of ``rest``."""
    if first is not None:
        yield first
    async for item in rest:
        yield item


async def merged(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """The items of several streams as (stream index, item) in the order they come, the streams pulled at once
    (each by its own task, so the engine batches the requests behind them).

    Nothing is yielded until every stream has given its first item (or ended), so a request the backend refuses is
    refused before a response starts. An error in any stream cancels the others and is raised here; closing this
    generator cancels them all (and with them their generations). One stream is read in place, without tasks.
    """
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    end = object()

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item, None))
            await queue.put((index, end, None))
        except Exception as exc:  # raised to the reader, which cancels the rest
            await queue.put((index, end, exc))
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        started: set[int] = set()
        held: list[tuple[int, Any]] = []  # items waiting until every stream has started
        open_ = len(streams)
        while open_:
            index, item, exc = await queue.get()
            if exc is not None:
                raise exc
            started.add(index)
            if item is end:
                open_ -= 1
            else:
                held.append((index, item))
            if len(started) == len(streams):  # from then on each item passes straight through
                for pair in held:
                    yield pair
                held = []
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def new_id(prefix: str) -> str:
    """A fresh response id such as ``chatcmpl-1a2b...``."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def envelope(kind: str, rid: str, model: str, choices: list[dict[str, Any]],
             usage: dict[str, int] | None = None) -> dict[str, Any]:
    """The common outer object of every response and chunk."""
    out: dict[str, Any] = {"id": rid, "object": kind, "created": int(time.time()), "model": model,
                           "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finite(logprob: float) -> float:
    """A log probability JSON can carry (-inf, a token the sampler could not pick, is written as -9999)."""
    return max(logprob, -9999.0)


def _logprob(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def logprob_entry(t: TokenLogprobs) -> dict[str, Any]:
    """One token's log probability with its alternatives, as chat completions and the Responses API write it
    (``token``, ``logprob``, ``bytes``, ``top_logprobs``)."""
    return {**_logprob(t.text, t.logprob), "top_logprobs": [_logprob(text, v) for text, v in t.top]}


def chat_logprobs(entries: Sequence[TokenLogprobs] | None) -> dict[str, Any] | None:
    """A chat choice's (or chunk's) ``logprobs`` (None when they were not asked for)."""
    if entries is None:
        return None
    return {"content": [logprob_entry(t) for t in entries], "refusal": None}


def text_logprobs(entries: Sequence[TokenLogprobs] | None) -> dict[str, Any] | None:
    """A text completion choice's (or chunk's) ``logprobs``: parallel lists of tokens, their log probabilities and
    their alternatives as {text: log probability} (None when they were not asked for)."""
    if entries is None:
        return None
    return {"tokens": [t.text for t in entries], "token_logprobs": [finite(t.logprob) for t in entries],
            "top_logprobs": [{text: finite(v) for text, v in t.top} for t in entries]}


def error_body(message: str, kind: str = "invalid_request_error", code: int | str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """An OpenAI error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
