"""``freetoken serve`` in a real subprocess on a tiny checkpoint, used by the ``openai`` client and by an agent."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import openai
import pytest

from freetoken_agent import Agent, Limits, OpenAICompatible
from tests.sdk.tiny_checkpoint import shared_tiny_qwen3_moe

LAUNCH = "import sys; from freetoken_agent.cli import main; sys.exit(main())"  # the `freetoken` entry point
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = shared_tiny_qwen3_moe(tmp_path_factory)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "serve", "--model", str(model), "--port", str(port),
                             "--name", "tiny-moe",
                             "--default-max-tokens", "16", "--threads", "1"], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/models", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"freetoken serve did not start: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.2)
    yield url
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")


def test_models_and_chat(server: str) -> None:
    client = openai.OpenAI(base_url=server, api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-moe"]
    reply = client.chat.completions.create(model="tiny-moe", tools=TOOLS, max_tokens=8,
                                           messages=[{"role": "user", "content": "read calc.py"}])
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert 0 < reply.usage.completion_tokens <= 8 and reply.usage.prompt_tokens > 20  # the tools are in the prompt


def test_streaming_chat_and_completions(server: str) -> None:
    client = openai.OpenAI(base_url=server, api_key="none", max_retries=0)
    chunks = list(client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, stream=True, stream_options={"include_usage": True}))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes and finishes[-1] in ("stop", "length", "tool_calls")
    assert chunks[-1].usage.completion_tokens <= 6
    whole = client.completions.create(model="tiny-moe", prompt="def add(a, b):", max_tokens=5, temperature=0)
    again = client.completions.create(model="tiny-moe", prompt="def add(a, b):", max_tokens=5, temperature=0)
    assert whole.choices[0].text == again.choices[0].text  # greedy is deterministic
    assert whole.usage.completion_tokens <= 5


def test_an_agent_runs_against_the_served_engine(server: str, tmp_path: Path) -> None:
    agent = Agent.coding(OpenAICompatible(server), workspace=tmp_path,
                         limits=Limits(max_steps=2, max_tokens_per_step=10, max_wall_s=120))
    result = anyio.run(agent.run, "Say hello.")
    assert result.stop_reason in ("done", "max_steps") and 1 <= result.steps <= 2
    assert 0 < result.usage.completion_tokens <= 20


def test_missing_model_folder_is_one_line() -> None:
    proc = subprocess.run([sys.executable, "-c", LAUNCH, "serve", "--model", "/nonexistent/m"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "freetoken serve: error: model folder not found: /nonexistent/m"


def _stats(server: str) -> dict:
    return httpx.get(server.removesuffix("/v1") + "/stats", timeout=5).json()["scheduler"]


def test_parallel_requests_share_steps(server: str) -> None:
    client = openai.OpenAI(base_url=server, api_key="none", max_retries=0)
    texts: list[str] = [""] * 6

    def one(i: int) -> None:
        stream = client.completions.create(model="tiny-moe", prompt=f"def f{i}(x): return x +", max_tokens=24,
                                           temperature=0, stream=True)
        texts[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert _stats(server)["max_batch"] >= 2  # the requests overlapped in the engine's steps
    alone = [client.completions.create(model="tiny-moe", prompt=f"def f{i}(x): return x +", max_tokens=24,
                                       temperature=0).choices[0].text for i in range(2)]
    assert texts[:2] == alone  # batched or alone: the same greedy text


def test_context_is_enforced_over_http(server: str) -> None:
    client = openai.OpenAI(base_url=server, api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny-moe", prompt=" x" * 6000, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": " x" * 6000}],
                                       max_tokens=4, stream=True)
    per = client.completions.create(model="tiny-moe", prompt=" x" * 100, max_tokens=1).usage.prompt_tokens / 100
    with pytest.raises(openai.BadRequestError) as info:  # an explicit max_tokens past the context is refused
        client.completions.create(model="tiny-moe", prompt=" x" * int(4084 / per), max_tokens=10**9)
    assert info.value.code == "context_length_exceeded" and "ask for at most" in str(info.value)
    near = client.completions.create(model="tiny-moe", prompt=" x" * int(4090 / per), temperature=0)
    used = near.usage.prompt_tokens + near.usage.completion_tokens
    assert near.usage.prompt_tokens < 4096 and used <= 4096  # the default length is clipped: never past the context
    assert [m["context_length"] for m in httpx.get(f"{server}/models").json()["data"]] == [4096]


def test_a_disconnected_client_stops_its_generation(server: str) -> None:
    before = _stats(server)["cancelled"]
    with httpx.stream("POST", f"{server}/completions", timeout=30, json={
            "model": "tiny-moe", "prompt": "hello", "max_tokens": 3000, "stream": True, "temperature": 0}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 4:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while _stats(server)["cancelled"] == before or _stats(server)["running"]:
        assert time.monotonic() < deadline, "the generation kept running after the client left"
        time.sleep(0.1)
    # a non-streaming client that gives up stops its generation too (the tiny model decodes ~4,500 tok/s with
    # speculation on a 2-core Xeon: 4,000 tokens take ~0.9 s, so give up well before that)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/completions", timeout=0.15, json={
            "model": "tiny-moe", "prompt": "hello", "max_tokens": 4000, "temperature": 0})
    deadline = time.monotonic() + 20
    while _stats(server)["cancelled"] < before + 2 or _stats(server)["running"]:
        assert time.monotonic() < deadline, "the abandoned request kept generating"
        time.sleep(0.1)


def test_hostile_bodies_against_the_engine(server: str) -> None:
    """A sample of the fuzz bodies through the real model path (chat template, tokenizer, scheduler)."""
    from tests.sdk.server.test_request_fuzz import _bodies, _check

    root = server.removesuffix("/v1")
    with httpx.Client(timeout=60) as client:
        for n, (path, data) in enumerate(_bodies(seed=5, per_endpoint=8)):
            body = data.replace(b'"model": "m"', b'"model": "tiny-moe"')
            _check(client.post(f"{root}{path}", content=body, headers={"content-type": "application/json"}),
                   f"#{n} {path} {body[:200]!r}")
        assert client.get(f"{root}/health").status_code == 200


def test_a_public_address_without_a_key_warns_and_a_key_is_enforced(tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text('["hello there"]')
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "serve", "--script", str(script), "--host", "0.0.0.0",
                             "--port", str(port)], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "FREETOKEN_API_KEY": ""})
    try:
        assert "without an API key" in (proc.stderr.readline() if proc.stderr else "")
    finally:
        proc.kill()
        proc.wait()
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "serve", "--script", str(script), "--port", str(port),
                             "--api-key", "k1"], stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                status = httpx.get(f"{url}/health", timeout=1).status_code
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        assert status == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0)
        reply = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "hello there"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
