"""OpenAI wire shapes: reading requests, writing responses and stream chunks (plain dicts, no framework)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from freetoken_agent.backends.base import GenerateRequest


class RequestError(ValueError):
    """A request the server refuses with HTTP 400; the message names the bad field."""


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"'{key}' must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def sampling_from(body: dict[str, Any], default_max_tokens: int) -> dict[str, Any]:
    """Sampling fields shared by chat and text completions."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RequestError("'stop' must be a string or a list of strings")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"'seed' must be an integer, got {seed!r}")
    return {"max_tokens": max_tokens, "temperature": _number(body, "temperature", 0.0, 0.0, 2.0),
            "top_p": _number(body, "top_p", 1.0, 0.0, 1.0), "seed": seed, "stop": tuple(stop)}


def _content_text(content: Any) -> Any:
    """OpenAI content parts (``[{"type": "text", "text": ...}]``) flattened to text, as chat templates expect."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content


def chat_request(body: dict[str, Any], default_max_tokens: int) -> GenerateRequest:
    """A :class:`GenerateRequest` from a ``/v1/chat/completions`` body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    clean: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant",
                                                                       "tool"):
            raise RequestError(f"messages[{i}] must be an object with a role of system, user, assistant or tool")
        clean.append({**message, "content": _content_text(message.get("content"))})
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) and "function" in t for t in tools):
        raise RequestError("'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects")
    if body.get("tool_choice") == "none":
        tools = []
    return GenerateRequest(messages=clean, tools=tools, **sampling_from(body, default_max_tokens))


def completion_request(body: dict[str, Any], default_max_tokens: int) -> GenerateRequest:
    """A :class:`GenerateRequest` from a ``/v1/completions`` body (one prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("'prompt' must be a string (one prompt per request)")
    return GenerateRequest(prompt=prompt, **sampling_from(body, default_max_tokens))


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


def error_body(message: str, kind: str = "invalid_request_error", code: int = 400) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
