"""DeepSeek-V4's compressed attention across chunk boundaries: windows completed by one forward and continued by the
next, the CSA overlap carried over, pooled entries kept in the cache's slots (contiguous and paged), a truncated
cache re-pooled, prefix reuse through the engine's sessions — all equal to one full forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken_agent.runtime.engine import Engine, Request
from freetoken_agent.runtime.kernels import build
from freetoken_agent.runtime.experts.core import set_expert_mode
from freetoken_agent.runtime.kernels.reference import dequantized_reference
from freetoken_agent.runtime.kv.paged import PagedKVCache
from freetoken_agent.runtime.kv.pool import PagePool

pytest.importorskip("transformers")

from tests.runtime.arch_configs import save_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    torch.set_num_threads(1)
    folder: Path = tmp_path_factory.mktemp("dsv4")
    save_checkpoint("deepseek_v4", folder)
    return Engine.from_pretrained(folder)


@pytest.fixture(scope="module")
def folder(engine: Engine) -> Path:
    return Path(engine.path)


def _chunked(engine: Engine, ids: torch.Tensor, sizes: list[int], cache) -> torch.Tensor:  # noqa: ANN001
    dec, out, at = engine.decoder, [], 0
    for n in sizes:
        out.append(dec.logits(dec.forward(ids[at : at + n], cache)))
        at += n
    return torch.cat(out)


def test_spec_has_every_attention_kind(engine: Engine) -> None:
    comps = [layer.attention.compressor for layer in engine.spec.layers]
    assert comps[0] is None and comps[1].overlap and comps[1].indexer is not None and not comps[2].overlap
    assert [layer.moe.router.hash_table for layer in engine.spec.layers] == [True, False, False]


@pytest.mark.parametrize("sizes", [[1] * 30, [3, 5, 1, 7, 2, 9, 3], [13, 17]])
def test_chunks_equal_one_forward(engine: Engine, sizes: list[int]) -> None:
    ids = torch.randint(0, 512, (sum(sizes),), generator=torch.Generator().manual_seed(len(sizes)))
    full = engine.logits(ids)
    contiguous = _chunked(engine, ids, sizes, engine.decoder.new_cache())
    assert (contiguous - full).abs().max().item() <= 1e-4
    pool = PagePool(engine.spec.num_layers, num_pages=16, page_size=4)
    free = iter(range(15, -1, -1))
    paged = _chunked(engine, ids, sizes, PagedKVCache(pool, lambda: pool.take(next(free))))  # type: ignore[arg-type]
    assert (paged - full).abs().max().item() <= 1e-4
    assert pool.bytes_per_page() == pool.page_size * engine.kv_bytes_per_token()  # what the KV budget counts


def test_truncated_cache_repools_its_windows(engine: Engine) -> None:
    gen = torch.Generator().manual_seed(5)
    prefix, first, other = (torch.randint(0, 512, (n,), generator=gen) for n in (14, 11, 9))
    dec = engine.decoder
    cache = dec.new_cache()
    dec.forward(torch.cat([prefix, first]), cache)
    cache.truncate(len(prefix))  # mid-window for both compression rates (4 and 8)
    got = dec.logits(dec.forward(other, cache))
    want = engine.logits(torch.cat([prefix, other]))[len(prefix):]
    assert (got - want).abs().max().item() <= 1e-4


def test_prefix_reuse_matches_a_cold_run(engine: Engine) -> None:
    gen = torch.Generator().manual_seed(6)
    turn1 = torch.randint(0, 512, (37,), generator=gen).tolist()
    turn2 = turn1 + torch.randint(0, 512, (10,), generator=gen).tolist()
    engine.submit(Request(turn1, kind="logits")).result()  # leaves turn 1's pages in the prefix cache
    warm = engine.submit(Request(turn2, kind="logits")).result()
    assert warm.reused_tokens >= 32  # whole pages of turn 1 (compressed windows complete and incomplete in them)
    reused = warm.logits
    cold = engine.submit(Request(turn2, kind="logits", reuse=False)).result().logits
    assert reused.shape[0] == len(turn2) - warm.reused_tokens  # logits of the positions computed, not reused
    assert (reused - cold[warm.reused_tokens :]).abs().max().item() <= 1e-4


@pytest.mark.skipif(build.load() is None, reason="C kernels unavailable")
def test_quantized_experts_clamp_like_the_reference(folder: Path) -> None:
    """The tiny config's swiglu_limit (1.0) clamps many gates and ups: q8 experts must clamp them as well."""
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(9))
    quantized = Engine.from_pretrained(folder, quant="q8")
    set_expert_mode(quantized.decoder, "exact")
    reference = Engine.from_pretrained(folder, quant="q8")
    dequantized_reference(reference.decoder, "fp32")
    assert (quantized.logits(ids) - reference.logits(ids)).abs().max().item() <= 1e-3


def test_legacy_config_keys_resolve_as_transformers_does() -> None:
    """A config.json in the reference's older shape (compress_ratios, num_hash_layers, qk_rope_head_dim, a yarn
    rope_scaling for the compressed layers) gives the layers transformers builds from it."""
    from transformers import AutoConfig

    from freetoken_agent.runtime.model.adapters import spec_from_config

    raw = dict(model_type="deepseek_v4", vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=6,
               num_attention_heads=4, head_dim=32, q_lora_rank=16, qk_rope_head_dim=8, num_experts_per_tok=2,
               n_routed_experts=8, compress_ratios=[0, 0, 4, 128, 4, 128], num_hash_layers=3, o_groups=2,
               o_lora_rank=8, index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8,
               rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096},
               max_position_embeddings=65536)
    ours = spec_from_config(raw)
    theirs = spec_from_config(AutoConfig.for_model(**raw).to_dict())
    assert ours.layers == theirs.layers
    kinds = [(ly.attention.compressor and ly.attention.compressor.rate, ly.moe.router.hash_table) for ly in ours.layers]
    assert kinds == [(None, True), (None, True), (4, True), (128, False), (4, False), (128, False)]
    rope = ours.layers[2].attention.rope
    assert (rope.kind, rope.factor, rope.attention_factor, rope.dim) == ("yarn", 16.0, 1.0, 8)
    assert ours.layers[0].attention.rope.kind == "default"  # sliding layers keep the plain rope
