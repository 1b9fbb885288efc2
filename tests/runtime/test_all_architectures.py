"""Every MoE causal-LM model type in the installed transformers: logits and greedy parity, or a written reason.

The parametrization is discovered from transformers' registries (``arch_configs.moe_causal_lm_types``), never
hand-kept: a new MoE architecture in a newer transformers fails ``test_every_type_is_supported_or_explained`` until it
gets an adapter or a reason in ``UNSUPPORTED``.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch

from freetoken_agent.runtime.engine import Engine, Request
from freetoken_agent.runtime.generation.sampling import SamplingParams
from freetoken_agent.runtime.generation.speculative import SpeculationConfig, unsupported
from freetoken_agent.runtime.kernels import ops
from freetoken_agent.runtime.model.adapters import spec_from_config, supported_architectures

warnings.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")

from tests.runtime.arch_configs import make_config, moe_causal_lm_types, save_checkpoint

# Model types without an adapter yet, and why (mirrored in the README support table).
UNSUPPORTED: dict[str, str] = {
}

TYPES = moe_causal_lm_types()


def test_discovery_finds_the_moe_architectures() -> None:
    assert len(TYPES) >= 62
    assert {"mixtral", "deepseek_v3", "qwen3_next", "jamba", "llama4_text", "dbrx"} <= set(TYPES)
    assert "llama" not in TYPES and "qwen3" not in TYPES  # dense models are not MoE


def test_every_type_is_supported_or_explained() -> None:
    supported = set(supported_architectures())
    unexplained = [t for t in TYPES if t not in supported and t not in UNSUPPORTED]
    assert not unexplained, f"MoE model types with neither an adapter nor a reason: {unexplained}"
    stale = [t for t in UNSUPPORTED if t in supported]
    assert not stale, f"types listed as unsupported that now have an adapter: {stale}"


@pytest.mark.parametrize("model_type", TYPES)
def test_parity_with_transformers(model_type: str, tmp_path: Path) -> None:
    if model_type not in supported_architectures():
        pytest.skip(UNSUPPORTED.get(model_type, "no adapter"))
    torch.set_num_threads(1)
    model = save_checkpoint(model_type, tmp_path)
    # threads=1: the engine keeps torch on the one thread the reference runs on (by default it sizes torch to the
    # free cores, which follow the machine's load: near-tie greedy tokens then flipped from run to run)
    engine = Engine.from_pretrained(tmp_path, threads=1)
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(1))
    experts_seen: dict[int, set[int]] = {}
    engine.decoder.routing_observers.append(
        lambda layer, topk: experts_seen.setdefault(layer, set()).update(topk.flatten().tolist())
    )
    with torch.no_grad():
        ref = model(ids[None]).logits[0].float()
    ours = engine.logits(ids)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4
    assert experts_seen and all(len(s) >= 3 for s in experts_seen.values()), "routing not exercised"

    with torch.no_grad():
        hf = model.generate(ids[None], do_sample=False, max_new_tokens=32, min_new_tokens=32)[0, len(ids):].tolist()
    result = engine.generate(ids, max_new_tokens=32, temperature=0.0)
    assert result.token_ids == hf
    assert len(set(result.token_ids)) > 4, "degenerate test model: greedy output repeats one token"

    # in one batch with sequences of other lengths (attention per sequence, everything else over all rows)
    gen = torch.Generator().manual_seed(2)
    others = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 17, 1)]
    handles = [engine.submit(Request(p, kind="logits", reuse=False)) for p in [ids.tolist(), *others]]
    batched = [h.result().logits for h in handles]
    assert (batched[0] - ref).abs().max().item() <= 1e-4
    for prompt, got in zip(others, batched[1:]):
        alone = engine.logits(prompt)
        assert (got - alone).abs().max().item() <= 1e-4
    greedy = SamplingParams(max_new_tokens=8, stop_token_ids=())
    # decode rows batched (no prefix reuse: Doge's reference routes a prompt's tokens as one chunk)
    handles = [engine.submit(Request(p, greedy, reuse=False)) for p in [ids.tolist(), *others]]
    assert handles[0].result().token_ids == hf[:8]
    assert engine.scheduler.stats.max_batch >= 4


def _row_and_steps(engine: Engine, prompt: torch.Tensor, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of ``row`` after ``prompt``: decoded one token at a time, and as one decode row (a token and its drafts,
    as speculative decoding verifies them)."""
    dec = engine.decoder
    cache = dec.new_cache()
    dec.forward(prompt, cache)
    steps = torch.cat([dec.logits(dec.forward(row[i : i + 1], cache)) for i in range(len(row))])
    cache = dec.new_cache()
    dec.forward(prompt, cache)
    return steps, dec.logits(dec.forward_batch([row], [cache], None, [True]))


@pytest.mark.parametrize("model_type", TYPES)
def test_a_verify_row_gives_its_decode_steps(model_type: str, tmp_path: Path) -> None:
    """A decode row against the same tokens decoded one by one: bit for bit in deterministic mode (what keeps greedy
    speculation token-identical, and what that mode promises); to float rounding by default — a layer that chooses
    otherwise for a row (sparse attention's top-k keys among tied scores: GLM-5's batched decode once differed at
    its 7th token) is not rounding. The prompt is longer than the tiny configs' top-k, so selection happens."""
    if model_type not in supported_architectures():
        pytest.skip(UNSUPPORTED.get(model_type, "no adapter"))
    torch.set_num_threads(1)
    save_checkpoint(model_type, tmp_path)
    engine = Engine.from_pretrained(tmp_path, threads=1)
    if (why := unsupported(engine.spec)) is not None:
        pytest.skip(f"does not speculate: {why}")
    gen = torch.Generator().manual_seed(5)
    prompt, row = torch.randint(0, 512, (20,), generator=gen), torch.randint(0, 512, (6,), generator=gen)
    steps, together = _row_and_steps(engine, prompt, row)
    assert (steps - together).abs().max().item() <= 1e-4
    before = ops.deterministic()
    ops.set_deterministic(True)
    try:
        steps, together = _row_and_steps(engine, prompt, row)
        cache = engine.decoder.new_cache()  # and a prompt cut into chunks: each position's bits as in one chunk
        whole = engine.decoder.logits(engine.decoder.forward(prompt, engine.decoder.new_cache()))
        parts = [engine.decoder.logits(engine.decoder.forward(c, cache)) for c in (prompt[:7], prompt[7:9], prompt[9:])]
    finally:
        ops.set_deterministic(before)
    assert torch.equal(steps, together)
    assert torch.equal(torch.cat(parts), whole)


def _sparse_attention(model_type: str) -> bool:
    """Whether the tiny config chooses keys per query (an indexer of some kind), found from the spec."""
    spec = spec_from_config(make_config(model_type).to_dict())
    return any(a is not None and (a.indexer is not None or a.sparse_index is not None or a.qsa is not None
                                  or a.block_indexer is not None
                                  or (a.compressor is not None and a.compressor.indexer is not None))
               for a in (layer.attention for layer in spec.layers))


SPARSE = [t for t in TYPES if t in supported_architectures() and _sparse_attention(t)]


def test_sparse_attention_types_are_found() -> None:
    assert {"deepseek_v32", "glm_moe_dsa", "deepseek_v4"} <= set(SPARSE)


@pytest.mark.parametrize("model_type", SPARSE)
def test_speculation_keeps_greedy_tokens_with_sparse_attention(model_type: str, tmp_path: Path) -> None:
    """Through the engine, default (fast) mode: drafts that are the greedy continuation except every third token,
    always verified, give the tokens of plain greedy decoding — the runner marks the verify rows, so the key
    selection of each drafted token is its decode step's."""
    from tests.runtime.test_speculative import Oracle

    torch.set_num_threads(1)
    save_checkpoint(model_type, tmp_path)
    engine = Engine.from_pretrained(tmp_path, threads=1, speculate=False)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (22, 30)]
    greedy = SamplingParams(max_new_tokens=16, stop_token_ids=())
    alone = [engine.generate(p, greedy).token_ids for p in prompts]
    references = {tuple(p): a for p, a in zip(prompts, alone)}
    engine.speculation = SpeculationConfig(verify_cost=0.0, max_draft=5,
                                           drafter=lambda: Oracle(references, engine.spec.vocab_size))
    assert [engine.generate(p, greedy).token_ids for p in prompts] == alone
    stats = engine.stats()["speculation"]
    assert stats["accepted"] > 4 and stats["verify_rows"] > 0


def _hybrids() -> list[str]:
    """Supported types whose tiny config has recurrent layers (found from the spec, not hand-kept)."""
    found = []
    for model_type in TYPES:
        if model_type in supported_architectures():
            spec = spec_from_config(make_config(model_type).to_dict())
            if spec.state_layers():  # recurrent mixers, or convolutions with a per-sequence state (Inkling)
                found.append(model_type)
    return found


HYBRIDS = _hybrids()


def test_hybrids_are_found() -> None:
    assert {"qwen3_next", "jamba", "nemotron_h", "minimax", "kimi_linear", "lfm2_moe"} <= set(HYBRIDS)


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_hybrid_multi_turn_prefix_reuse(model_type: str, tmp_path: Path) -> None:
    """Turn 2 continues from the cache of turn 1 (recurrent states included) and matches a fresh full forward;
    a snapshot taken at the end of turn 1 serves a different turn 2 exactly; rewinding without a snapshot fails."""
    torch.set_num_threads(1)
    save_checkpoint(model_type, tmp_path)
    engine = Engine.from_pretrained(tmp_path)
    dec = engine.decoder
    gen = torch.Generator().manual_seed(3)
    turn1, turn2, other2 = (torch.randint(0, 512, (n,), generator=gen) for n in (20, 9, 7))

    cache = dec.new_cache()
    last = dec.logits(dec.forward(turn1, cache))[-1]
    reply = []
    for _ in range(6):  # greedy reply, token by token
        reply.append(int(last.argmax()))
        last = dec.logits(dec.forward(torch.tensor(reply[-1:]), cache))[-1]
    history = torch.cat([turn1, torch.tensor(reply)])
    snapshot = copy.deepcopy(cache)  # what a prefix cache keeps at the end of a turn
    recurrent = dec.spec.state_layers()
    states = {i: snapshot.get_state(i) for i in recurrent}
    assert all(states[i] is not None for i in recurrent)

    reused = dec.logits(dec.forward(turn2, cache))
    full = engine.logits(torch.cat([history, turn2]))
    assert (reused - full[len(history):]).abs().max().item() <= 1e-4

    from_snapshot = dec.logits(dec.forward(other2, copy.deepcopy(snapshot)))
    full_other = engine.logits(torch.cat([history, other2]))
    assert (from_snapshot - full_other[len(history):]).abs().max().item() <= 1e-4

    cache.truncate(len(history))  # attention KV can rewind, recurrent state cannot ...
    with pytest.raises(ValueError, match="rewound"):
        dec.forward(other2, cache)
    for i in recurrent:  # ... until the snapshot's states are restored at that position
        cache.set_state(i, *states[i])
    cache.advance()
    restored = dec.logits(dec.forward(other2, cache))
    assert (restored - from_snapshot).abs().max().item() <= 1e-5
