"""Hostile request bodies against every endpoint over real HTTP: never a 5xx, never a traceback, every refusal a
JSON error naming its cause, and ``/health`` answers throughout (a big body never stalls the event loop)."""

from __future__ import annotations

import copy
import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from freetoken_agent import ScriptedBackend
from freetoken_agent.server import serve_in_thread

CHAT = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": None, "tool_calls": [
                                       {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                                   {"role": "tool", "tool_call_id": "c1", "content": "r"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "max_tokens": 4, "temperature": 0.5, "stop": ["x"], "stream": False}
COMPLETION = {"model": "m", "prompt": "def f():", "max_tokens": 4, "top_p": 0.9}
MESSAGES = {"model": "m", "max_tokens": 4, "system": [{"type": "text", "text": "s"}], "messages": [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}],
    "tools": [{"name": "f", "input_schema": {"type": "object"}}], "stop_sequences": ["x"]}
RESPONSES = {"model": "m", "instructions": "s", "max_output_tokens": 4, "input": [
    {"role": "user", "content": "hi"},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "r"}],
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}
VALID = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/v1/messages": MESSAGES,
         "/v1/messages/count_tokens": {k: v for k, v in MESSAGES.items() if k not in ("max_tokens", "stop_sequences")},
         "/v1/responses": RESPONSES}
ISSUE_BODIES = [  # the five bodies that once answered 500 with a traceback
    {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {**CHAT, "seed": 2**70},
    {**CHAT, "stream": True, "stream_options": "yes"},
    {**CHAT, "messages": [{"role": "assistant", "content": "", "tool_calls": "call it"}]},
    {**CHAT, "messages": [{"role": "assistant", "content": "", "tool_calls": [5]}]},
]


def _deep(n: int) -> Any:
    value: Any = "x"
    for _ in range(n):
        value = [value]
    return value


HOSTILE: list[Any] = [None, True, False, 0, -1, 1, 2**70, -(2**70), 1e308, -1e-308, 0.5, "", "x" * 5000, "\u0000",
                      [], {}, [5], ["a"], [None], {"a": 1}, {"type": 5}, {"text": 5}, _deep(40), _deep(80),
                      [{"role": "user"}], [{"type": "text", "text": None}], {"include_usage": "yes"}]


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every location inside ``value`` (dict keys and list indices), the root excluded."""
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            out.append((*prefix, k))
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.append((*prefix, i))
            out.extend(_paths(v, (*prefix, i)))
    return out


def _mutate(body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        paths = _paths(body)
        if not paths:
            break
        path = rng.choice(paths)
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        action = rng.random()
        if action < 0.15 and isinstance(parent, dict):
            del parent[path[-1]]
        elif action < 0.25 and isinstance(parent, dict):
            parent[rng.choice(["zz_unknown", "n", "logprobs", "tool_choice", "response_format", "thinking"])] = \
                rng.choice(HOSTILE)
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(HOSTILE))
    return body


def _bodies(seed: int, per_endpoint: int) -> Iterator[tuple[str, bytes]]:
    rng = random.Random(seed)
    raw = [b"", b"{", b"null", b"[]", b"5", b'"x"', b"\xff\xfe", b'{"model": NaN}', b'{"max_tokens": Infinity}',
           b"[" * 100_000, b'{"seed": ' + b"9" * 5000 + b"}", b'{"a": 1e999}', json.dumps(_deep(500)).encode()]
    for path, valid in VALID.items():
        for data in raw:
            yield path, data
        for _ in range(per_endpoint):
            yield path, json.dumps(_mutate(valid, rng)).encode()
        for streamed in (False, True):
            yield path, json.dumps({**valid, "stream": streamed, "temperature": float("nan")}).encode()
    for body in ISSUE_BODIES:
        yield "/v1/chat/completions", json.dumps(body).encode()


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve_in_thread(ScriptedBackend(["ok fine"] * 5000, context_length=10_000), "m") as root:
        yield root.removesuffix("/v1")


def _check(reply: httpx.Response, what: str) -> None:
    assert reply.status_code < 500, f"{what}: {reply.status_code} {reply.text[:300]}"
    assert "Traceback" not in reply.text, what
    if reply.status_code >= 400:
        body = reply.json()
        message = body["error"]["message"]
        assert isinstance(message, str) and message, what


class HealthWatch:
    """Polls ``/health`` in a thread; records every answer's status and latency."""

    def __init__(self, url: str) -> None:
        self.url, self.answers, self._stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                status = client.get(f"{self.url}/health").status_code
                self.answers.append((status, time.perf_counter() - t0))
                time.sleep(0.02)

    def __enter__(self) -> HealthWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.thread.join(timeout=15)


def test_hostile_bodies_never_break_the_server(url: str) -> None:
    statuses: dict[int, int] = {}
    with HealthWatch(url) as health, httpx.Client(timeout=30) as client:
        for n, (path, data) in enumerate(_bodies(seed=17, per_endpoint=50)):
            reply = client.post(f"{url}{path}", content=data, headers={"content-type": "application/json"})
            _check(reply, f"#{n} {path} {data[:200]!r}")
            statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1
    assert sum(statuses.values()) > 300 and statuses.get(400, 0) > 150 and statuses.get(200, 0) > 10, statuses
    assert health.answers and all(status == 200 for status, _ in health.answers)


def test_the_five_issue_bodies_are_400s_naming_the_field(url: str) -> None:
    fields = ["messages[0].content[0].text", "seed", "stream_options", "messages[0].tool_calls",
              "messages[0].tool_calls[0]"]
    for body, field in zip(ISSUE_BODIES, fields):
        reply = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text


def test_an_oversized_body_is_413_and_health_keeps_answering(url: str) -> None:
    big = b'{"model": "m", "prompt": "' + b"x" * (17 * 2**20) + b'"}'
    with HealthWatch(url) as health:
        time.sleep(0.1)
        declared = httpx.post(f"{url}/v1/completions", content=big, timeout=60)

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
            for i in range(0, len(big), 2**20):
                yield big[i: i + 2**20]

        undeclared = httpx.post(f"{url}/v1/messages", content=chunks(), timeout=60)
        near = b'{"model": "m", "max_tokens": 2, "prompt": "' + b"x " * (7 * 2**20) + b'"}'
        parsed = httpx.post(f"{url}/v1/completions", content=near, timeout=60)  # 14 MB, parsed off the loop
        time.sleep(0.2)
    assert declared.status_code == 413 and "at most" in declared.json()["error"]["message"]
    assert undeclared.status_code == 413 and undeclared.json()["error"]["type"] == "request_too_large"
    assert parsed.status_code == 400 and parsed.json()["error"]["code"] == "context_length_exceeded"
    assert health.answers and all(status == 200 for status, _ in health.answers)
    assert max(latency for _, latency in health.answers) < 1.0, health.answers


def test_api_key_on_every_route() -> None:
    with serve_in_thread(ScriptedBackend(["ok"] * 10), "m", api_key="sekret") as root:
        base = root.removesuffix("/v1")
        for method, path in [("GET", "/health"), ("GET", "/v1/models"), ("GET", "/stats"),
                             ("POST", "/v1/chat/completions"), ("POST", "/v1/messages"), ("POST", "/v1/responses"),
                             ("POST", "/v1/completions"), ("POST", "/v1/messages/count_tokens"), ("GET", "/nope")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "sekre"}):
                reply = httpx.request(method, f"{base}{path}", headers=headers, json={})
                assert reply.status_code == 401, (path, headers)
        assert httpx.get(f"{base}/health", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.get(f"{root}/models", headers={"x-api-key": "sekret"}).status_code == 200
        anthropic_shape = httpx.post(f"{root}/messages", json={}).json()
        assert anthropic_shape["type"] == "error" and anthropic_shape["error"]["type"] == "authentication_error"
        reply = httpx.post(f"{root}/chat/completions", headers={"Authorization": "Bearer sekret"}, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "ok"


class FailsMidway:
    """A backend whose generation breaks after its first words (a remote server dropping the connection)."""

    async def generate(self, request: Any) -> Any:
        from freetoken_agent.backends.base import GenerationDone  # noqa: F401  (the stream never gets there)
        from freetoken_agent.chat import TextDelta
        from freetoken_agent.errors import BackendError

        yield TextDelta("partial ")
        raise BackendError("the upstream server closed the connection")

    def hint(self, phase: Any, expected_s: float | None = None) -> None:
        """No phases."""

    def stats(self) -> None:
        return None


def test_a_failing_backend_is_a_502_or_an_error_event_never_a_500() -> None:
    from freetoken_agent import OpenAICompatible

    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    messages = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    with serve_in_thread(OpenAICompatible("http://127.0.0.1:9/v1", model="m"), "m") as root:
        for path, body in [("/chat/completions", chat), ("/messages", messages), ("/responses", {"input": "x"})]:
            for stream in (False, True):
                reply = httpx.post(f"{root}{path}", json={**body, "stream": stream}, timeout=30)
                assert reply.status_code == 502 and "cannot talk to" in reply.text, (path, stream, reply.text)
    with serve_in_thread(FailsMidway(), "m") as root:
        for path, body, marker in [("/chat/completions", chat, 'data: {"type": "error", "error"'),
                                   ("/messages", messages, "event: error\ndata: {\"type\": \"error\""),
                                   ("/responses", {"input": "x"}, "event: error\n")]:
            text = httpx.post(f"{root}{path}", json={**body, "stream": True}, timeout=30).text
            assert "partial" in text and marker in text and "closed the connection" in text, (path, text)
            whole = httpx.post(f"{root}{path}", json=body, timeout=30)
            assert whole.status_code == 502 and "closed the connection" in whole.text
