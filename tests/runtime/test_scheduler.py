"""The scheduler and the batched runner: concurrent requests equal the same requests alone (three families, one
hybrid), a random arrival / cancel / preemption fuzz returns every page, decode keeps going while a long prompt
prefills, and requests are bounded by the context."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken_agent.runtime.engine import ContextLengthError, Engine, Request, RequestCancelled
from freetoken_agent.runtime.generation.sampling import SamplingParams
from freetoken_agent.runtime.kv import KVConfig

pytest.importorskip("transformers")
from tests.runtime.arch_configs import save_checkpoint  # noqa: E402
from tests.runtime.batched_engines import batch_invariant, engine  # noqa: E402,F401 (fixtures)


def prompts(n: int, seed: int, vocab: int = 512, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(vocab) for _ in range(g.randint(lo, hi))] for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, stop_token_ids=())


class Slow:
    """A logits processor that takes 10 ms per pick: n tokens take at least n × 10 ms however fast the machine decodes
    (and speculation accepts), so requests of that length stay in flight while a test looks at them. (It cannot block
    outright: a step holds the engine's lock, which hints take.)"""

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        time.sleep(0.01)
        return logits

    def accept(self, token: int) -> None:
        pass


def slow(n: int) -> SamplingParams:
    """Greedy ``n`` tokens that stay in flight for at least n × 10 ms (see ``Slow``)."""
    return SamplingParams(max_new_tokens=n, stop_token_ids=(), processor=Slow())


def test_concurrent_requests_match_alone(engine: Engine) -> None:
    ps = prompts(8, seed=1)
    alone = [engine.generate(p, greedy(10)).token_ids for p in ps]
    results: list[list[int] | None] = [None] * len(ps)
    start = threading.Barrier(len(ps))

    def run(i: int) -> None:
        start.wait()
        results[i] = engine.generate(ps[i], greedy(10)).token_ids

    before = engine.scheduler.stats.max_batch
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == alone
    assert engine.scheduler.stats.max_batch >= 4 or before >= 4  # they really shared steps
    # and through sessions (prefix reuse from the cache on the second turn), several at once
    sessions = [engine.session() for _ in range(4)]
    handles = [s.submit(Request(ps[i], greedy(6))) for i, s in enumerate(sessions)]
    assert [h.result().token_ids for h in handles] == [a[:6] for a in alone[:4]]
    turn2 = [ps[i] + alone[i][:6] + [7, 8] for i in range(4)]
    handles = [s.submit(Request(turn2[i], greedy(5))) for i, s in enumerate(sessions)]
    assert [h.result().token_ids for h in handles] == [engine.generate(t, greedy(5)).token_ids for t in turn2]
    for s in sessions:
        s.close()


def test_logits_of_a_batched_row_equal_alone(engine: Engine) -> None:
    p = prompts(1, seed=2)[0]
    ref = engine.logits(p)
    others = [engine.submit(Request(q, greedy(30))) for q in prompts(3, seed=3)]
    got = engine.submit(Request(p, kind="logits", reuse=False)).result().logits
    for h in others:
        h.result()
    assert torch.equal(got, ref)


def test_fuzz_arrivals_cancels_preemption_return_every_page(tmp_path: Path) -> None:
    save_checkpoint("qwen3_moe", tmp_path)
    engine = Engine.from_pretrained(tmp_path)
    manager = engine.kv_manager(KVConfig(page_size=4, device_pages=48))  # 192 positions for up to 16 sequences
    g = random.Random(7)
    reqs = [(p, g.randint(1, 12), g.random() < 0.25) for p in prompts(240, seed=8, lo=2, hi=30)]
    handles: list = [None] * len(reqs)

    def client(k: int) -> None:
        rng = random.Random(k)
        for i in range(k, len(reqs), 4):
            prompt, n, cancel = reqs[i]
            handles[i] = engine.submit(Request(prompt, greedy(n)))
            if cancel:
                for _ in zip(range(rng.randint(0, 2)), handles[i]):
                    pass
                handles[i].cancel()
            elif rng.random() < 0.3:
                handles[i].wait(timeout=60)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "a client hung"
    finished = 0
    for (prompt, n, cancel), h in zip(reqs, handles):
        assert h.wait(timeout=120), "a request never finished"
        try:
            out = h.result().token_ids
        except RequestCancelled:
            assert cancel
            continue
        finished += 1
        assert len(out) == n
    assert finished >= len(reqs) // 2
    st = engine.scheduler.stats
    assert st.preemptions > 0 and st.max_batch > 1
    # preempted and recomputed sequences produced exactly what they produce alone
    for (prompt, n, cancel), h in list(zip(reqs, handles))[:40]:
        if not cancel:
            assert h.result().token_ids == engine.generate(prompt, greedy(n)).token_ids
    assert not engine.scheduler.running and not engine.scheduler.waiting
    manager.radix.evict(manager.pool.num_pages)  # what is left is the prefix cache's, and it is evictable
    assert manager.pool.num_used == 0
    engine.close()


def test_sequences_that_do_not_fit_together_take_turns(tmp_path: Path) -> None:
    """Prompts that each fit the KV pool alone but not two at a time, prefilled in small chunks side by side: the
    youngest yields its pages rather than taking an older one's, so the oldest always finishes. (Each used to preempt
    whichever other one ran: two long sequences then preempted each other forever, each losing its work first.)"""
    save_checkpoint("qwen3_moe", tmp_path, max_position_embeddings=1024)
    engine = Engine.from_pretrained(tmp_path, speculate=False)
    engine.kv_manager(KVConfig(page_size=4, device_pages=100))  # 400 positions: one 300-token prompt at a time
    engine.scheduler.token_budget = 32
    long = prompts(3, seed=11, lo=300, hi=300)
    handles = [engine.submit(Request(p, greedy(6))) for p in long]
    for h in handles:
        assert h.wait(timeout=120), "sequences that do not fit together never finished"
    assert [h.result().token_ids for h in handles] == [engine.generate(p, greedy(6)).token_ids for p in long]
    assert engine.scheduler.stats.preemptions <= 4 * len(long)
    engine.close()


def test_decode_continues_while_a_long_prompt_prefills(tmp_path: Path) -> None:
    save_checkpoint("qwen3_moe", tmp_path)
    engine = Engine.from_pretrained(tmp_path)
    engine.kv_manager(KVConfig(page_size=4, device_pages=512))
    engine.scheduler.token_budget = 16  # one step: 16 tokens (decode rows + one prefill chunk)
    short = engine.submit(Request(prompts(1, seed=9)[0], greedy(60)))
    it = iter(short)
    steps = [next(it).step]
    long = engine.submit(Request(prompts(1, seed=10, lo=400, hi=400)[0], greedy(2)))
    steps += [ev.step for ev in it]
    first_long = next(iter(long)).step
    prefill_steps = range(steps[0] + 1, first_long)
    assert len(prefill_steps) >= 400 // 16  # the long prompt took that many steps...
    during = [s for s in steps if s in prefill_steps]
    assert len(during) >= 20  # ...and the short one kept decoding through them,
    assert max(b - a for a, b in zip(steps, steps[1:])) == 1  # one token every step, never a gap
    engine.close()


def test_requests_are_bounded_by_the_context(tmp_path: Path) -> None:
    save_checkpoint("qwen3_moe", tmp_path, max_position_embeddings=64)
    engine = Engine.from_pretrained(tmp_path)
    with pytest.raises(ContextLengthError, match="64 positions"):
        engine.generate(list(range(64)), max_new_tokens=1)
    with pytest.raises(ContextLengthError):
        engine.generate(list(range(100)), max_new_tokens=1)
    out = engine.generate(list(range(60)), max_new_tokens=10**9, stop_token_ids=[])
    assert len(out.token_ids) == 4 and out.finish_reason == "length"  # clipped to the context, never past it
    assert len(engine.logits(list(range(64)))) == 64
    engine.close()


def test_cancel_frees_pages_and_idle_tool_sessions_yield_first(tmp_path: Path) -> None:
    save_checkpoint("qwen3_moe", tmp_path)
    engine = Engine.from_pretrained(tmp_path)
    manager = engine.kv_manager(KVConfig(page_size=4, device_pages=40))
    h = engine.submit(Request(prompts(1, seed=11)[0], slow(400)))
    for _, _ in zip(range(3), h):
        pass
    h.cancel()
    with pytest.raises(RequestCancelled):
        h.result()
    manager.radix.evict(manager.pool.num_pages)
    assert manager.pool.num_used == 0
    coding, tooling = engine.session(), engine.session()
    coding.generate(prompts(1, seed=12, lo=50, hi=50)[0], greedy(2))
    tooling.generate(prompts(1, seed=13, lo=50, hi=50)[0], greedy(2))
    coding.hint("code")
    tooling.hint("tool")  # waiting on a tool: its KV goes first when a running request needs pages
    held = list(coding.cache.pages)
    engine.generate(prompts(1, seed=14, lo=60, hi=60)[0], greedy(2))
    assert tooling.cache.pages == [] and coding.cache.pages == held
    assert engine.scheduler.stats.idle_session_evictions == 1
    engine.close()


def outcome(handle: Any) -> str:
    """What became of a request (for assertion messages): running, or its finish reason or error."""
    if not handle.done:
        return "running"
    try:
        return handle.result().finish_reason
    except Exception as exc:  # noqa: BLE001 - reported, not handled
        return f"{type(exc).__name__}: {exc}"


def test_residency_follows_the_phases_of_the_batch(tmp_path: Path) -> None:
    from freetoken_agent.runtime.experts.setup import ResidencyConfig
    from freetoken_agent.runtime.memory import Budget

    save_checkpoint("qwen3_moe", tmp_path, max_position_embeddings=4096)
    engine = Engine.from_pretrained(tmp_path, budget=Budget(), residency=ResidencyConfig(policy="phase"))
    policy = engine.residency.host.policy
    coders = [engine.session() for _ in range(2)]
    planner = engine.session()
    planner.hint("plan")
    assert policy.phase == "plan"  # alone: a hint switches residency
    handles = []
    for s, p in zip(coders, prompts(2, seed=15)):
        s.hint("code")
        handles.append(s.submit(Request(p, slow(4000))))
    assert policy.phase == "code"
    planner.hint("plan")  # one planner against two coders in flight: residency stays with the batch
    assert policy.phase == "code" and planner.phase == "plan", (
        [outcome(h) for h in handles], engine.scheduler.phase_mix(), engine.stats()["scheduler"])
    planner.hint("tool")  # an agent waiting on a tool runs nothing: no switch either
    assert policy.phase == "code"
    for h in handles:
        h.cancel()
        h.wait(timeout=60)
    planner.hint("plan")  # the coders are done: the planner's hint is the batch again
    assert policy.phase == "plan"
    assert engine.stats()["phase_hints"]["plan"] == 3
    engine.close()


@pytest.mark.parametrize("quant", [("q4", "q8"), ("q8", "none")])
def test_quantized_outputs_do_not_depend_on_cache_or_batch(tmp_path: Path, quant: tuple[str, str]) -> None:
    save_checkpoint("qwen3_moe", tmp_path)
    engine = Engine.from_pretrained(tmp_path, quant=quant[0], dense_quant=quant[1])
    engine.kv_manager(KVConfig(page_size=4, device_pages=1024))
    ps = prompts(4, seed=16, lo=20, hi=40)
    cold = [engine.submit(Request(p, greedy(8), reuse=False)).result().token_ids for p in ps]  # computed alone
    warm = [h.result().token_ids for h in [engine.submit(Request(p, greedy(8))) for p in ps]]  # batched
    again = [h.result().token_ids for h in [engine.submit(Request(p, greedy(8))) for p in ps]]  # prefixes cached
    assert warm == cold and again == cold
    assert engine.stats()["reused_tokens"] > 0
    # a prefix computed token by token (a reply) and reused by the next turn gives the logits a cold run gives
    session = engine.session()
    reply = session.generate(ps[0], greedy(6)).token_ids
    turn2 = ps[0] + reply + [3, 4, 5]
    reused, logits = session.prefill_logits(turn2)
    assert reused >= len(ps[0])
    assert torch.equal(logits, engine.logits(turn2)[reused:])
    engine.close()
