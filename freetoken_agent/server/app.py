"""The OpenAI-compatible HTTP app: ``/v1/models``, ``/v1/chat/completions`` (streaming, tools), ``/v1/completions``.

Any :class:`~freetoken_agent.backends.Backend` can serve: ``freetoken serve`` uses ``LocalEngine``; tests use
``ScriptedBackend``. Requests run concurrently (the local engine batches them on its scheduler); a client that
disconnects — streaming or not — cancels its generation; a prompt that does not fit the model's context is a 400.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from freetoken_agent.backends.base import Backend, GenerateRequest, GenerationDone, TextBackend, TextChunk
from freetoken_agent.chat import FormatError, TextDelta, ToolCallFinished, ToolCallStarted
from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.scheduler import ContextLengthError
from freetoken_agent.server.protocol import (
    RequestError, chat_request, completion_request, envelope, error_body, new_id, usage_dict,
)


class OpenAIServer:
    """Serves one backend under one model id.

    Requests carry no conversation key: the local engine gives each the idle session that shares the longest prefix
    with its prompt, so consecutive turns of a client reuse its KV while other clients run beside it.
    """

    def __init__(self, backend: Backend, model_id: str, default_max_tokens: int = 1024) -> None:
        self.backend = backend
        self.model_id = model_id
        self.default_max_tokens = default_max_tokens

    def app(self) -> Starlette:
        """The ASGI application."""
        return Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/health", lambda request: JSONResponse({"status": "ok"}), methods=["GET"]),
            Route("/stats", self.stats, methods=["GET"]),
        ])

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": 0, "owned_by": "freetoken"}]})

    async def stats(self, request: Request) -> Response:
        """The backend's statistics (the engine's: scheduler, KV, residency), or {} for backends without any."""
        return JSONResponse(self.backend.stats() or {})

    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise RequestError("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            req = chat_request(body, self.default_max_tokens)
        except RequestError as exc:
            return JSONResponse(error_body(str(exc)), status_code=400)
        rid = new_id("chatcmpl")
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await _streaming(self._chat_chunks(req, rid, usage))
        return await _whole(request, self._chat_whole(req, rid))

    async def completions(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            req = completion_request(body, self.default_max_tokens)
        except RequestError as exc:
            return JSONResponse(error_body(str(exc)), status_code=400)
        if not isinstance(self.backend, TextBackend):
            return JSONResponse(error_body("this backend serves chat completions only"), status_code=400)
        rid = new_id("cmpl")
        if body.get("stream"):
            return await _streaming(self._text_chunks(req, rid))
        return await _whole(request, self._text_whole(req, rid))

    async def _text_whole(self, req: GenerateRequest, rid: str) -> dict[str, Any]:
        backend = self.backend
        assert isinstance(backend, TextBackend)  # checked by ``completions``
        text, done = [], GenerationDone("stop")
        async for item in backend.stream_text(req):
            if isinstance(item, TextChunk):
                text.append(item.text)
            else:
                done = item
        choice = {"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": done.finish_reason}
        u = done.usage
        return envelope("text_completion", rid, self.model_id, [choice], usage_dict(u.prompt_tokens, u.completion_tokens))

    # ------------------------------------------------------------------------------------------ chat internals
    async def _chat_events(self, req: GenerateRequest) -> AsyncIterator[Any]:
        """Backend events with finished calls numbered 0, 1, ... and unreadable calls turned back into text.

        A call is announced to the client only once it has parsed (name and arguments in one delta), so a client
        never holds a call whose arguments never come.
        """
        number = 0
        async for event in self.backend.generate(req):
            if isinstance(event, ToolCallStarted):
                continue
            if isinstance(event, ToolCallFinished):
                yield number, event
                number += 1
            elif isinstance(event, FormatError):  # an unreadable call is returned as the text it was
                yield None, TextDelta(event.raw)
            else:
                yield None, event

    async def _chat_whole(self, req: GenerateRequest, rid: str) -> dict[str, Any]:
        text, calls, done = [], [], GenerationDone("stop")
        async for number, event in self._chat_events(req):
            if isinstance(event, TextDelta) and not event.reasoning:
                text.append(event.text)
            elif isinstance(event, ToolCallFinished):
                calls.append({"id": f"call_{rid[-8:]}_{number}", "type": "function", "function": {
                    "name": event.name, "arguments": json.dumps(event.arguments, ensure_ascii=False)}})
            elif isinstance(event, GenerationDone):
                done = event
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        finish = "tool_calls" if calls else done.finish_reason
        return envelope("chat.completion", rid, self.model_id,
                        [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                        usage_dict(done.usage.prompt_tokens, done.usage.completion_tokens))

    async def _chat_chunks(self, req: GenerateRequest, rid: str, include_usage: bool) -> AsyncIterator[dict]:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return envelope("chat.completion.chunk", rid, self.model_id,
                            [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}])

        events = self._chat_events(req)
        try:  # the engine accepts or refuses the request here, before the response starts
            first = [await events.__anext__()]
        except StopAsyncIteration:
            first = []
        yield chunk({"role": "assistant", "content": ""})
        done, any_call = GenerationDone("stop"), False
        async for number, event in _chain(first, events):
            if isinstance(event, TextDelta) and event.text:
                yield chunk({"reasoning_content": event.text} if event.reasoning else {"content": event.text})
            elif isinstance(event, ToolCallFinished):
                any_call = True
                yield chunk({"tool_calls": [{"index": number, "id": f"call_{rid[-8:]}_{number}", "type": "function",
                                             "function": {"name": event.name, "arguments": json.dumps(
                                                 event.arguments, ensure_ascii=False)}}]})
            elif isinstance(event, GenerationDone):
                done = event
        yield chunk({}, "tool_calls" if any_call else done.finish_reason)
        if include_usage:
            yield envelope("chat.completion.chunk", rid, self.model_id, [],
                           usage_dict(done.usage.prompt_tokens, done.usage.completion_tokens))

    async def _text_chunks(self, req: GenerateRequest, rid: str) -> AsyncIterator[dict]:
        backend = self.backend
        assert isinstance(backend, TextBackend)  # checked by ``completions``
        async for item in backend.stream_text(req):
            if isinstance(item, TextChunk):
                yield envelope("text_completion", rid, self.model_id,
                               [{"index": 0, "text": item.text, "logprobs": None, "finish_reason": None}])
            else:
                yield envelope("text_completion", rid, self.model_id,
                               [{"index": 0, "text": "", "logprobs": None, "finish_reason": item.finish_reason}],
                               usage_dict(item.usage.prompt_tokens, item.usage.completion_tokens))


async def _chain(head: list[Any], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    for item in head:
        yield item
    async for item in rest:
        yield item


def _refusal(exc: Exception) -> Response:
    """A request the engine refuses before generating (too long for the context, ids outside the vocabulary)."""
    kind = "context_length_exceeded" if isinstance(exc, ContextLengthError) else "invalid_request_error"
    return JSONResponse(error_body(str(exc), kind), status_code=400)


async def _whole(request: Request, work: Any) -> Response:
    """Run ``work`` (a coroutine producing the response body) until it ends or the client disconnects: a client
    that goes away cancels its generation instead of leaving it running."""
    out: dict[str, Any] = {}

    async def watch(scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    async def run(scope: anyio.CancelScope) -> None:
        try:
            out["body"] = await work
        except FreeTokenError as exc:
            out["error"] = exc
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, tg.cancel_scope)
        tg.start_soon(run, tg.cancel_scope)
    if "error" in out:
        return _refusal(out["error"])
    if "body" not in out:  # disconnected: nobody reads this
        return Response(status_code=499)
    return JSONResponse(out["body"])


async def _streaming(chunks: AsyncIterator[dict[str, Any]]) -> Response:
    """An SSE response; the first chunk is produced before the response starts, so a request the engine refuses
    gets a 400 instead of a stream that breaks. A disconnect cancels the generator (and with it the generation)."""
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = None
    except FreeTokenError as exc:
        return _refusal(exc)

    async def sse() -> AsyncIterator[str]:
        try:
            if first is not None:
                yield f"data: {json.dumps(first, ensure_ascii=False)}\n\n"
                async for item in chunks:
                    yield f"data: {json.dumps(item, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await chunks.aclose()

    return StreamingResponse(sse(), media_type="text/event-stream")
