"""HTTP plumbing shared by every endpoint: the API-key gate, size-limited body reading with JSON parsed off the
event loop, error bodies in each API's shape, and running a generation as a whole response or as server-sent events
(a client that disconnects cancels its generation either way).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from freetoken_agent.backends.base import ContextOverflow
from freetoken_agent.errors import BackendError
from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.scheduler import ContextLengthError
from freetoken_agent.server.fields import RequestError

MAX_BODY_BYTES = 16 * 2**20
"""Largest request body accepted (413 above it): far above any context a local model holds as JSON text."""
THREAD_PARSE_BYTES = 64 * 2**10
"""Bodies from this size are parsed on a worker thread, so a big body never stalls other clients."""
MAX_DEPTH = 64
"""Deepest JSON nesting accepted (tool schemas are a few levels deep; deeper bodies are hostile)."""

ErrorShape = Callable[[int, str, str, "str | None"], dict[str, Any]]
"""(status, kind, message, param) → an error body in one API's shape."""


def openai_error(status: int, kind: str, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's ``{"error": {message, type, param, code}}``."""
    code = kind if kind in ("context_length_exceeded", "model_not_found", "invalid_api_key") else None
    typ = {401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error"}.get(status, kind)
    if code is not None:
        typ = "invalid_request_error"
    return {"error": {"message": message, "type": typ if status < 500 else "server_error", "param": param,
                      "code": code}}


def anthropic_error(status: int, kind: str, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's ``{"type": "error", "error": {type, message}}``; a context overflow reads "prompt is too long"
    (what Claude Code looks for before compacting a conversation)."""
    typ = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}.get(
        status, "api_error" if status >= 500 else "invalid_request_error")
    if kind == "context_length_exceeded":
        message = f"prompt is too long: {message}"
    return {"type": "error", "error": {"type": typ, "message": message}}


def shape_for(path: str) -> ErrorShape:
    """The error shape of the API that ``path`` belongs to."""
    return anthropic_error if path.startswith("/v1/messages") else openai_error


def error_response(shape: ErrorShape, status: int, kind: str, message: str, param: str | None = None) -> Response:
    return JSONResponse(shape(status, kind, message, param), status_code=status)


def request_error(shape: ErrorShape, exc: RequestError) -> Response:
    return error_response(shape, exc.status, exc.kind, str(exc), exc.param)


def upstream(shape: ErrorShape, exc: BackendError) -> Response:
    """The backend failed (a remote server unreachable, a script run out): 502, the cause in one line."""
    return error_response(shape, 502, "api_error", f"the backend failed: {exc}")


def stream_error(shape: ErrorShape, exc: Exception) -> dict[str, Any]:
    """The event that ends a stream whose generation failed midway, in the API's shape."""
    status = 502 if isinstance(exc, BackendError) else getattr(exc, "status", 400)
    body = shape(status, "api_error" if status >= 500 else "invalid_request_error", str(exc), None)
    if shape is anthropic_error:
        return body  # {"type": "error", "error": {...}}
    return {"type": "error", **body}  # OpenAI: {"error": {...}}; typed streams read "type"


def refusal(shape: ErrorShape, exc: FreeTokenError) -> Response:
    """A request the engine refuses before generating (too long for the context, a template that fails).

    Anthropic's clients read the numbers of a context overflow from its message (Claude Code lowers
    ``max_tokens`` and retries, or compacts the conversation), so it is worded as Anthropic words it."""
    kind = "context_length_exceeded" if isinstance(exc, (ContextLengthError, ContextOverflow)) else \
        "invalid_request_error"
    message = str(exc)
    if shape is anthropic_error and isinstance(exc, ContextOverflow):
        if exc.prompt_tokens >= exc.context:
            message = f"{exc.prompt_tokens} tokens > {exc.context} maximum"
        else:
            kind, message = "invalid_request_error", (
                f"input length and `max_tokens` exceed context limit: {exc.prompt_tokens} + {exc.max_tokens} > "
                f"{exc.context}, decrease input length or `max_tokens` and try again")
    return error_response(shape, 400, kind, message)


class ApiKeyGate:
    """ASGI middleware: with a key set, every route needs it (``Authorization: Bearer KEY`` or ``x-api-key: KEY``,
    the OpenAI and Anthropic conventions); the answer to a missing or wrong key is a 401 in the route's API shape."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-api-key") or b""
        auth = headers.get(b"authorization") or b""
        if auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if not hmac.compare_digest(given, self.key):
            message = "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)"
            response = error_response(shape_for(scope.get("path", "")), 401, "invalid_api_key", message)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _depth_ok(value: Any) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return True


def parse_json(data: bytes) -> Any:
    """A request body parsed strictly: UTF-8, no NaN/Infinity, nesting at most ``MAX_DEPTH`` (RequestError)."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_no_constants)
    except UnicodeDecodeError:
        raise RequestError("the request body is not UTF-8") from None
    except RecursionError:
        raise RequestError(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, integers over Python's digit limit
        raise RequestError(f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not _depth_ok(value):
        raise RequestError(f"the request body nests deeper than {MAX_DEPTH} levels")
    return value


async def read_json(request: Request, limit: int = MAX_BODY_BYTES) -> Any:
    """The body of ``request`` as JSON: refused with 413 past ``limit`` bytes (before reading it when the client
    says its length), parsed on a worker thread when large."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"the request body has {int(declared)} bytes; at most {limit} are accepted", None, 413,
                           "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"the request body is over {limit} bytes", None, 413, "request_too_large")
        chunks.append(chunk)
    data = b"".join(chunks)
    if not data.strip():
        raise RequestError("the request body is empty: send a JSON object")
    if len(data) >= THREAD_PARSE_BYTES:
        return await anyio.to_thread.run_sync(parse_json, data)
    return parse_json(data)


async def run_whole(request: Request, shape: ErrorShape, work: Awaitable[dict[str, Any]]) -> Response:
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
        except RequestError as exc:
            out["request_error"] = exc
        except BackendError as exc:
            out["upstream"] = exc
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, tg.cancel_scope)
        tg.start_soon(run, tg.cancel_scope)
    if "error" in out:
        return refusal(shape, out["error"])
    if "request_error" in out:
        return request_error(shape, out["request_error"])
    if "upstream" in out:
        return upstream(shape, out["upstream"])
    if "body" not in out:  # disconnected: nobody reads this
        return Response(status_code=499)
    return JSONResponse(out["body"])


SSEFormat = Callable[[Any], str]


def openai_sse(item: Any) -> str:
    """``data: {json}`` framing (chat and text completions); the ``[DONE]`` line ends the stream."""
    return "data: [DONE]\n\n" if item is None else f"data: {json.dumps(item, ensure_ascii=False)}\n\n"


def typed_sse(item: Any) -> str:
    """``event: TYPE`` + ``data: {json}`` framing (Anthropic Messages, OpenAI Responses): nothing after the end."""
    if item is None:
        return ""
    return f"event: {item['type']}\ndata: {json.dumps(item, ensure_ascii=False)}\n\n"


async def stream_sse(shape: ErrorShape, events: AsyncIterator[dict[str, Any]], fmt: SSEFormat) -> Response:
    """An SSE response; the first event is produced before the response starts, so a request the engine refuses
    gets a 4xx instead of a stream that breaks. A disconnect cancels the generator (and with it the generation)."""
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        first = None
    except FreeTokenError as exc:
        return refusal(shape, exc)
    except RequestError as exc:
        return request_error(shape, exc)
    except BackendError as exc:
        return upstream(shape, exc)

    async def sse() -> AsyncIterator[str]:
        try:
            if first is not None:
                yield fmt(first)
                async for item in events:
                    yield fmt(item)
        except (FreeTokenError, RequestError, BackendError) as exc:  # the response has started: end it with an error
            yield fmt(stream_error(shape, exc))
        finally:
            await events.aclose()
        end = fmt(None)
        if end:
            yield end

    return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
