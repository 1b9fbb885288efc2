"""Logits-level controls over real HTTP on the built-in model: logit_bias, logprobs/top_logprobs (streamed and not,
chat, text and Responses), penalties (repetition_penalty too), min_p and n (streamed and not); and their processors
on known logits."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import anyio
import httpx
import openai
import pytest
import torch

from freetoken_agent import ScriptedBackend
from freetoken_agent.backends.base import GenerateRequest, GenerationDone, TextChunk
from freetoken_agent.backends.local import LocalEngine
from freetoken_agent.runtime.generation.processors import (
    Chain, LogitBias, LogprobRecorder, MinP, Penalties, RepetitionPenalty,
)
from freetoken_agent.runtime.models import resolve_model
from freetoken_agent.server import serve_in_thread

HI = [{"role": "user", "content": "Fix the bug in calc.py."}]
REPETITIVE = [{"role": "user", "content": "import os\n" * 6}]
"""A prompt the built-in model continues with a repetitive greedy text (a third of 40 tokens distinct)."""


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
    text = client.completions.create(model="builtin", prompt="def add(a, b):", max_tokens=4, temperature=0,
                                     logprobs=2).choices[0].logprobs
    assert len(text.tokens) == len(text.token_logprobs) == len(text.top_logprobs) == 4


def _same(streamed: list[tuple[str, float]], whole: list[tuple[str, float]]) -> None:
    """Streamed and non-streamed runs of one greedy request: the same tokens, the same log probabilities (two runs
    of the engine: equal up to float noise, the second reusing the first's cached prompt)."""
    assert [t for t, _ in streamed] == [t for t, _ in whole] and len(whole) > 0
    assert all(math.isclose(a, b, abs_tol=1e-4) for (_, a), (_, b) in zip(streamed, whole)), (streamed, whole)


def test_streamed_chat_logprobs_come_with_their_text(served) -> None:
    client, _backend = served
    ask = dict(model="builtin", messages=HI, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**ask).choices[0].logprobs.content
    chunks = [c.choices[0] for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    texts = [c for c in chunks if c.delta.content]
    assert len(texts) > 3  # per token (or a few), not one list at the end
    for chunk in texts:  # each chunk carries the tokens whose text it carries
        assert "".join(e.token for e in chunk.logprobs.content) == chunk.delta.content
        for entry in chunk.logprobs.content:
            tops = [t.logprob for t in entry.top_logprobs]
            assert entry.logprob <= 0 and len(tops) == 3 and tops == sorted(tops, reverse=True)
    streamed = [(e.token, e.logprob) for c in chunks if c.logprobs for e in c.logprobs.content]
    _same(streamed, [(e.token, e.logprob) for e in whole])
    assert [c.finish_reason for c in chunks].count("length") == 1 and chunks[-1].finish_reason == "length"


def test_streamed_completion_logprobs_equal_the_whole(served) -> None:
    client, _backend = served
    ask = dict(model="builtin", prompt="def add(a, b):", max_tokens=8, temperature=0, logprobs=2)
    whole = client.completions.create(**ask).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**ask, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    for chunk in chunks:
        assert "".join(chunk.logprobs.tokens) == chunk.text and len(chunk.logprobs.top_logprobs) == len(
            chunk.logprobs.tokens)
        assert all(v <= 0 and len(top) == 2 for v, top in zip(chunk.logprobs.token_logprobs,
                                                                chunk.logprobs.top_logprobs))
    streamed = [pair for c in chunks for pair in zip(c.logprobs.tokens, c.logprobs.token_logprobs)]
    _same(streamed, list(zip(whole.logprobs.tokens, whole.logprobs.token_logprobs)))


def test_stream_text_chunks_carry_exactly_the_final_logprobs(served) -> None:
    """In one generation the chunks' log probabilities are the very entries the final event lists (what the
    non-streamed answer reports): a stop string holds text back, the held tokens come with the chunk that
    releases their text, the cut ones only at the end."""
    client, backend = served
    # the stop string: a later token of the model's own greedy text that does not occur before it
    plain = client.chat.completions.create(model="builtin", messages=HI, max_tokens=12, temperature=0.0,
                                           logprobs=True).choices[0].logprobs.content
    texts = [t.token for t in plain]
    stop = next(t for i, t in enumerate(texts) if i >= 2 and t.strip() and t not in "".join(texts[:i]))

    async def run() -> tuple[list, GenerationDone]:
        chunks, done = [], None
        async for item in backend.stream_text(GenerateRequest(messages=HI, max_tokens=12, logprobs=2,
                                                              stop=[stop])):
            if isinstance(item, TextChunk):
                chunks.append(item)
            else:
                done = item
        assert done is not None
        return chunks, done

    chunks, done = anyio.run(run)
    assert done.stop_sequence == stop and done.logprobs is not None
    carried = [e for c in chunks for e in c.logprobs]
    assert all(len(c.logprobs) == c.tokens for c in chunks) and sum(c.tokens for c in chunks) == len(carried)
    assert tuple(carried) == done.logprobs[:len(carried)] and len(done.logprobs) == done.usage.completion_tokens
    assert done.logprobs[len(carried)].text.startswith(stop)  # the stop's token: no text, listed at the end only


def test_penalties_change_a_repetitive_greedy_text(served) -> None:
    client, _backend = served

    def tokens(temperature: float = 0.0, **kwargs) -> list[str]:
        reply = client.chat.completions.create(model="builtin", messages=REPETITIVE, max_tokens=40,
                                               temperature=temperature,
                                               seed=1, logprobs=True, **kwargs)
        return [t.token for t in reply.choices[0].logprobs.content]

    plain, penalized = tokens(), tokens(frequency_penalty=2.0, presence_penalty=2.0)
    assert len(set(penalized)) / len(penalized) > len(set(plain)) / len(plain)  # fewer repeats
    # min_p 1 keeps only the most likely token: sampling at temperature 1 is then greedy
    assert tokens(1.0, extra_body={"min_p": 1.0}) == plain != tokens(1.0)


def test_repetition_penalty_is_transformers_processor() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    for penalty in (1.3, 0.7, 2.0):
        prompt = torch.randint(0, 50, (20,), generator=gen).tolist()
        mine = RepetitionPenalty(penalty, prompt)
        theirs = RepetitionPenaltyLogitsProcessor(penalty)
        seen = list(prompt)
        for _step in range(6):
            logits = torch.randn(64, generator=gen) * 4  # positive and negative logits
            expected = theirs(torch.tensor([seen]), logits[None].clone())[0]
            assert torch.allclose(mine(logits), expected, atol=0, rtol=1e-6)
            token = int(torch.randint(0, 64, (1,), generator=gen))
            mine.accept(token)
            seen.append(token)


def test_repetition_penalty_over_http(served) -> None:
    """Each pick's distribution is the model's logits after transformers' processor over the prompt and the tokens
    generated before it (replayed here greedily, one prefill per step)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    client, backend = served
    tokenizer = backend.engine.tokenizer
    reply = client.chat.completions.create(model="builtin", messages=REPETITIVE, max_tokens=8, temperature=0,
                                           logprobs=True,
                                           top_logprobs=5, extra_body={"repetition_penalty": 1.8})
    entries = reply.choices[0].logprobs.content
    seq = tokenizer.encode(backend.render(GenerateRequest(messages=REPETITIVE)))
    session = backend.engine.session()
    for entry in entries:
        logits = session.prefill_logits(seq)[1][-1].float()
        processed = RepetitionPenaltyLogitsProcessor(1.8)(torch.tensor([seq]), logits[None].clone())[0]
        values, top = torch.topk(torch.log_softmax(processed, -1), 5)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([int(i)]) for i in top]
        assert all(math.isclose(t.logprob, float(v), abs_tol=1e-3) for t, v in zip(entry.top_logprobs, values))
        seq.append(int(top[0]))
    session.close()
    plain = client.chat.completions.create(model="builtin", messages=REPETITIVE, max_tokens=8, temperature=0)
    assert plain.choices[0].message.content != reply.choices[0].message.content

    def words(**extra) -> list[str]:
        reply = client.chat.completions.create(model="builtin", messages=REPETITIVE, max_tokens=40, temperature=0,
                                               logprobs=True, extra_body=extra)
        return [t.token for t in reply.choices[0].logprobs.content]

    base, fewer = words(), words(repetition_penalty=1.5)
    assert len(set(fewer)) / len(fewer) > len(set(base)) / len(base)  # fewer repeats
    for bad in (0, -1, 11, "x"):
        with pytest.raises(openai.BadRequestError, match="repetition_penalty"):
            client.chat.completions.create(model="builtin", messages=REPETITIVE, max_tokens=1,
                                           extra_body={"repetition_penalty": bad})


def test_n_choices(served) -> None:
    client, _backend = served
    reply = client.chat.completions.create(model="builtin", messages=HI, max_tokens=8, temperature=1.0, seed=3, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1  # seeds 3, 4, 5
    again = client.chat.completions.create(model="builtin", messages=HI, max_tokens=8, temperature=1.0, seed=3, n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    assert 3 <= reply.usage.completion_tokens <= 24  # the three completions' tokens, the prompt counted once


def test_n_streamed_choices_equal_the_whole(served) -> None:
    client, _backend = served
    # more tokens than one step can give a choice (a token and up to 7 verified drafts: the streamed request drafts
    # the whole request's replies from the engine's history), so the three must share steps
    ask = dict(model="builtin", messages=HI, max_tokens=24, temperature=1.0, seed=3, n=3)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices  # one choice per chunk, named by its index
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason:
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert texts == {c.index: c.message.content for c in whole.choices} and len(set(texts.values())) > 1
    order = [c.choices[0].index for c in chunks[:-1]]
    assert order.index(2) < len(order) - 1 - order[::-1].index(0)  # generated side by side, not one after another
    assert finishes == {c.index: [c.finish_reason] for c in whole.choices}
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    text_ask = dict(model="builtin", prompt="def add(a, b):", max_tokens=6, temperature=1.0, seed=5, n=2)
    plain = client.completions.create(**text_ask)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**text_ask, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in plain.choices} and streamed[0] != streamed[1]


def test_a_client_leaving_an_n_stream_stops_every_choice(served) -> None:
    client, backend = served
    scheduler = lambda: backend.engine.stats()["scheduler"]  # noqa: E731
    before = scheduler()["cancelled"]
    # End-of-sequence is banned so that no choice can finish on its own before the client leaves: each of the three
    # must be stopped by the cancellation (a sampled EOS once made this count 2 of 3 on CI).
    no_eos = {str(t): -100 for t in backend.engine.eos_token_ids}
    stream = client.chat.completions.create(model="builtin", messages=HI, max_tokens=1000, temperature=1.0, n=3,
                                            stream=True, logit_bias=no_eos)
    for n, _chunk in enumerate(stream):
        if n >= 6:
            break
    stream.close()  # the connection closes mid-stream
    deadline = time.monotonic() + 30
    while scheduler()["cancelled"] < before + 3 or scheduler()["running"]:
        assert time.monotonic() < deadline, f"choices kept generating after the client left: {scheduler()}"
        time.sleep(0.1)


def test_responses_logprobs(served) -> None:
    client, _backend = served
    ask = dict(model="builtin", input="Fix the bug in calc.py.", max_output_tokens=8, temperature=0, top_logprobs=3)
    whole = client.responses.create(**ask)
    part = whole.output[-1].content[0]
    assert part.type == "output_text" and len(part.logprobs) > 0
    assert "".join(e.token for e in part.logprobs) == part.text
    for entry in part.logprobs:
        tops = [t.logprob for t in entry.top_logprobs]
        assert entry.logprob <= 0 and len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert bytes(entry.bytes).decode() == entry.token
    events = list(client.responses.create(**ask, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    for delta in deltas:
        assert "".join(e.token for e in delta.logprobs) == delta.delta
    streamed = [(e.token, e.logprob) for d in deltas for e in d.logprobs]
    _same(streamed, [(e.token, e.logprob) for e in part.logprobs])
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response.output[-1].content[0]
    assert [e.logprob for e in done.logprobs] == [e.logprob for e in final.logprobs] == [e for _, e in streamed]
    assert events[-1].response.top_logprobs == 3
    only = client.responses.create(model="builtin", input="Fix the bug in calc.py.", max_output_tokens=4,
                                   temperature=0, include=["message.output_text.logprobs"])
    entries = only.output[-1].content[0].logprobs
    assert len(entries) > 0 and all(e.top_logprobs == [] and e.logprob <= 0 for e in entries)
    plain = client.responses.create(model="builtin", input="Fix the bug in calc.py.", max_output_tokens=4,
                                    temperature=0)
    assert plain.output[-1].content[0].logprobs == []


def test_a_backend_without_logits_refuses_by_name() -> None:
    with serve_in_thread(ScriptedBackend(["ok"] * 4), "m") as url:
        for path, extra, field in [
                ("chat/completions", {"logprobs": True}, "logprobs"),
                ("chat/completions", {"logprobs": True, "stream": True}, "logprobs"),
                ("chat/completions", {"frequency_penalty": 1}, "frequency_penalty"),
                ("chat/completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
                ("chat/completions", {"logit_bias": {"5": 3}}, "logit_bias"),
                ("chat/completions", {"min_p": 0.1}, "min_p"),
                ("completions", {"prompt": "x", "logprobs": 1, "stream": True}, "logprobs"),
                ("responses", {"input": "x", "top_logprobs": 2}, "top_logprobs"),
                ("responses", {"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
                ("responses", {"input": "x", "repetition_penalty": 1.1}, "repetition_penalty")]:
            body = extra if path != "chat/completions" else {"messages": HI, **extra}
            reply = httpx.post(f"{url}/{path}", json=body)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == field, (path, extra, reply.text)
        ok = httpx.post(f"{url}/chat/completions", json={"messages": HI, "n": 2})  # n is the server's: any backend
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        chunks = list(client.chat.completions.create(model="m", messages=HI, n=2, stream=True))
        assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "okok"
