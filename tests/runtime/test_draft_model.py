"""Speculative decoding with a draft model (``runtime/generation/draft_model.py``): greedy output equals greedy
output without speculation for an attention-only and a hybrid family, alone and under concurrency; a model drafting
for itself has every draft accepted (its draft KV follows each sequence exactly: rollbacks, hybrid snapshots, sessions
reused across requests); a quantized copy drafts with acceptances and rejections; sampled output keeps the model's
distribution; a draft model with another tokenizer is refused, a failing one is dropped with a warning."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from collections import Counter
from pathlib import Path

import pytest

from freetoken_agent.runtime.engine import Engine, Request
from freetoken_agent.runtime.errors import FreeTokenError, OptionError
from freetoken_agent.runtime.generation.draft_model import DraftModel, vocabulary_mismatch
from freetoken_agent.runtime.generation.prompt import common_prefix
from freetoken_agent.runtime.generation.sampling import SamplingParams
from freetoken_agent.runtime.generation.speculative import SpeculationConfig
from freetoken_agent.runtime.kv import KVConfig

pytest.importorskip("transformers")
from tests.runtime.arch_configs import save_checkpoint  # noqa: E402
from tests.runtime.batched_engines import batch_invariant  # noqa: E402,F401 (autouse fixture)
from tests.runtime.test_speculative import greedy, repeating_prompts, run_concurrently  # noqa: E402


def always_draft(draft: DraftModel, max_draft: int = 5) -> SpeculationConfig:
    """Draft at every step (a fixed price of 0 per draft token), whatever drafting costs."""
    return SpeculationConfig(verify_cost=0.0, max_draft=max_draft, draft_model=draft)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])  # attention only; hybrid (Gated DeltaNet + attention)
def test_a_model_drafting_for_itself_has_every_draft_accepted(arch: str, tmp_path: Path) -> None:
    save_checkpoint(arch, tmp_path)
    engine = Engine.from_pretrained(tmp_path, speculate=False)
    engine.kv_manager(KVConfig(page_size=4, device_pages=1024))
    ps = repeating_prompts(4, seed=3)
    lengths = [20, 9, 26, 14]
    alone = [engine.generate(p, greedy(n)).token_ids for p, n in zip(ps, lengths)]

    draft = DraftModel(Engine.from_pretrained(tmp_path, speculate=False), lookup_match=0)  # the model drafts all
    engine.speculation = always_draft(draft)
    assert [engine.generate(p, greedy(n)).token_ids for p, n in zip(ps, lengths)] == alone
    s = engine.stats()["speculation"]
    assert s["drafter"] == "draft model" and s["draft_model"]["proposals"] > 0
    # the same weights and batch-invariant kernels: the draft model predicts the model exactly, so nothing is ever
    # rejected — a draft KV that drifted from the sequence (a missed rollback, a stale state) would show here
    assert s["drafted"] > 30 and s["accepted"] == s["drafted"] and s["rolled_back"] == 0
    assert s["emitted"] > 2 * s["verify_rows"]

    # under concurrency: the sequences' drafters share the draft engine, each on its own session
    assert run_concurrently(engine, ps, [greedy(n) for n in lengths]) == alone
    s2 = engine.stats()["speculation"]
    assert s2["accepted"] == s2["drafted"] > s["drafted"]
    if not draft.stateful:  # every sequence's proposal starts before the first is awaited: one draft batch
        assert draft.engine.scheduler.stats.max_batch >= 2

    # a session's next turn continues its context: the idle draft session with that prefix is taken again, so the
    # draft model feeds only the new tokens (an attention-only model: its prefix pages are reused too)
    turn1 = ps[0] + alone[0]
    turn2 = turn1 + ps[1][:5]
    engine.speculation = False
    want = engine.generate(turn2, greedy(12)).token_ids
    engine.speculation = always_draft(draft)
    assert engine.generate(turn1, greedy(6)).token_ids == engine.generate(turn1, greedy(6)).token_ids
    before = draft.fed
    assert engine.generate(turn2, greedy(12)).token_ids == want
    if not draft.stateful:
        assert draft.fed - before < len(turn2) // 2, (draft.fed - before, len(turn2))
    engine.close()
    draft.close()


def test_prompt_lookup_drafts_first_where_it_matches(tmp_path: Path) -> None:
    """Where the context's last tokens match an earlier run of 4 or more, the copy is the draft (no forward of the
    draft model, no session taken); elsewhere the model drafts."""
    save_checkpoint("qwen3_moe", tmp_path)
    draft = DraftModel(Engine.from_pretrained(tmp_path))
    base = list(range(10, 40))
    drafter = draft.drafter()
    assert drafter.finish(drafter.start(base * 2 + base[:6], 4)) == base[6:10]
    assert drafter.session is None and draft.copied == 4 and draft.proposals == 0
    fresh = draft.drafter()
    out = fresh.propose([5, 9, 200, 7, 1, 3], 3)
    assert len(out) == 3 and fresh.session is not None and draft.proposals == 1
    assert draft.snapshot()["copied"] == 4
    draft.close()


def test_a_quantized_copy_drafts_with_acceptances_and_rejections(tmp_path: Path) -> None:
    save_checkpoint("qwen3_moe", tmp_path)
    engine = Engine.from_pretrained(tmp_path, speculate=False)
    ps = repeating_prompts(5, seed=11)
    lengths = [24, 16, 30, 12, 20]
    alone = [engine.generate(p, greedy(n)).token_ids for p, n in zip(ps, lengths)]
    draft = engine.attach_draft_model(Engine.from_pretrained(tmp_path, quant="q4", dense_quant="q4"))
    assert engine.speculation.draft_model is draft
    engine.speculation = False  # off and on again (or a draft length) keeps the draft model
    engine.speculation = 5
    assert engine.speculation.draft_model is draft and engine.speculation.max_draft == 5
    engine.speculation = always_draft(draft, max_draft=6)
    assert run_concurrently(engine, ps, [greedy(n) for n in lengths]) == alone
    assert [engine.generate(p, greedy(n)).token_ids for p, n in zip(ps, lengths)] == alone
    s = engine.stats()["speculation"]
    assert 0 < s["accepted"] < s["drafted"] and s["rolled_back"] > 0
    engine.close()
    draft.close()


def test_sampled_output_keeps_the_model_distribution(tmp_path: Path) -> None:
    """The draft model's greedy proposals are verified by the speculative-sampling rule: the first sampled token
    after a cached prompt (its row: the prompt's last token and the drafts) follows the model's softmax (chi-square
    over its likeliest tokens) while drafts are accepted and rejected."""
    save_checkpoint("qwen3_moe", tmp_path, vocab_size=24)
    engine = Engine.from_pretrained(tmp_path, speculate=False)
    engine.kv_manager(KVConfig(page_size=2, device_pages=512))
    prompt = [3, 7, 1, 9, 3, 7, 5]
    logits = engine.logits(prompt)[-1]
    engine.generate(prompt, greedy(1))  # the prompt's first 6 tokens now come from the prefix cache
    draft = engine.attach_draft_model(Engine.from_pretrained(tmp_path))
    engine.speculation = always_draft(draft, max_draft=3)
    n = 600
    counts: Counter[int] = Counter()
    for seed in range(n):
        out = engine.generate(prompt, SamplingParams(max_new_tokens=2, temperature=1.0, seed=seed,
                                                     stop_token_ids=())).token_ids
        counts[out[0]] += 1
    p = logits.softmax(-1)
    likely = [int(t) for t in p.argsort(descending=True)[:6] if float(p[t]) * n >= 10]
    chi2 = sum((counts[t] - n * float(p[t])) ** 2 / (n * float(p[t])) for t in likely)
    rest_p = 1 - sum(float(p[t]) for t in likely)
    rest = n - sum(counts[t] for t in likely)
    if rest_p * n >= 5:
        chi2 += (rest - n * rest_p) ** 2 / (n * rest_p)
    dof = len(likely) - (0 if rest_p * n >= 5 else 1)
    assert chi2 < dof + 4 * math.sqrt(2 * dof) + 6, (chi2, counts.most_common(8), p.topk(6))
    s = engine.stats()["speculation"]
    assert s["verify_rows"] >= n and 0 < s["accepted"] < s["drafted"]
    engine.close()
    draft.close()


def write_tokenizer(folder: Path, tokens: list[str]) -> None:
    """A word-level tokenizer.json over ``tokens`` (id = index)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": tokens[0]}}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": tokens[1]}))


def test_a_draft_model_with_another_tokenizer_is_refused(tmp_path: Path) -> None:
    main, same, other = tmp_path / "main", tmp_path / "same", tmp_path / "other"
    save_checkpoint("qwen3_moe", main)
    words = [f"w{i}" for i in range(512)]
    write_tokenizer(main, words)
    shutil.copytree(main, same)
    shutil.copytree(main, other)
    write_tokenizer(other, words[:100] + words[101:] + [words[100]])  # one id means another word
    engine = Engine.from_pretrained(main, draft_model=same)
    assert engine.speculation.draft_model is not None and engine.speculation.draft_model.owned
    engine.close()
    with pytest.raises(OptionError, match="does not share the model's tokenizer"):
        Engine.from_pretrained(main, draft_model=other)
    with pytest.raises(FreeTokenError):  # one clear error for a path that holds no model
        Engine.from_pretrained(main, draft_model=tmp_path / "missing")
    assert vocabulary_mismatch(None, object()) is None
    engine = Engine.from_pretrained(main)
    with pytest.raises(OptionError, match="cannot draft for itself"):  # it would wait on its own thread
        engine.attach_draft_model(engine)
    engine.close()


def test_a_failing_draft_model_is_dropped_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_checkpoint("qwen3_moe", tmp_path)
    engine = Engine.from_pretrained(tmp_path, speculate=False)
    prompt = repeating_prompts(1, seed=5)[0]
    want = engine.generate(prompt, greedy(16)).token_ids
    draft = engine.attach_draft_model(Engine.from_pretrained(tmp_path))
    engine.speculation = always_draft(draft)

    def broken(request: Request) -> None:  # the draft engine's weights went bad, say
        raise RuntimeError("draft forward failed")

    monkeypatch.setattr(draft.engine, "submit", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engine.generate(prompt, greedy(16)).token_ids == want
    assert any("draft forward failed" in str(w.message) for w in caught)
    assert draft.disabled is not None and draft.failures == 1
    assert engine.stats()["speculation"]["draft_model"]["disabled"].startswith("RuntimeError")
    engine.close()
    draft.close()


def test_tokens_outside_the_draft_vocabulary_end_drafting_not_the_request(tmp_path: Path) -> None:
    """A draft model with a smaller vocabulary: a sequence that holds an id it has no embedding for gets no drafts
    from it after that id (and the draft model is not dropped as failed); the output is the model's own."""
    main, small = tmp_path / "main", tmp_path / "small"
    save_checkpoint("qwen3_moe", main)
    save_checkpoint("qwen3_moe", small, vocab_size=300)
    engine = Engine.from_pretrained(main, speculate=False)
    inside, outside = [5, 9, 200, 7, 1, 3, 250, 12], [5, 9, 200, 7, 1, 3, 450, 12]
    want = [engine.generate(p, greedy(12)).token_ids for p in (inside, outside)]
    draft = engine.attach_draft_model(DraftModel(Engine.from_pretrained(small), lookup_match=0))
    engine.speculation = always_draft(draft)
    assert engine.generate(inside, greedy(12)).token_ids == want[0]
    before = draft.proposals
    assert before > 0
    assert engine.generate(outside, greedy(12)).token_ids == want[1]
    assert draft.proposals == before and draft.disabled is None
    engine.close()
    draft.close()


def test_common_prefix() -> None:
    a = list(range(1000))
    assert common_prefix(a, a) == 1000 and common_prefix(a, a[:10]) == 10 and common_prefix([], a) == 0
    for cut in (0, 1, 255, 256, 257, 700, 999):
        b = a[:cut] + [-1] + a[cut + 1 :]
        assert common_prefix(a, b) == cut


def test_the_cli_flag_drafts_with_the_model_and_refuses_a_stranger(tmp_path: Path) -> None:
    """``freetoken generate --draft-model`` in a real subprocess: the same greedy tokens as without speculation, the
    draft model named in the stats; a draft model of another tokenizer is one clear error line, no traceback."""
    import subprocess
    import sys

    from freetoken_agent.cli import build_parser
    from freetoken_agent.cli.budget import engine_kwargs
    from freetoken_agent.cli.run import agent_engine_kwargs

    for argv in (["serve"], ["generate", "--prompt", "hi"], ["run", "task"], ["acp"]):
        args = build_parser().parse_args([*argv, "--draft-model", "small"])
        kwargs = agent_engine_kwargs(args) if argv[0] in ("run", "acp") else engine_kwargs(args)
        assert kwargs["draft_model"] == "small"

    main, other = tmp_path / "main", tmp_path / "other"
    save_checkpoint("qwen3_moe", main)
    words = [f"w{i}" for i in range(512)]
    write_tokenizer(main, words)
    shutil.copytree(main, other)
    write_tokenizer(other, list(reversed(words)))
    ids = ",".join(str(t) for t in repeating_prompts(1, seed=9)[0])

    def generate(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "freetoken_agent.cli", "generate", "--model", str(main),
                               "--prompt-ids", ids, "--max-new-tokens", "20", "--json", *extra],
                              capture_output=True, text=True, timeout=300)

    plain, drafted = generate("--speculate", "off"), generate("--draft-model", str(main))
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr[-2000:]
    a, b = json.loads(plain.stdout.splitlines()[-1]), json.loads(drafted.stdout.splitlines()[-1])
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 20
    assert b["stats"]["speculation"]["drafter"] == "draft model"
    assert b["stats"]["speculation"]["draft_model"]["name"] == str(main)
    bad = generate("--draft-model", str(other))
    assert bad.returncode != 0 and "does not share the model's tokenizer" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_the_draft_price_ignores_a_first_prefill_and_one_slow_moment(tmp_path: Path) -> None:
    save_checkpoint("qwen3_moe", tmp_path)
    model = DraftModel(Engine.from_pretrained(tmp_path))
    model.record(4, 2.0, fed=900)  # a new sequence's first proposal: its whole context prefilled
    assert model.seconds_per_token is None and model.proposals == 1
    for _ in range(5):
        model.record(4, 0.004, fed=3)
    model.record(4, 4.0, fed=2)  # one slow moment
    assert model.seconds_per_token == pytest.approx(0.001)
    model.close()


def test_the_policy_trusts_and_prices_each_source_on_its_own() -> None:
    """A drafter naming its sources: free copies that are always right keep drafting long while the same
    sequence's model drafts, always wrong, fall to a token or none — neither's record spoils the other's; and a model
    whose draft token costs half a step never drafts at all."""
    from freetoken_agent.runtime.generation.speculative import DraftPolicy, PhaseAcceptance, StepCost

    class TwoSources:
        def __init__(self, model_seconds: float) -> None:
            self.next, self.model_seconds = "copy", model_seconds

        def source(self, tokens: list[int]) -> tuple[str, float | None]:
            return (self.next, None) if self.next == "copy" else (self.next, self.model_seconds)

        def propose(self, tokens: list[int], k: int) -> list[int]:
            return [1] * k

    cost = StepCost()
    for _ in range(20):
        for t, sec in ((1, 0.010), (2, 0.011), (4, 0.013), (8, 0.016)):
            cost.observe(t, sec)
    config = SpeculationConfig()
    drafter = TwoSources(model_seconds=0.0002)
    policy = DraftPolicy(config, PhaseAcceptance(config), drafter, cost)
    for _ in range(8):
        drafter.next = "copy"
        k = policy.length("code", 7, [1, 2, 3])
        policy.observe("code", k, k)
        drafter.next = "model"
        if m := policy.length("code", 7, [1, 2, 3]):
            policy.observe("code", m, 0)
    assert policy.acceptance("code", "copy") > 0.8 > 0.5 > policy.acceptance("code", "model")
    drafter.next = "copy"
    assert policy.length("code", 7, [1, 2, 3]) == 7
    drafter.next = "model"
    assert policy.length("code", 7, [1, 2, 3]) <= 1

    slow = TwoSources(model_seconds=0.005)
    slow.next = "model"
    fresh = DraftPolicy(config, PhaseAcceptance(config), slow, cost)
    assert fresh.length("code", 7, [1, 2, 3]) == 0
    slow.next = "copy"
    assert fresh.length("code", 7, [1, 2, 3]) > 0
