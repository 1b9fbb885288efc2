"""Logits-level controls over real HTTP on the built-in model: logit_bias, logprobs/top_logprobs, penalties, min_p
and n; and their processors on known logits."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from freetoken_agent import ScriptedBackend
from freetoken_agent.backends.local import LocalEngine
from freetoken_agent.runtime.generation.processors import Chain, LogitBias, LogprobRecorder, MinP, Penalties
from freetoken_agent.runtime.models import resolve_model
from freetoken_agent.server import serve_in_thread

HI = [{"role": "user", "content": "Fix the bug in calc.py."}]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[openai.OpenAI, LocalEngine]]:
    torch.set_num_threads(1)
    backend = LocalEngine.from_pretrained(resolve_model("builtin"))
    with serve_in_thread(backend, "builtin") as url:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300), backend


def test_processors_on_known_logits() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -5.0])
    penalties = Penalties(frequency=0.5, presence=1.0)
    penalties.accept(0)
    penalties.accept(0)
    penalties.accept(2)
    assert penalties(logits).tolist() == [2.0 - 1.0 - 1.0, 1.0, 0.0 - 0.5 - 1.0, -5.0]
    assert LogitBias({3: 100.0, 0: -100.0})(logits).tolist() == [-98.0, 1.0, 0.0, 95.0]
    kept = MinP(0.3, temperature=1.0)(logits)  # p1/p0 = e^-1 = 0.37 ≥ 0.3 kept; e^-2 = 0.14 dropped
    assert torch.isfinite(kept).tolist() == [True, True, False, False]
    recorder = LogprobRecorder(top=2)
    chain = Chain([LogitBias({1: 5.0}), recorder])
    chain(logits)
    chain.accept(1)
    entry = recorder.entries[0]
    expected = torch.log_softmax(torch.tensor([2.0, 6.0, 0.0, -5.0]), -1)
    assert entry.token == 1 and math.isclose(entry.logprob, float(expected[1]), rel_tol=1e-6)
    assert [i for i, _ in entry.top] == [1, 0]


def test_logit_bias_forces_and_bans_tokens(served) -> None:
    client, backend = served
    forced = backend.engine.tokenizer.encode(" calc")[-1]
    reply = client.chat.completions.create(model="builtin", messages=HI, max_tokens=4, temperature=0,
                                           logit_bias={str(forced): 100})
    assert reply.choices[0].message.content == backend.engine.tokenizer.decode([forced] * 4)
    plain = client.chat.completions.create(model="builtin", messages=HI, max_tokens=1, temperature=0, logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    first_id = backend.engine.tokenizer.encode(first)[-1]
    banned = client.chat.completions.create(model="builtin", messages=HI, max_tokens=1, temperature=0, logprobs=True,
                                            logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.chat.completions.create(model="builtin", messages=HI, max_tokens=1, logit_bias={"99999": 5})


def test_logprobs_are_the_greedy_distribution(served) -> None:
    client, _backend = served
    reply = client.chat.completions.create(model="builtin", messages=HI, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and sum(math.exp(t) for t in tops) <= 1 + 1e-5
        assert math.isclose(entry.logprob, tops[0], abs_tol=1e-5)  # greedy picks the most likely token
    streamed = [c for c in client.chat.completions.create(model="builtin", messages=HI, max_tokens=6, temperature=0,
                                                          logprobs=True, top_logprobs=3, stream=True)]
    tail = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert len(tail) == 1 and [e.logprob for e in tail[0].content] == [e.logprob for e in content]
    text = client.completions.create(model="builtin", prompt="def add(a, b):", max_tokens=4, temperature=0,
                                     logprobs=2).choices[0].logprobs
    assert len(text.tokens) == len(text.token_logprobs) == len(text.top_logprobs) == 4


def test_penalties_change_a_repetitive_greedy_text(served) -> None:
    client, _backend = served

    def tokens(temperature: float = 0.0, **kwargs) -> list[str]:
        reply = client.chat.completions.create(model="builtin", messages=HI, max_tokens=40, temperature=temperature,
                                               seed=1, logprobs=True, **kwargs)
        return [t.token for t in reply.choices[0].logprobs.content]

    plain, penalized = tokens(), tokens(frequency_penalty=2.0, presence_penalty=2.0)
    assert len(set(penalized)) / len(penalized) > len(set(plain)) / len(plain)  # fewer repeats
    # min_p 1 keeps only the most likely token: sampling at temperature 1 is then greedy
    assert tokens(1.0, extra_body={"min_p": 1.0}) == plain != tokens(1.0)


def test_n_choices(served) -> None:
    client, _backend = served
    reply = client.chat.completions.create(model="builtin", messages=HI, max_tokens=8, temperature=1.0, seed=3, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1  # seeds 3, 4, 5
    again = client.chat.completions.create(model="builtin", messages=HI, max_tokens=8, temperature=1.0, seed=3, n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    assert 3 <= reply.usage.completion_tokens <= 24  # the three completions' tokens, the prompt counted once


def test_a_backend_without_logits_refuses_by_name() -> None:
    with serve_in_thread(ScriptedBackend(["ok"] * 4), "m") as url:
        for extra, field in [({"logprobs": True}, "logprobs"), ({"frequency_penalty": 1}, "frequency_penalty"),
                             ({"logit_bias": {"5": 3}}, "logit_bias"), ({"min_p": 0.1}, "min_p")]:
            reply = httpx.post(f"{url}/chat/completions", json={"messages": HI, **extra})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == field
        ok = httpx.post(f"{url}/chat/completions", json={"messages": HI, "n": 2})  # n is the server's: any backend
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
