"""Gemma 4 across chunk boundaries: layers reading an earlier layer's KV (this forward's rows included), per-layer
inputs and the MoE block beside the MLP give the same logits token by token, in odd chunks, over a paged cache and
from a reused prefix as in one forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken_agent.runtime.engine import Engine, Request
from freetoken_agent.runtime.kv.paged import PagedKVCache
from freetoken_agent.runtime.kv.pool import PagePool

pytest.importorskip("transformers")

from tests.runtime.arch_configs import save_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    torch.set_num_threads(1)
    folder: Path = tmp_path_factory.mktemp("gemma4")
    save_checkpoint("gemma4_text", folder)
    return Engine.from_pretrained(folder)


def test_spec_shares_kv_and_runs_moe_beside_the_mlp(engine: Engine) -> None:
    layers = engine.spec.layers
    assert [layer.attention.kv_source for layer in layers] == [None, None, None, 2, 1]
    assert layers[1].attention.k_eq_v and layers[1].attention.head_dim == 32 and not layers[0].attention.k_eq_v
    assert all(layer.moe_beside_mlp for layer in layers) and engine.spec.per_layer_input == 8
    assert layers[3].mlp.intermediate == 2 * layers[0].mlp.intermediate  # double-wide MLPs where KV is shared


@pytest.mark.parametrize("sizes", [[1] * 20, [3, 5, 1, 7, 4]])
def test_chunks_equal_one_forward(engine: Engine, sizes: list[int]) -> None:
    ids = torch.randint(0, 512, (sum(sizes),), generator=torch.Generator().manual_seed(len(sizes)))
    full = engine.logits(ids)
    pool = PagePool(engine.spec.num_layers, num_pages=16, page_size=4)
    free = iter(range(15, -1, -1))
    paged = PagedKVCache(pool, lambda: pool.take(next(free)))  # type: ignore[arg-type]
    for cache in (engine.decoder.new_cache(), paged):
        dec, out, at = engine.decoder, [], 0
        for n in sizes:
            out.append(dec.logits(dec.forward(ids[at : at + n], cache)))
            at += n
        assert (torch.cat(out) - full).abs().max().item() <= 1e-4
    assert pool.bytes_per_page() == pool.page_size * engine.kv_bytes_per_token()  # what the KV budget counts


def test_prefix_reuse_matches_a_cold_run(engine: Engine) -> None:
    gen = torch.Generator().manual_seed(6)
    turn1 = torch.randint(0, 512, (37,), generator=gen).tolist()
    turn2 = turn1 + torch.randint(0, 512, (10,), generator=gen).tolist()
    engine.submit(Request(turn1, kind="logits")).result()
    warm = engine.submit(Request(turn2, kind="logits")).result()
    assert warm.reused_tokens >= 32
    cold = engine.submit(Request(turn2, kind="logits", reuse=False)).result().logits
    assert (warm.logits - cold[warm.reused_tokens :]).abs().max().item() <= 1e-4


def test_global_head_sizes_resolve_as_transformers_does() -> None:
    """Full layers take global_head_dim / num_global_key_value_heads; with 10+ layers transformers writes the
    per-layer keys zero-padded ("05")."""
    from transformers import AutoConfig

    from freetoken_agent.runtime.model.adapters import spec_from_config

    raw = dict(model_type="gemma4_text", vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=12,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
               num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True, num_experts=4,
               top_k_experts=2, moe_intermediate_size=16, hidden_size_per_layer_input=0, num_kv_shared_layers=4)
    ours = spec_from_config(raw)
    theirs = spec_from_config(AutoConfig.for_model(**raw).to_dict())
    assert ours.layers == theirs.layers
    full = [i for i, ly in enumerate(ours.layers) if ly.attention.sliding_window is None]
    assert full == [5, 11] and all(ours.layers[i].attention.head_dim == 32 for i in full)
    assert ours.layers[11].attention.kv_source == 5 and ours.layers[8].attention.kv_source == 7
