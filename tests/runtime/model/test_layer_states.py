"""Architectures whose layers keep per-sequence state beside their KV (Inkling's convolutions and relative-position
bias, Inkling 2's looped layers, ZAYA's q/k convolution and delayed values, Qwen4-Exp's n-gram context and PLE
convolution): a prompt run in uneven chunks, over a contiguous or a paged cache, equals one full forward, and EOS
tokens inside the prompt restart Qwen4-Exp's n-gram hashing exactly as transformers does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.kv.paged import PagedKVCache
from freetoken_agent.runtime.kv.pool import PagePool
from freetoken_agent.runtime.model.ngram import hashing, ngram_rows

pytest.importorskip("transformers")

from tests.runtime.arch_configs import save_checkpoint

TYPES = ["inkling_text", "inkling2_loop_text", "zaya", "qwen4_exp_text"]
SIZES = [3, 5, 1, 7, 2, 9, 3, 1]  # 31 tokens: crosses the tiny windows (8), QSA blocks (4) and conv lookbacks


def _prompt(eos: int | None) -> torch.Tensor:
    ids = torch.randint(0, 500, (sum(SIZES),), generator=torch.Generator().manual_seed(7))
    if eos is not None:  # n-gram segments restart after each EOS, inside a chunk and at a chunk's first token
        ids[[4, 12, 13, 20]] = eos
    return ids


def _chunked(engine: Engine, ids: torch.Tensor, cache) -> torch.Tensor:  # noqa: ANN001
    dec, out, at = engine.decoder, [], 0
    for n in SIZES:
        out.append(dec.logits(dec.forward(ids[at : at + n], cache)))
        at += n
    return torch.cat(out)


@pytest.mark.parametrize("model_type", TYPES)
def test_chunks_and_pages_equal_one_forward(model_type: str, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model = save_checkpoint(model_type, tmp_path)
    engine = Engine.from_pretrained(tmp_path)
    eos = model.config.eos_token_id if model_type == "qwen4_exp_text" else None
    ids = _prompt(eos)
    with torch.no_grad():
        ref = model(ids[None]).logits[0].float()
    full = engine.logits(ids)
    assert (full - ref).abs().max().item() <= 1e-4
    assert (_chunked(engine, ids, engine.decoder.new_cache()) - full).abs().max().item() <= 1e-4
    pool = PagePool(engine.spec.num_layers, num_pages=32, page_size=4)
    free = iter(range(31, -1, -1))
    paged = _chunked(engine, ids, PagedKVCache(pool, lambda: pool.take(next(free))))  # type: ignore[arg-type]
    assert (paged - full).abs().max().item() <= 1e-4


def test_ngram_hashing_matches_transformers() -> None:
    """The hashed rows of a PLE layer (primes, multipliers, EOS-restarted n-grams, wrapping products) equal
    transformers' embedding indices, with the context carried between two calls."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    from tests.runtime.arch_configs import make_config
    from freetoken_agent.runtime.model.adapters import spec_from_config

    config = make_config("qwen4_exp_text")
    spec = next(layer.ple for layer in spec_from_config(config.to_dict()).layers if layer.ple is not None)
    module = Qwen4ExpTextNGramEmbedding(config, config.ple_embed_dim, layer_idx=0, ple_layer_index=spec.index)
    mults, sizes, offsets, _ = hashing(spec)
    assert module.layer_multipliers.tolist() == list(mults) and module.head_vocab_sizes == list(sizes)
    ids = _prompt(spec.eos)
    captured: list[torch.Tensor] = []
    module.ngram_embedding.register_forward_hook(lambda _m, args, _o: captured.append(args[0]))
    module(ids[None], None)
    context = torch.full((spec.ngram_size - 1,), spec.eos)
    first = ngram_rows(ids[:13], context, spec)
    second = ngram_rows(ids[13:], ids[13 - (spec.ngram_size - 1) : 13], spec)
    assert torch.equal(torch.cat([first, second]), captured[0][0])
