"""Generation: sampling rules, stop tokens/strings, streaming, chat — on a real (synthetic) checkpoint."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.generation import Sampler, SamplingParams, StopChecker
from freetoken_agent.runtime.synthetic import write_synthetic


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    folder = write_synthetic("mixtral", tmp_path_factory.mktemp("m"), num_hidden_layers=2, hidden_size=64,
                             intermediate_size=64, vocab_size=400)
    return Engine.from_pretrained(folder)


PROMPT = [5, 17, 230, 44, 9, 101]


def test_greedy_equals_argmax_of_logits(engine: Engine) -> None:
    out = engine.generate(PROMPT, max_new_tokens=6, stop_token_ids=[])
    ids = list(PROMPT)
    for token in out.token_ids:
        assert token == int(engine.logits(ids)[-1].argmax())
        ids.append(token)
    assert out.finish_reason == "length" and out.completion_tokens == 6


def test_sampling_is_seeded_and_truncation_works(engine: Engine) -> None:
    a = engine.generate(PROMPT, max_new_tokens=12, temperature=1.5, seed=7, stop_token_ids=[]).token_ids
    b = engine.generate(PROMPT, max_new_tokens=12, temperature=1.5, seed=7, stop_token_ids=[]).token_ids
    c = engine.generate(PROMPT, max_new_tokens=12, temperature=1.5, seed=8, stop_token_ids=[]).token_ids
    assert a == b and a != c
    greedy = engine.generate(PROMPT, max_new_tokens=8, stop_token_ids=[]).token_ids
    assert engine.generate(PROMPT, max_new_tokens=8, temperature=2.0, top_k=1, seed=3, stop_token_ids=[]).token_ids == greedy
    assert engine.generate(PROMPT, max_new_tokens=8, temperature=2.0, top_p=1e-6, seed=3, stop_token_ids=[]).token_ids == greedy


def test_top_k_and_top_p_restrict_support() -> None:
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    seen_k = {Sampler(SamplingParams(temperature=5.0, top_k=2, seed=s))(logits) for s in range(200)}
    assert seen_k == {0, 1}
    probs = torch.softmax(logits, 0)  # [0.64, 0.24, 0.09, ...]: top_p=0.8 keeps the first two
    assert probs[0] < 0.8 < probs[:2].sum()
    seen_p = {Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=s))(logits) for s in range(300)}
    assert seen_p == {0, 1}


def test_stop_token_and_stop_string(engine: Engine) -> None:
    free = engine.generate(PROMPT, max_new_tokens=10, stop_token_ids=[])
    third = free.token_ids[2]
    stopped = engine.generate(PROMPT, max_new_tokens=10, stop_token_ids=[third])
    assert stopped.token_ids == free.token_ids[:3] and stopped.finish_reason == "stop"
    text = free.text
    needle = next((text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].strip()), None)
    if needle is None:
        pytest.skip("generated text has no printable span")
    cut = engine.generate(PROMPT, max_new_tokens=10, stop=[needle], stop_token_ids=[])
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(needle)]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab<>/x", max_size=40), st.lists(st.integers(1, 6), max_size=20),
       st.sampled_from(["</x>", "ab", "<>"]))
def test_stop_checker_streaming_equals_offline(text: str, cuts: list[int], stop: str) -> None:
    checker, out, pos, stopped = StopChecker((stop,)), [], 0, False
    for n in [*cuts, len(text)]:
        piece, pos = text[pos : pos + n], pos + n
        emitted, stopped = checker.feed(piece)
        out.append(emitted)
        if stopped:
            break
    if not stopped:
        out.append(checker.flush())
    expected = text[: text.find(stop)] if stop in text else text
    assert "".join(out) == expected


def test_async_stream_matches_generate_and_cancels(engine: Engine) -> None:
    expected = engine.generate(PROMPT, max_new_tokens=8, stop_token_ids=[])

    async def collect() -> list[int]:
        return [ev.token_id async for ev in engine.stream(PROMPT, max_new_tokens=8, stop_token_ids=[])]

    assert anyio.run(collect) == expected.token_ids

    async def cancel_early() -> list[int]:
        got: list[int] = []
        with anyio.move_on_after(30) as scope:
            async for ev in engine.stream(PROMPT, max_new_tokens=10_000, stop_token_ids=[]):
                got.append(ev.token_id)
                if len(got) == 3:
                    scope.cancel()
        return got

    assert len(anyio.run(cancel_early)) == 3


def test_chat_and_invalid_params(engine: Engine) -> None:
    result = engine.chat([{"role": "user", "content": "hello"}], max_new_tokens=4)
    assert result.prompt_tokens > 3 and 1 <= result.completion_tokens <= 4
    with pytest.raises(FreeTokenError, match="top_p"):
        engine.generate(PROMPT, top_p=0.0)
    with pytest.raises(FreeTokenError, match="empty"):
        engine.generate([])
    stats = engine.stats()
    assert stats["generated_tokens"] > 0 and stats["decode_tok_s"] > 0


def test_greedy_picks_of_a_row() -> None:
    """A verify row's greedy tokens in one pass: each position's argmax, NaN refused only where a pick is taken,
    and nothing for sampled or processed requests (those go position by position)."""
    from freetoken_agent.runtime.generation.sampling import NumericalError

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g)
    logits[4, 7] = float("nan")
    sampler = Sampler(SamplingParams(temperature=0.0))
    tokens, values = sampler.greedy_picks(logits)
    assert tokens[:4] == [int(torch.argmax(logits[j])) for j in range(4)]
    assert [sampler.take_greedy(tokens[j], values[j]) for j in range(4)] == tokens[:4]
    assert sampler.index == 4
    with pytest.raises(NumericalError):
        sampler.take_greedy(tokens[4], values[4])
    assert Sampler(SamplingParams(temperature=0.7)).greedy_picks(logits) is None
    processed = SamplingParams(temperature=0.0, processor=lambda x: x)
    assert Sampler(processed).greedy_picks(logits) is None
