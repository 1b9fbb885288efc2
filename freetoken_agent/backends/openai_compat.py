"""``OpenAICompatible``: a remote chat-completions server (vLLM, SGLang, llama.cpp, ``freetoken serve``).

Streams ``/v1/chat/completions`` with tools; the server parses tool calls on its side and sends them as structured
deltas, which become the same events the local parsers produce. Phase hints are no-ops (the engine is remote);
messages are sent exactly as the loop accumulated them, so the server's prefix cache sees a stable prefix.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from freetoken_agent.backends.base import BackendEvent, GenerateRequest, GenerationDone
from freetoken_agent.chat import FormatError, TextDelta, ToolCallFinished, ToolCallStarted
from freetoken_agent.errors import BackendError
from freetoken_agent.events import Usage
from freetoken_agent.phases import Phase


class OpenAICompatible:
    """A backend that talks to an OpenAI-compatible HTTP server.

    ``base_url`` is the API root (``http://host:8000/v1``); ``model`` defaults to the first model the server lists;
    ``extra_body`` is merged into every request (server-specific options).
    """

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0, extra_body: dict[str, Any] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.extra_body = dict(extra_body or {})

    def hint(self, phase: Phase, expected_s: float | None = None, session: str | None = None) -> None:
        """Remote engines do not take phase hints."""

    def end_session(self, session: str) -> None:
        """The server keeps no per-conversation state we could release."""

    def stats(self) -> dict[str, Any] | None:
        return None

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _model_id(self, client: httpx.AsyncClient) -> str:
        if self.model is None:
            resp = await client.get(f"{self.base_url}/models", headers=self._headers())
            _check(resp, await resp.aread(), self.base_url)
            models = resp.json().get("data") or []
            if not models:
                raise BackendError(f"{self.base_url}/models lists no model")
            self.model = str(models[0]["id"])
        return self.model

    def _body(self, request: GenerateRequest, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model, "messages": request.messages, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": request.max_tokens, "temperature": request.temperature, "top_p": request.top_p,
        }
        if request.tools:
            body["tools"] = request.tools
        if request.seed is not None:
            body["seed"] = request.seed
        if request.stop:
            body["stop"] = list(request.stop)
        return {**body, **self.extra_body}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[BackendEvent]:
        if request.prompt is not None:
            raise BackendError("OpenAICompatible serves chat requests only (no raw prompt)")
        calls: dict[int, dict[str, Any]] = {}  # server index -> {"name", "arguments"}
        finish, usage = "stop", Usage()
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=10.0)) as client:
                body = self._body(request, await self._model_id(client))
                url = f"{self.base_url}/chat/completions"
                async with client.stream("POST", url, json=body, headers=self._headers()) as resp:
                    if resp.status_code != 200:
                        _check(resp, await resp.aread(), url)
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if chunk.get("usage"):
                            u = chunk["usage"]
                            usage = Usage(int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0))
                        for choice in chunk.get("choices") or []:
                            finish = choice.get("finish_reason") or finish
                            for event in _delta_events(choice.get("delta") or {}, calls):
                                yield event
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot talk to {self.base_url}: {type(exc).__name__}: {exc}") from exc
        for index, call in sorted(calls.items()):
            yield _finished(index, call)
        yield GenerationDone(finish, usage)


def _delta_events(delta: dict[str, Any], calls: dict[int, dict[str, Any]]) -> list[BackendEvent]:
    events: list[BackendEvent] = []
    if delta.get("reasoning_content"):
        events.append(TextDelta(str(delta["reasoning_content"]), reasoning=True))
    if delta.get("content"):
        events.append(TextDelta(str(delta["content"])))
    for part in delta.get("tool_calls") or []:
        index = int(part.get("index", len(calls)))
        fn = part.get("function") or {}
        call = calls.setdefault(index, {"name": "", "arguments": ""})
        if fn.get("name") and not call["name"]:
            call["name"] = fn["name"]
            events.append(ToolCallStarted(index, call["name"]))
        call["arguments"] += fn.get("arguments") or ""
    return events


def _finished(index: int, call: dict[str, Any]) -> BackendEvent:
    text = call["arguments"].strip()
    try:
        args = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        return FormatError(f"the tool call arguments are not valid JSON ({exc.msg} at char {exc.pos}): "
                           f"{text[:200]!r}", text, index, call["name"] or None)
    if not isinstance(args, dict):
        return FormatError(f"the tool call arguments must be a JSON object, got: {text[:200]!r}", text, index,
                           call["name"] or None)
    return ToolCallFinished(index, call["name"], args, text)


def _check(resp: httpx.Response, body: bytes, url: str) -> None:
    if resp.status_code == 200:
        return
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")[:300]
    raise BackendError(f"{url}: HTTP {resp.status_code}: {message}")
