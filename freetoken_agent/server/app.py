"""The HTTP app: OpenAI ``/v1/models``, ``/v1/chat/completions`` (streaming, tools), ``/v1/completions``,
``/v1/responses``; Anthropic ``/v1/messages`` and ``/v1/messages/count_tokens``.

Any :class:`~freetoken_agent.backends.Backend` can serve: ``freetoken serve`` uses ``LocalEngine``; tests use
``ScriptedBackend``. Requests run concurrently (the local engine batches them on its scheduler); a client that
disconnects — streaming or not — cancels its generation; a prompt that does not fit the model's context is a 400.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from freetoken_agent.backends.base import (
    Backend, GenerateRequest, GenerationDone, LogprobsDelta, TextBackend, TextChunk,
)
from freetoken_agent.chat import FormatError, TextDelta, ToolCallFinished, ToolCallStarted
from freetoken_agent.chat.think import ThinkSplitter
from freetoken_agent.errors import BackendError
from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.server import anthropic
from freetoken_agent.server import responses as responses_api
from freetoken_agent.server.fields import RequestError
from freetoken_agent.server.http import (
    MAX_BODY_BYTES, ApiKeyGate, anthropic_error, error_response, openai_error, openai_sse, read_json, refusal,
    request_error, run_whole, shape_for, stream_sse, typed_sse,
)
from freetoken_agent.server.protocol import (
    NO_GRAMMAR, ChatCall, Defaults, anext_or_none, chain, chat_logprobs, chat_request, choice_request,
    completion_request, envelope, merged, new_id, text_logprobs, usage_dict,
)
from freetoken_agent.server.responses import ResponseStore


class OpenAIServer:
    """Serves one backend under one model id, in three dialects: OpenAI chat/text completions, Anthropic Messages
    (``/v1/messages``, Claude Code) and OpenAI Responses (``/v1/responses``, Codex and the Agents SDK).

    Requests carry no conversation key: the local engine gives each the idle session that shares the longest prefix
    with its prompt, so consecutive turns of a client reuse its KV while other clients run beside it. With
    ``api_key`` set every route needs it; bodies over ``max_body`` bytes are refused (413).
    """

    def __init__(self, backend: Backend, model_id: str, default_max_tokens: int = 1024, api_key: str | None = None,
                 max_body: int = MAX_BODY_BYTES) -> None:
        self.backend = backend
        self.model_id = model_id
        model_defaults = getattr(backend, "sampling_defaults", None)
        self.defaults = Defaults(default_max_tokens, **(model_defaults() if callable(model_defaults) else {}))
        """What fields a request leaves out get (the completion length; the model's generation_config)."""
        self.api_key = api_key
        self.max_body = max_body
        self.responses = ResponseStore()
        """Stored Responses-API answers (``previous_response_id``)."""

    def app(self) -> ASGIApp:
        """The ASGI application."""
        app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/responses", self.create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.get_response, methods=["GET"]),
            Route("/health", lambda request: JSONResponse({"status": "ok"}), methods=["GET"]),
            Route("/", lambda request: JSONResponse({"status": "ok"}), methods=["GET"]),  # clients probe the root
            Route("/stats", self.stats, methods=["GET"]),
        ], exception_handlers={HTTPException: _http_exception})
        return ApiKeyGate(app, self.api_key)

    def _model_card(self) -> dict[str, Any]:
        card: dict[str, Any] = {"id": self.model_id, "object": "model", "created": 0, "owned_by": "freetoken",
                                "type": "model", "display_name": self.model_id, "created_at": "1970-01-01T00:00:00Z"}
        context = self.backend_context()
        if context is not None:
            card["context_length"] = card["max_model_len"] = context
        return card

    def backend_context(self) -> int | None:
        """The served model's context in tokens (None when the backend does not know it)."""
        return getattr(self.backend, "context_length", None)

    async def models(self, request: Request) -> Response:
        card = self._model_card()
        return JSONResponse({"object": "list", "data": [card], "has_more": False, "first_id": card["id"],
                             "last_id": card["id"]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model_id"]
        if name != self.model_id:
            return request_error(shape_for(request.url.path), self._unknown_model(name))
        return JSONResponse(self._model_card())

    async def stats(self, request: Request) -> Response:
        """The backend's statistics (the engine's: scheduler, KV, residency), or {} for backends without any."""
        return JSONResponse(self.backend.stats() or {})

    def _unknown_model(self, name: str) -> RequestError:
        return RequestError(f"the model {name[:200]!r} does not exist: this server serves {self.model_id!r}",
                            "model", 404, "model_not_found")

    def check_model(self, name: str | None) -> None:
        """Refuse a request for a model this server does not serve (404); no model names the served one."""
        if name is not None and name != self.model_id:
            raise self._unknown_model(name)

    async def _read(self, request: Request, parse: Callable[[Any], Any]) -> Any:
        """The body read, size-checked and parsed by ``parse`` (which raises RequestError); a constrained request
        is refused, naming the field that asked, when the backend cannot enforce constraints."""
        body = await read_json(request, self.max_body)
        call = parse(body)
        if call.request.constraint is not None and not getattr(self.backend, "supports_constraints", False):
            raise RequestError(f"'{call.constraint_field}' is not supported: it needs {NO_GRAMMAR}",
                               call.constraint_field)
        if call.logits_field is not None and not getattr(self.backend, "supports_logits", False):
            raise RequestError(f"'{call.logits_field}' is not supported: this backend does not expose the model's "
                               "logits", call.logits_field)
        return call

    async def chat_completions(self, request: Request) -> Response:
        try:
            call = await self._read(request, lambda b: chat_request(b, self.defaults))
            self.check_model(call.model)
        except RequestError as exc:
            return request_error(openai_error, exc)
        rid = new_id("chatcmpl")
        if call.stream:
            return await stream_sse(openai_error, self._chat_chunks(call, rid), openai_sse)
        return await run_whole(request, openai_error, self._chat_whole(call, rid))

    async def completions(self, request: Request) -> Response:
        try:
            call = await self._read(request, lambda b: completion_request(b, self.defaults))
            self.check_model(call.model)
            if not isinstance(self.backend, TextBackend):
                raise RequestError("this backend serves chat completions only")
        except RequestError as exc:
            return request_error(openai_error, exc)
        rid = new_id("cmpl")
        if call.stream:
            return await stream_sse(openai_error, self._text_chunks(call, rid), openai_sse)
        return await run_whole(request, openai_error, self._text_whole(call, rid))

    # ------------------------------------------------------------------------------------ Anthropic Messages
    async def messages(self, request: Request) -> Response:
        try:
            call = await self._read(request, lambda b: anthropic.messages_request(b, self.defaults))
            self.check_model(call.model)
        except RequestError as exc:
            return request_error(anthropic_error, exc)
        mid = new_id("msg").replace("-", "_")
        events = self.call_events(call.request, call.single_call)
        if call.stream:
            try:  # message_start carries the prompt's size, before anything is generated
                prompt_tokens = await anyio.to_thread.run_sync(self.backend_count, call.request)
            except RequestError:
                prompt_tokens = 0
            except FreeTokenError as exc:
                return refusal(anthropic_error, exc)
            stream = anthropic.stream_events(events, mid, self.model_id, prompt_tokens, call.thinking)
            return await stream_sse(anthropic_error, stream, typed_sse)
        return await run_whole(request, anthropic_error, anthropic.whole_message(
            events, mid, self.model_id, call.thinking))

    async def count_tokens(self, request: Request) -> Response:
        try:
            call = await self._read(request, lambda b: anthropic.messages_request(b, self.defaults, count_only=True))
            self.check_model(call.model)
            tokens = await anyio.to_thread.run_sync(self.backend_count, call.request)
        except RequestError as exc:
            return request_error(anthropic_error, exc)
        except FreeTokenError as exc:
            return refusal(anthropic_error, exc)
        return JSONResponse({"input_tokens": tokens})

    def backend_count(self, request: GenerateRequest) -> int:
        """Prompt tokens of ``request`` by the backend's own count (a 400 when it cannot count)."""
        count = getattr(self.backend, "count_tokens", None)  # remote (OpenAI-compatible) backends have none
        tokens = count(request) if count is not None else None
        if tokens is None:
            raise RequestError("this backend cannot count tokens")
        return int(tokens)

    # ------------------------------------------------------------------------------------ OpenAI Responses
    async def create_response(self, request: Request) -> Response:
        try:
            call = await self._read(request, lambda b: responses_api.responses_request(
                b, self.defaults, self.responses))
            self.check_model(call.model)
        except RequestError as exc:
            return request_error(openai_error, exc)
        run = responses_api.ResponseRun(call, self.model_id, self.responses)
        if call.stream:
            return await stream_sse(openai_error, run.stream(self.call_events(call.request)), typed_sse)
        return await run_whole(request, openai_error, run.whole(self.call_events(call.request)))

    async def get_response(self, request: Request) -> Response:
        stored = self.responses.get(request.path_params["response_id"])
        if stored is None:
            return error_response(openai_error, 404, "invalid_request_error", "no stored response with that id")
        return JSONResponse(stored.body)

    # ------------------------------------------------------------------------------------------ chat internals
    async def call_events(self, req: GenerateRequest, single_call: bool = False) -> AsyncIterator[Any]:
        """Backend events with finished calls numbered 0, 1, ... and unreadable calls turned back into text.

        A call is announced to the client only once it has parsed (name and arguments in one delta), so a client
        never holds a call whose arguments never come. With ``single_call`` the generation ends after the first call
        (``parallel_tool_calls: false``). ``LogprobsDelta`` events (requests asking for log probabilities) pass
        through in place: the tokens they cover belong to the next piece of output.
        """
        number = 0
        events = self.backend.generate(req)
        think = ThinkSplitter()  # <think>...</think> comes back as reasoning
        try:
            async for event in events:
                if isinstance(event, ToolCallStarted):
                    continue
                if isinstance(event, LogprobsDelta):
                    yield None, event
                    continue
                if isinstance(event, FormatError):  # an unreadable call is returned as the text it was
                    event = TextDelta(event.raw)
                if isinstance(event, TextDelta):
                    for piece in think.feed(event):
                        yield None, piece
                    continue
                for piece in think.finish():
                    yield None, piece
                if isinstance(event, ToolCallFinished):
                    yield number, event
                    number += 1
                    if single_call:
                        return
                else:
                    yield None, event
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def _text_whole(self, call: ChatCall, rid: str) -> dict[str, Any]:
        backend = self.backend
        assert isinstance(backend, TextBackend)  # checked by ``completions``

        async def one(index: int, req: GenerateRequest) -> tuple[dict[str, Any], GenerationDone]:
            text, done = [], GenerationDone("stop")
            async for item in backend.stream_text(req):
                if isinstance(item, TextChunk):
                    text.append(item.text)
                else:
                    done = item
            return {"index": index, "text": "".join(text), "logprobs": text_logprobs(done.logprobs),
                    "finish_reason": done.finish_reason}, done

        choices, usage = await self._n_choices(call, one)
        return envelope("text_completion", rid, self.model_id, choices, usage)

    async def _chat_whole(self, call: ChatCall, rid: str) -> dict[str, Any]:
        async def one(index: int, req: GenerateRequest) -> tuple[dict[str, Any], GenerationDone]:
            text, reasoning, calls, done = [], [], [], GenerationDone("stop")
            async for number, event in self.call_events(req, call.single_call):
                if isinstance(event, TextDelta):
                    (reasoning if event.reasoning else text).append(event.text)
                elif isinstance(event, ToolCallFinished):
                    calls.append({"id": f"call_{rid[-8:]}_{index}_{number}", "type": "function", "function": {
                        "name": event.name, "arguments": json.dumps(event.arguments, ensure_ascii=False)}})
                elif isinstance(event, GenerationDone):
                    done = event
            message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
            if reasoning:
                message["reasoning_content"] = "".join(reasoning)
            if calls:
                message["tool_calls"] = calls
            finish = "tool_calls" if calls else done.finish_reason
            return {"index": index, "message": message, "finish_reason": finish,
                    "logprobs": chat_logprobs(done.logprobs)}, done

        choices, usage = await self._n_choices(call, one)
        return envelope("chat.completion", rid, self.model_id, choices, usage)

    async def _n_choices(self, call: ChatCall, one: Callable[[int, GenerateRequest], Any],
                         ) -> tuple[list[dict[str, Any]], dict[str, int]]:
        """``call.n`` choices generated side by side (the engine batches them; seeds by :func:`choice_request`), and
        the usage: the prompt once, the completions summed."""
        results: list[Any] = [None] * call.n
        errors: list[Exception] = []

        async def run(index: int) -> None:
            try:
                results[index] = await one(index, choice_request(call.request, index))
            except (FreeTokenError, RequestError, BackendError) as exc:  # answered by the caller, not a task group
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for index in range(call.n):
                tg.start_soon(run, index)
        if errors:
            raise errors[0]
        prompt = results[0][1].usage.prompt_tokens
        completion = sum(done.usage.completion_tokens for _choice, done in results)
        return [choice for choice, _done in results], usage_dict(prompt, completion)

    async def _chat_chunks(self, call: ChatCall, rid: str) -> AsyncIterator[dict]:
        """Chunks of the ``call.n`` choices as they come (each with its ``index``; generated side by side), then the
        usage (``include_usage``): the prompt once, the completions summed."""
        streams = [self._chat_choice(call, rid, index) for index in range(call.n)]
        completion, prompt = 0, 0
        async for _index, (choice, done) in merged(streams):
            if done is not None:
                prompt, completion = done.usage.prompt_tokens, completion + done.usage.completion_tokens
            yield envelope("chat.completion.chunk", rid, self.model_id, [choice])
        if call.include_usage:
            yield envelope("chat.completion.chunk", rid, self.model_id, [], usage_dict(prompt, completion))

    async def _chat_choice(self, call: ChatCall, rid: str, index: int,
                           ) -> AsyncIterator[tuple[dict[str, Any], GenerationDone | None]]:
        """One choice's chunks (its ``choices`` entry) and, with the last one, its ``GenerationDone``.

        With log probabilities asked for, a chunk carries those of the tokens generated since the previous chunk
        (those whose text it carries; text is cut by the tool-call parser, not by token); the last chunk carries
        the rest (an end-of-sequence token, text held back), so the chunks' lists joined are the non-streamed list.
        """
        req = choice_request(call.request, index)
        asked = req.logprobs is not None
        pending: list[Any] = []
        sent = 0

        def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            nonlocal pending, sent
            logprobs = chat_logprobs(pending) if asked and pending else None
            sent, pending = sent + len(pending), []
            return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}

        events = self.call_events(req, call.single_call)
        first = await anext_or_none(events)  # the engine accepts or refuses the request before the response starts
        yield {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
               "logprobs": None}, None
        done, any_call = GenerationDone("stop"), False
        async for number, event in chain(first, events):
            if isinstance(event, LogprobsDelta):
                pending.extend(event.entries)
            elif isinstance(event, TextDelta) and event.text:
                yield choice({"reasoning_content": event.text} if event.reasoning else {"content": event.text}), None
            elif isinstance(event, ToolCallFinished):
                any_call = True
                yield choice({"tool_calls": [{
                    "index": number, "id": f"call_{rid[-8:]}_{index}_{number}", "type": "function", "function": {
                        "name": event.name, "arguments": json.dumps(event.arguments, ensure_ascii=False)}}]}), None
            elif isinstance(event, GenerationDone):
                done = event
        rest = done.logprobs[sent:] if done.logprobs is not None else None
        yield {"index": index, "delta": {}, "finish_reason": "tool_calls" if any_call else done.finish_reason,
               "logprobs": chat_logprobs(rest)}, done

    async def _text_chunks(self, call: ChatCall, rid: str) -> AsyncIterator[dict]:
        """Chunks of the ``call.n`` text choices as they come, then the usage (``include_usage``; one choice
        without it carries its usage on its last chunk)."""
        streams = [self._text_choice(call, index) for index in range(call.n)]
        completion, prompt = 0, 0
        async for _index, (choice, done) in merged(streams):
            usage = None
            if done is not None:
                prompt, completion = done.usage.prompt_tokens, completion + done.usage.completion_tokens
                if call.n == 1 and not call.include_usage:
                    usage = usage_dict(prompt, completion)
            yield envelope("text_completion", rid, self.model_id, [choice], usage)
        if call.include_usage:
            yield envelope("text_completion", rid, self.model_id, [], usage_dict(prompt, completion))

    async def _text_choice(self, call: ChatCall, index: int,
                           ) -> AsyncIterator[tuple[dict[str, Any], GenerationDone | None]]:
        """One text choice's chunks, each with the log probabilities of the tokens whose text it carries (when
        asked for); the last (no text) with the rest of them and its ``GenerationDone``."""
        backend = self.backend
        assert isinstance(backend, TextBackend)  # checked by ``completions``
        done, sent = GenerationDone("stop"), 0
        async for item in backend.stream_text(choice_request(call.request, index)):
            if isinstance(item, TextChunk):
                sent += len(item.logprobs or ())
                yield {"index": index, "text": item.text, "logprobs": text_logprobs(item.logprobs),
                       "finish_reason": None}, None
            else:
                done = item
        rest = done.logprobs[sent:] if done.logprobs is not None else None
        yield {"index": index, "text": "", "logprobs": text_logprobs(rest), "finish_reason": done.finish_reason}, done


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Unknown routes and wrong methods, in the API's error shape."""
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(shape_for(request.url.path), exc.status_code, kind,
                          f"{request.method} {request.url.path[:200]}: {exc.detail}")
