"""DeepSeek-V4's compressed attention across chunk boundaries: windows completed by one forward and continued by the
next, the CSA overlap carried over, pooled entries kept in the cache's slots (contiguous and paged), a truncated
cache re-pooled, prefix reuse through the engine's sessions — all equal to one full forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken_agent.runtime.engine import Engine, Request
from freetoken_agent.runtime.kernels import build
from freetoken_agent.runtime.kernels.apply import dequantized_reference, set_expert_mode
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
