"""Speculative decoding (drafts from the context, verified as one row of the batched step): greedy output equals
greedy output without it for three families (GQA, MLA, hybrid Gated DeltaNet) alone and under concurrency, with
drafts that are really accepted and really rejected; stateful processors see exactly the kept tokens; sampled
output follows the model's distribution; rejected drafts' pages go back to the pool; the option and the stats; drafts
from the engine's history of earlier outputs."""

from __future__ import annotations

import math
import random
import threading
from pathlib import Path

import pytest
import torch

from freetoken_agent.runtime.engine import Engine, Request
from freetoken_agent.runtime.errors import OptionError
from freetoken_agent.runtime.generation.processors import Chain, LogprobRecorder, Penalties, RepetitionPenalty
from freetoken_agent.runtime.generation.sampling import Sampler, SamplingParams
from freetoken_agent.runtime.generation.speculative import (
    ContextLookup,
    PromptLookup,
    SpeculationConfig,
    StepCost,
    TokenHistory,
    best_draft_length,
    expected_tokens,
    vote,
)
from freetoken_agent.runtime.kernels import ops
from freetoken_agent.runtime.kv import KVConfig

pytest.importorskip("transformers")
from tests.runtime.arch_configs import save_checkpoint  # noqa: E402
from tests.runtime.batched_engines import batch_invariant, engine  # noqa: E402,F401 (fixtures)


def repeating_prompts(n: int, seed: int, vocab: int = 512) -> list[list[int]]:
    """Prompts of different lengths that repeat their own content (what an agent's context looks like)."""
    g = random.Random(seed)
    out = []
    for _ in range(n):
        base = [g.randrange(vocab) for _ in range(g.randint(4, 14))]
        out.append(base + [g.randrange(vocab) for _ in range(g.randint(0, 6))] + base + base[: g.randint(1, 4)])
    return out


def greedy(n: int, processor=None) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, stop_token_ids=(), processor=processor)


class Oracle:
    """A drafter that knows each prompt's greedy continuation and gets every third draft token wrong: drafts that
    are accepted, then rejected, whatever the random weights do."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.references, self.vocab = references, vocab

    def propose(self, tokens: list[int], k: int) -> list[int]:
        for prompt, ref in self.references.items():
            if tuple(tokens[: len(prompt)]) == prompt and tokens[len(prompt):] == ref[: len(tokens) - len(prompt)]:
                done = len(tokens) - len(prompt)
                draft = list(ref[done : done + k])
                for i in range(len(draft)):
                    if (done + i) % 3 == 2:
                        draft[i] = (draft[i] + 1) % self.vocab
                return draft
        return []


def run_concurrently(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    handles = [engine.submit(Request(p, q)) for p, q in zip(prompts, params)]  # all queued before the first step
    return [h.result(timeout=300).token_ids for h in handles]


def test_greedy_output_is_identical_with_speculation(engine: Engine) -> None:
    ps = repeating_prompts(6, seed=1)
    lengths = [24, 9, 31, 16, 20, 12]
    engine.speculation = False
    alone = [engine.generate(p, greedy(n)).token_ids for p, n in zip(ps, lengths)]
    assert engine.stats()["speculation"]["verify_rows"] == 0

    # prompt lookup, several requests of different lengths in one batch
    engine.speculation = True
    before = engine.scheduler.stats.max_batch
    assert run_concurrently(engine, ps, [greedy(n) for n in lengths]) == alone
    assert engine.scheduler.stats.max_batch >= 4 or before >= 4

    # drafts that are accepted and rejected in turn, always drafted (cost 0), alone and batched
    references = {tuple(p): a for p, a in zip(ps, alone)}
    vocab = engine.spec.vocab_size
    engine.speculation = SpeculationConfig(verify_cost=0.0, max_draft=5, drafter=lambda: Oracle(references, vocab))
    s0 = engine.scheduler.speculation_snapshot()
    assert [engine.generate(p, greedy(n)).token_ids for p, n in zip(ps[:2], lengths)] == alone[:2]
    assert run_concurrently(engine, ps, [greedy(n) for n in lengths]) == alone
    s1 = engine.scheduler.speculation_snapshot()
    assert s1["accepted"] - s0["accepted"] > 20  # verification really kept drafts...
    assert s1["rolled_back"] > s0["rolled_back"]  # ...and really threw some away
    assert s1["emitted"] - s0["emitted"] > s1["verify_rows"] - s0["verify_rows"]  # more than a token per row
    if engine.kv_manager().stateful:  # hybrid: partial rejections rewound the recurrent states and replayed
        assert s1["replayed"] > s0["replayed"]
    # and a session's second turn (cache reuse) speculating from its first
    session = engine.session()
    assert session.generate(ps[0], greedy(lengths[0])).token_ids == alone[0]
    turn2 = ps[0] + alone[0] + ps[0][:5]
    engine.speculation = False
    want = engine.generate(turn2, greedy(12)).token_ids
    engine.speculation = True
    assert session.generate(turn2, greedy(12)).token_ids == want
    session.close()
    engine.speculation = True


def test_stateful_processors_see_exactly_the_kept_tokens(tmp_path: Path) -> None:
    save_checkpoint("qwen3_moe", tmp_path)
    engine = Engine.from_pretrained(tmp_path)
    ps = repeating_prompts(3, seed=4)

    def params(p: list[int]) -> tuple[SamplingParams, LogprobRecorder]:
        recorder = LogprobRecorder(top=3)
        chain = Chain([RepetitionPenalty(1.2, p), Penalties(0.3, 0.1), recorder])
        return greedy(20, chain), recorder

    results = {}
    for mode in (False, True):
        engine.speculation = SpeculationConfig(enabled=mode, verify_cost=0.0, max_draft=4)
        runs = [params(p) for p in ps]
        out = run_concurrently(engine, ps, [q for q, _ in runs])
        results[mode] = (out, [r.entries for _, r in runs])
    assert results[True][0] == results[False][0]
    for spec_entries, plain_entries, tokens in zip(results[True][1], results[False][1], results[True][0]):
        assert [e.token for e in spec_entries] == tokens  # one entry per kept token, in order
        assert spec_entries == plain_entries
    assert engine.stats()["speculation"]["drafted"] > 0
    engine.close()


def exact_first_tokens(engine: Engine, prompt: list[int], params: SamplingParams, n: int) -> dict[tuple, float]:
    """The exact distribution of the first ``n`` sampled tokens (every continuation's logits, processed)."""
    sampler = Sampler(params)
    out: dict[tuple, float] = {}

    def walk(prefix: tuple, p: float) -> None:
        if len(prefix) == n:
            out[prefix] = p
            return
        probs = sampler.distribution(engine.logits(prompt + list(prefix))[-1])
        for t in torch.nonzero(probs > 0).flatten().tolist():
            walk(prefix + (t,), p * float(probs[t]))

    walk((), 1.0)
    return out


def test_sampled_output_follows_the_model_distribution(tmp_path: Path) -> None:
    ops.set_deterministic(False)  # a distribution, not bits: the fast kernels
    vocab = 6
    save_checkpoint("qwen3_moe", tmp_path, vocab_size=vocab)
    engine = Engine.from_pretrained(tmp_path)
    engine.kv_manager(KVConfig(page_size=2, device_pages=4096))
    engine.scheduler.max_running = 64
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3]  # odd: a cached prefix leaves one token, so the first pick is drafted too
    params = SamplingParams(max_new_tokens=3, temperature=0.9, top_p=0.95, stop_token_ids=())
    exact = exact_first_tokens(engine, prompt, params, 3)

    class Likely:  # proposes the most likely completion of what was generated so far: often kept, often not
        def propose(self, tokens: list[int], k: int) -> list[int]:
            done = tuple(tokens[len(prompt):])
            best = max((c for c in exact if c[: len(done)] == done), key=exact.get, default=None)
            return [] if best is None else list(best[len(done) : len(done) + k])

    engine.speculation = SpeculationConfig(verify_cost=0.0, max_draft=3, drafter=Likely)
    engine.generate(prompt, params)  # publishes the prompt's pages: the others reuse all but its last token
    n = 1600
    handles = [engine.submit(Request(prompt, SamplingParams(max_new_tokens=3, temperature=0.9, top_p=0.95,
                                                            stop_token_ids=(), seed=s))) for s in range(n)]
    counts: dict[tuple, int] = {}
    for h in handles:
        key = tuple(h.result(timeout=300).token_ids)
        counts[key] = counts.get(key, 0) + 1
    st = engine.stats()["speculation"]
    assert st["accepted"] > 800 and st["drafted"] - st["accepted"] > 800  # both branches ran many times
    assert st["k_hist"].get(2, 0) > 1000  # the first pick was drafted with the second (a cached prefix)
    assert set(counts) <= set(exact)  # nothing the processed distribution forbids (top-p)
    # chi-square over cells with an expected count ≥ 5 (the rest pooled)
    big = [c for c in exact if exact[c] * n >= 5]
    observed = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    expected = [exact[c] * n for c in big] + [n * (1 - sum(exact[c] for c in big))]
    cells = [(o, e) for o, e in zip(observed, expected) if e > 0]
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    # p < 1e-4 threshold from the Wilson-Hilferty approximation of the chi-square quantile
    z = 3.72
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, limit, dof)
    for i in range(3):  # and each pick's marginal within sampling noise (total variation)
        marginal: dict[int, float] = {}
        for c, p in exact.items():
            marginal[c[i]] = marginal.get(c[i], 0.0) - p
        for c, m in counts.items():
            marginal[c[i]] = marginal.get(c[i], 0.0) + m / n
        assert 0.5 * sum(abs(v) for v in marginal.values()) < 0.05
    engine.close()


def test_rolled_back_pages_return_to_the_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rejected draft rolls its sequence's length back but keeps the pages (the next step writes into them:
    no page is released and taken again per verify step); when the request ends, every page it took is back."""
    from freetoken_agent.runtime.kv.paged import PagedKVCache

    shortened: list[int] = []  # truncations that dropped positions while the requests ran
    truncate = PagedKVCache.truncate

    def spy(cache: PagedKVCache, length: int) -> None:
        if 0 < length < cache.length:
            shortened.append(cache.length - length)
        truncate(cache, length)

    monkeypatch.setattr(PagedKVCache, "truncate", spy)
    for family in ("qwen3_moe", "qwen3_next"):
        folder = tmp_path / family
        save_checkpoint(family, folder)
        engine = Engine.from_pretrained(folder)
        manager = engine.kv_manager(KVConfig(page_size=2, device_pages=512))
        ps = repeating_prompts(4, seed=5)
        engine.speculation = False
        refs = {tuple(p): engine.submit(Request(p, greedy(18), reuse=False)).result().token_ids for p in ps}
        free = manager.pool.num_free
        engine.speculation = SpeculationConfig(verify_cost=0.0, max_draft=6,
                                               drafter=lambda: Oracle(refs, engine.spec.vocab_size))
        handles = [engine.submit(Request(p, greedy(18), reuse=False)) for p in ps]
        assert [h.result(timeout=300).token_ids for h in handles] == [refs[tuple(p)] for p in ps]
        st = engine.stats()["speculation"]
        assert st["rolled_back"] > 0 and st["accepted"] > 0
        assert not shortened  # rejected drafts were rolled back (`rollback`), not truncated page by page
        assert manager.pool.num_free == free  # every page a rejected draft took is back
        # a session keeps exactly the pages its kept tokens need
        session = engine.session()
        session.generate(ps[0], greedy(18))
        assert len(session.cache.pages) == -(-session.cache.length // manager.pool.page_size)
        session.close()
        manager.radix.evict(manager.pool.num_pages)
        assert manager.pool.num_used == 0
        engine.close()


def test_a_sequence_that_never_accepts_stops_drafting(tmp_path: Path) -> None:
    save_checkpoint("qwen3_moe", tmp_path)
    # the cost pinned at its default: the measured one follows this machine's load, which the test does not control
    engine = Engine.from_pretrained(tmp_path, speculate=SpeculationConfig(verify_cost=0.1, drafter=lambda: Wrong()))

    class Wrong:  # a draft the greedy model never picks: the token it just produced (a random model rarely repeats)
        def propose(self, tokens: list[int], k: int) -> list[int]:
            return [511 - tokens[-1]] * k

    out = engine.generate(repeating_prompts(1, seed=6)[0], greedy(120))
    st = engine.stats()["speculation"]
    assert len(out.token_ids) == 120
    assert st["accepted"] <= st["drafted"] // 4
    assert st["verify_rows"] < 40  # drafting stopped after the first failures, with rare retries
    engine.close()


def test_the_prompt_is_indexed_with_its_prefill(tmp_path: Path) -> None:
    """A drafter that indexes its context gets the whole prompt when the prefill ends, before the first token is
    judged and before any proposal: the indexing is prompt processing, not a decode step's work."""
    save_checkpoint("qwen3_moe", tmp_path)
    calls: list[tuple[str, int]] = []

    class Recording(PromptLookup):
        def prepare(self, tokens: list[int]) -> None:
            calls.append(("prepare", len(tokens)))
            super().prepare(tokens)

        def propose(self, tokens: list[int], k: int) -> list[int]:
            calls.append(("propose", len(tokens)))
            return super().propose(tokens, k)

    engine = Engine.from_pretrained(tmp_path, speculate=SpeculationConfig(verify_cost=0.0, drafter=Recording))
    prompt = repeating_prompts(1, seed=3)[0]
    engine.speculation = False
    want = engine.generate(prompt, greedy(12)).token_ids
    engine.speculation = SpeculationConfig(verify_cost=0.0, drafter=Recording)
    assert engine.generate(prompt, greedy(12)).token_ids == want
    assert calls[0] == ("prepare", len(prompt))  # the prompt alone: no generated token yet
    assert [c for c in calls if c[0] == "prepare"] == [calls[0]]
    assert any(c[0] == "propose" for c in calls)
    lookup = PromptLookup(key=2)
    lookup.prepare(prompt)
    assert lookup.propose(prompt, 3) == PromptLookup(key=2).propose(prompt, 3)  # the same drafts as unprepared
    engine.close()


def test_option_stats_and_bad_values(tmp_path: Path) -> None:
    save_checkpoint("qwen3_moe", tmp_path)
    engine = Engine.from_pretrained(tmp_path, speculate=False)
    assert not engine.speculation.enabled
    engine.generate(repeating_prompts(1, seed=7)[0], greedy(20))
    assert engine.stats()["speculation"]["verify_rows"] == 0
    engine.speculation = 3
    assert engine.speculation.enabled and engine.speculation.max_draft == 3
    keys = {"enabled", "max_draft", "drafted", "accepted", "acceptance_rate", "k_hist", "by_phase", "emitted"}
    assert keys <= set(engine.stats()["speculation"])
    with pytest.raises(OptionError, match="max_draft"):
        SpeculationConfig(max_draft=-1)
    with pytest.raises(OptionError, match="speculate"):
        SpeculationConfig.of("fast")
    engine.close()
    with pytest.raises(OptionError):
        Engine.from_pretrained(tmp_path, speculate="sometimes")


def test_prompt_lookup_and_draft_length() -> None:
    lookup = PromptLookup(key=2)
    ctx = [5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 4, 0, 5, 6, 7]
    # "6 7" occurs twice before; the match that extends further left ("5 6 7") wins: it was followed by 8 9
    assert lookup.propose(ctx, 3) == [8, 9, 1]
    assert lookup.match == 3
    assert lookup.propose(ctx + [3], 2) == [4, 0]  # the index grows with the sequence
    assert lookup.propose([1, 2, 3], 4) == []  # nothing matches
    # a loop continues with its period past the end of the context
    assert PromptLookup(key=2).propose([4, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert best_draft_length(0.0, 8, 0.1) == 0  # nothing is ever accepted: plain decode
    assert best_draft_length(0.95, 8, 0.1) == 8
    assert 0 < best_draft_length(0.5, 8, 0.1) < 8


def test_candidates_vote_on_the_draft_and_stop_where_they_disagree() -> None:
    # three earlier occurrences of the context's end, weighted by how far back each matches
    cands = [(5, [1, 2, 3, 4], "context"), (4, [1, 2, 9, 9], "history"), (3, [1, 7, 7, 7], "history")]
    # all agree on 1; 2 holds 9 of 12 (0.75 >= 0.7) and the 7-candidate drops out; then 3 (5) vs 9 (4): 0.56, stop
    assert vote(cands, 4) == ([1, 2], 5, "context")
    assert vote(cands, 4, agreement=0.5) == ([1, 2, 3, 4], 5, "context")  # a looser rule follows the heaviest
    assert vote(cands, 1) == ([1], 5, "context")
    # the first token is always drafted, even where the candidates split (the heaviest wins; ties: the first listed),
    # and the draft follows the candidates that agree with it
    assert vote([(2, [8, 8], "context"), (2, [6, 6], "history")], 2) == ([8, 8], 2, "context")
    assert vote([(2, [8], "context"), (3, [6, 5], "history")], 3) == ([6, 5], 3, "history")
    # only candidates within SLACK tokens of the longest match vote: a short one cannot outvote a long one
    assert vote([(9, [4, 4], "context"), (2, [5, 5], "history"), (2, [5, 5], "history"), (2, [5, 5], "history")],
                2) == ([4, 4], 9, "context")
    # a lone candidate is copied as far as it goes; none: no draft
    assert vote([(3, [1, 2], "history")], 5) == ([1, 2], 3, "history")
    assert vote([], 4) == ([], 0, None)
    # prompt lookup drafts by the same vote: "1 2" was followed by 3 3 3 and by 3 4 4; they part after the 3
    lookup = PromptLookup(key=2)
    assert lookup.propose([1, 2, 3, 3, 3, 0, 1, 2, 3, 4, 4, 0, 1, 2], 4) == [3]
    assert lookup.match == 3  # "0 1 2" of the more recent occurrence


def longest(h: TokenHistory, tokens: list[int], limit: int) -> tuple[int, list[int]]:
    """The history's candidate whose match reaches furthest back (ties: the most recent): (length, continuation)."""
    found = h.matches(tokens, limit)
    return max(((c[0], c[1]) for c in found), key=lambda c: c[0]) if found else (0, [])


def test_token_history_lookup_continuation_and_capacity() -> None:
    h = TokenHistory(capacity=40, key=2, prompt_tail=3)
    h.add([90, 91, 1, 2, 3], [10, 11, 12, 13])  # recorded: 1 2 3 | 10 11 12 13
    h.add([92, 93, 7, 2, 3], [20, 21])  # 7 2 3 | 20 21
    # "2 3" occurs in both, each a candidate; the older one matches further back ("1 2 3")
    assert h.matches([5, 1, 2, 3], 8) == [(2, [20, 21], "history"), (3, [10, 11, 12, 13], "history")]
    assert longest(h, [5, 1, 2, 3], 8) == (3, [10, 11, 12, 13])  # never past its document's end
    assert longest(h, [7, 2, 3], 1) == (3, [20])
    assert h.matches([4, 4], 3) == [] and h.matches([3], 3) == [] and h.matches([2, 3], 0) == []
    assert longest(h, [11, 12], 5) == (2, [13])
    h.add([1], [])  # nothing generated: nothing recorded
    assert h.snapshot() == {"tokens": 12, "documents": 2, "recorded": 2, "capacity": 40}
    # past twice the capacity the oldest documents go; what is kept is still found, what went is not
    for i in range(30):
        h.add([], [100 + i, 200 + i, 300 + i])
    snap = h.snapshot()
    assert snap["tokens"] <= 2 * h.capacity and snap["recorded"] == 32
    assert h.matches([5, 1, 2, 3], 4) == []
    assert longest(h, [129, 229], 2) == (2, [329])
    big = TokenHistory(capacity=5, key=2, prompt_tail=0)
    big.add([], list(range(50)))  # one document longer than the capacity keeps its end
    assert big.size == 5 and longest(big, [46, 47], 3) == (2, [48, 49])
    with pytest.raises(OptionError, match="capacity"):
        TokenHistory(capacity=0)
    with pytest.raises(OptionError, match="history_tokens"):
        SpeculationConfig(history_tokens=-1)
    assert SpeculationConfig(history_tokens=0).history is None


def test_context_lookup_takes_the_longer_match() -> None:
    h = TokenHistory(capacity=100, key=2, prompt_tail=0)
    h.add([], [1, 2, 3, 4, 5, 6])
    d = ContextLookup(h, key=2)
    tokens = [9, 3, 4, 8, 2, 3, 4]  # context: "3 4" once before (match 2); history: "2 3 4" (match 3)
    assert d.source(tokens) == ("history", None) and d.propose(tokens, 2) == [5, 6] and d.match == 3
    tokens = [2, 3, 4, 7, 8, 2, 3, 4]  # the context matches "2 3 4" too: a tie goes to the sequence's own tokens
    assert d.source(tokens)[0] == "context" and d.propose(tokens, 3) == [7, 8, 2]
    assert d.propose(tokens, 0) == []


def test_drafts_from_earlier_outputs_keep_greedy_output(engine: Engine) -> None:
    g = random.Random(5)
    prompts = [[g.randrange(512) for _ in range(g.randint(12, 30))] for _ in range(4)]
    history = TokenHistory()
    engine.speculation = SpeculationConfig(enabled=False, history=history)
    alone = [engine.generate(p, greedy(18)).token_ids for p in prompts]
    assert history.recorded == 0  # outputs decoded without speculation are not recorded
    engine.speculation = SpeculationConfig(verify_cost=0.0, max_draft=6, history=history)
    assert run_concurrently(engine, prompts, [greedy(18)] * 4) == alone
    assert history.recorded == 4
    s0 = engine.stats()["speculation"]
    assert s0["history"]["documents"] == 4 and s0["drafter"] == "prompt lookup + history"
    # the same requests again: their outputs are in the history now, drafts come from there and are verified
    assert [engine.generate(p, greedy(18)).token_ids for p in prompts[:2]] == alone[:2]
    assert run_concurrently(engine, prompts, [greedy(18)] * 4) == alone
    s1 = engine.stats()["speculation"]
    hist = s1["by_source"]["history"]
    assert hist["accepted"] - s0["by_source"].get("history", {}).get("accepted", 0) > 30
    engine.speculation = False  # switching off and on keeps the history
    engine.speculation = True
    assert engine.speculation.history is history and history.recorded == 10


def test_step_cost_is_fitted_from_decode_steps() -> None:
    cost = StepCost()
    assert cost.estimate() == cost.default  # nothing seen yet
    for t in [1, 2, 5, 1, 8, 3, 1, 4, 6, 1, 2, 7]:
        cost.observe(t, 0.010 + 0.002 * t)  # a = 10 ms, b = 2 ms per token
    assert abs(cost.estimate() - 0.002 / 0.012) < 1e-6
    flat = StepCost()
    for _ in range(20):
        flat.observe(1, 0.01)  # one size only: nothing to fit
    assert flat.estimate() == flat.default


def test_step_cost_prices_rows_from_the_sizes_it_measured() -> None:
    """A concave cost profile (the first draft token costs most) is priced as measured, not by a line through it."""
    cost = StepCost()
    assert cost.relative(3) == 1 + cost.default * 3  # nothing measured: the default line
    profile = {1: 0.010, 2: 0.0112, 3: 0.0118, 5: 0.0130, 8: 0.0160}
    for _ in range(10):
        for t, sec in profile.items():
            cost.observe(t, sec)
    assert cost.seconds() == pytest.approx(profile)
    assert cost.relative(0) == 1.0
    assert cost.relative(1) == pytest.approx(1.12) and cost.relative(7) == pytest.approx(1.6)
    assert cost.relative(3) == pytest.approx((0.0118 * 0.5 + 0.0130 * 0.5) / 0.010)  # between 3 and 5 tokens
    # above the largest size seen: at least the measured slope from 1 token to it
    assert cost.relative(9) >= (0.0160 + (0.0160 - 0.010) / 7 * 2) / 0.010 - 1e-9
    # with this profile a draft accepted 60% of the time pays at a longer length than the fitted line allows
    assert best_draft_length(0.6, 7, cost.relative) > best_draft_length(0.6, 7, cost.estimate())
    skewed = StepCost()  # what a policy drafting one token at a time sees: 1- and 2-token steps only
    for _ in range(20):
        skewed.observe(1, 0.010)
        skewed.observe(2, 0.0112)
    assert skewed.relative(7) == pytest.approx(1 + 0.12 * 7)  # the measured slope carried on
    noisy = StepCost()
    for _ in range(10):
        noisy.observe(1, 0.010)
        noisy.observe(4, 0.009)  # noise: a bigger step measured faster
    assert noisy.relative(3) >= 1 + 0.03 * 3  # drafts never look free
    # a size measured slower than a larger one (a few slow steps among its few observations) takes the larger's
    bumpy = StepCost()
    for _ in range(10):
        for t, sec in {1: 0.010, 2: 0.014, 3: 0.012, 4: 0.013}.items():
            bumpy.observe(t, sec)
    assert bumpy.seconds() == pytest.approx({1: 0.010, 2: 0.012, 3: 0.012, 4: 0.013})
    # above the largest size measured, the measured mean cost per token, not a steeper line through the steps
    steep = StepCost()
    for _ in range(10):
        steep.observe(1, 0.010)
        steep.observe(2, 0.011)
        steep.observe(3, 0.012)
    steep.estimate = lambda: 2.0  # type: ignore[method-assign]  # a line gone steep (two 1-token steps a token)
    assert steep.relative(7) == pytest.approx(1.2 + 0.1 * 5)  # a row of 8: 3 tokens at 1.2x, then 0.1x a token
    # a size measured slow a few times and then never again (priced out by it) ages out of the table
    stale = StepCost()
    for _ in range(4):
        stale.observe(2, 0.050)  # 5x a 1-token step
    for _ in range(20):
        stale.observe(1, 0.010)
    assert 2 in stale.seconds() and stale.relative(1) == pytest.approx(5.0)
    for _ in range(100):
        stale.observe(1, 0.010)
    assert set(stale.seconds()) == {1} and stale.relative(1) < 1.5  # priced from the 1-token steps: drafts resume
    assert stale.seconds()[1] == pytest.approx(0.010)  # aging moves no mean
    only_one = StepCost()
    for _ in range(10):
        only_one.observe(1, 0.010)
    only_one.estimate = lambda: 0.05  # type: ignore[method-assign]
    assert only_one.relative(2) == pytest.approx(1 + 0.05 * 2)  # 1-token steps alone: the line carries it,
    only_one.estimate = lambda: 0.5  # type: ignore[method-assign]
    assert only_one.relative(2) == pytest.approx(1 + only_one.default * 2)  # never above the default


def test_the_steps_right_after_a_prompt_are_not_priced(tmp_path: Path) -> None:
    """Decode steps after a prefill run on caches the prompt's own data filled; the cost table leaves the first
    ``COLD_STEPS`` of them out."""
    save_checkpoint("qwen3_moe", tmp_path)
    engine = Engine.from_pretrained(tmp_path, speculate=False)
    prompt = repeating_prompts(1, seed=4)[0]
    params = SamplingParams(max_new_tokens=StepCost.COLD_STEPS + 1, stop_token_ids=())
    for _ in range(4):  # the first token comes with the prefill: COLD_STEPS decode steps follow, none observed
        engine.generate(prompt, params)
    assert engine.scheduler.step_cost.seconds() == {}
    engine.generate(prompt, SamplingParams(max_new_tokens=StepCost.COLD_STEPS + 10, stop_token_ids=()))
    assert set(engine.scheduler.step_cost.seconds()) == {1}
    engine.close()


def test_draft_history_flag_reaches_the_engine(tmp_path: Path) -> None:
    import argparse

    from freetoken_agent.cli.budget import add_budget_flags, engine_kwargs

    parser = argparse.ArgumentParser()
    add_budget_flags(parser)
    kwargs = engine_kwargs(parser.parse_args(["--draft-history", "0", "--speculate", "3"]))
    config = kwargs["speculate"]
    assert config.history is None and config.enabled and config.max_draft == 3
    assert engine_kwargs(parser.parse_args(["--draft-history", "100"]))["speculate"].history.capacity == 100
    assert not engine_kwargs(parser.parse_args(["--draft-history", "100", "--speculate", "off"]))["speculate"].enabled
    with pytest.raises(SystemExit):
        parser.parse_args(["--draft-history", "-5"])
    save_checkpoint("qwen3_moe", tmp_path)
    engine = Engine.from_pretrained(tmp_path, **engine_kwargs(parser.parse_args(["--draft-history", "0"])))
    assert engine.stats()["speculation"]["drafter"] == "prompt lookup" and engine.speculation.history is None
    engine.close()


def test_seeded_sampling_gives_the_same_tokens_whatever_is_drafted(engine: Engine) -> None:
    """Each generated position draws its own uniform number from (seed, position): a seeded sampled request gives
    the same tokens without speculation, with prompt lookup, with drafts from the history (its own earlier output:
    the second run drafts it all) and with a drafter that is wrong every third token."""
    prompts = repeating_prompts(3, seed=11)
    params = [SamplingParams(max_new_tokens=16, temperature=1.3, top_p=0.95, seed=40 + i, stop_token_ids=())
              for i in range(3)]
    engine.speculation = False
    alone = [engine.generate(p, q).token_ids for p, q in zip(prompts, params)]
    assert len({tuple(a) for a in alone}) == 3
    engine.speculation = SpeculationConfig(verify_cost=0.0, max_draft=5, history=TokenHistory())
    for _ in range(2):  # the second time every output is in the history
        assert run_concurrently(engine, prompts, params) == alone
    assert engine.stats()["speculation"]["by_source"]["history"]["accepted"] > 0
    references = {tuple(p): a for p, a in zip(prompts, alone)}
    vocab = engine.spec.vocab_size
    engine.speculation = SpeculationConfig(verify_cost=0.0, max_draft=5, drafter=lambda: Oracle(references, vocab))
    assert [engine.generate(p, q).token_ids for p, q in zip(prompts, params)] == alone
    engine.speculation = True


def test_position_draws_are_uniform_and_keyed() -> None:
    from freetoken_agent.runtime.generation.sampling import position_uniform

    draws = [position_uniform(7, i) for i in range(20000)]
    assert all(0.0 <= u < 1.0 for u in draws) and len(set(draws)) == len(draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01  # mean of a uniform
    assert sum(u < 0.1 for u in draws) / len(draws) == pytest.approx(0.1, abs=0.01)
    assert [position_uniform(7, i) for i in range(5)] == draws[:5] and position_uniform(8, 0) != draws[0]
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75])  # a draw never lands on a token of probability 0
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    seen = []
    for _ in range(400):
        seen.append(sampler.draw(probs))
        sampler.index += 1
    assert set(seen) == {1, 3} and 0.18 < seen.count(1) / len(seen) < 0.32
