"""Kolibri 1.1's indexed attention against transformers' own indexer: NVFP4 rounding bit for bit, and the keys each
query keeps — pools from block summaries, top-k among the pool, sinks and local keys, ties towards earlier keys —
for prefill chunks and decode steps alike."""

from __future__ import annotations

import pytest
import torch

from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.model.adapters import spec_from_config
from freetoken_agent.runtime.model.indexed import POOL_KEY, nvfp4_round, select_keys, top_k_mask

transformers = pytest.importorskip("transformers")
kolibri = pytest.importorskip("transformers.models.kolibri1_1.modeling_kolibri1_1")

from tests.runtime.arch_configs import make_config  # noqa: E402


def test_nvfp4_rounding_is_transformers_bit_for_bit() -> None:
    x = torch.randn(64, 128) * torch.logspace(-4, 3, 64)[:, None]
    x[0, :16] = 0.0  # an all-zero block: the smallest scale
    x[1, :16] = torch.tensor([6.0, -6.0, 0.25, 0.75, 1.25, 2.5, 3.5, 5.0] * 2) * 1e3  # ties and the top of the range
    assert torch.equal(nvfp4_round(x), kolibri.nvfp4_fake_quantize(x))
    half = x.to(torch.bfloat16)
    assert torch.equal(nvfp4_round(half), kolibri.nvfp4_fake_quantize(half))


def test_top_k_ties_go_to_earlier_keys() -> None:
    scores = torch.tensor([[1.0, 3.0, 3.0, 3.0, float("-inf")], [float("-inf")] * 4 + [2.0]])
    assert top_k_mask(scores, 2).tolist() == [[False, True, True, False, False], [False, False, False, False, True]]


@pytest.mark.parametrize("ties", [False, True])
def test_selection_matches_the_reference_indexer(ties: bool) -> None:
    """A prefill of 40 queries and a decode step at position 40, for an indexer layer and for a layer that reuses its
    pool with its own queries: the same keys as ``Kolibri1_1Indexer`` (coarse values make score ties common)."""
    config = make_config("kolibri1_1")
    spec = spec_from_config({**config.to_dict(), "model_type": "kolibri1_1"})
    indexer_spec, follower_spec = spec.layers[1].attention, spec.layers[2].attention
    assert indexer_spec.sparse_index.pool_source and not follower_spec.sparse_index.pool_source
    ref_indexer, ref_follower = kolibri.Kolibri1_1Indexer(config, 1), kolibri.Kolibri1_1Indexer(config, 2)
    gen = torch.Generator().manual_seed(7)
    h, hkv, dh, s = 4, 2, 16, 41

    def draw(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen)
        return x.round() if ties else x

    keys = draw(s, hkv, dh)
    for q_pos in (torch.arange(40), torch.tensor([40])):
        t = q_pos.numel()
        q1, q2 = draw(t, h, dh), draw(t, h, dh)
        causal = torch.arange(s)[None, :] <= q_pos[:, None]  # [T, S]
        mask = causal[None, None]  # [1, 1, T, S] bool, as transformers builds it
        want1, pool = ref_indexer(q1.transpose(0, 1)[None], keys.transpose(0, 1)[None], mask)
        want2, _ = ref_follower(q2.transpose(0, 1)[None], keys.transpose(0, 1)[None], mask, pool)
        scratch: dict = {}
        got1 = select_keys(q1, keys, q_pos, indexer_spec, scratch)
        assert torch.equal(scratch[POOL_KEY], pool[0])
        got2 = select_keys(q2, keys, q_pos, follower_spec, scratch)
        assert torch.equal(got1, want1[0, 0]) and torch.equal(got2, want2[0, 0])
        if t > 1:  # the selection bites: late queries keep fewer keys than they see
            assert bool((got1.sum(-1) < causal.sum(-1)).any()) and bool((pool[0].sum(-1) < causal.sum(-1)).any())


def test_a_follower_without_its_indexer_is_an_error() -> None:
    spec = spec_from_config({**make_config("kolibri1_1").to_dict(), "model_type": "kolibri1_1"})
    with pytest.raises(FreeTokenError, match="before its indexer"):
        select_keys(torch.randn(3, 4, 16), torch.randn(30, 2, 16), torch.arange(27, 30), spec.layers[2].attention, {})


def test_attention_over_the_kept_keys_equals_masked_attention_over_all() -> None:
    """Gathering the kept keys (and rounding only them) gives what masked attention over every rounded key gives."""
    from freetoken_agent.runtime.model.indexed import kept_attention
    from freetoken_agent.runtime.model.layers import attention_scores

    spec = spec_from_config({**make_config("kolibri1_1").to_dict(), "model_type": "kolibri1_1"}).layers[1].attention
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(30, 4, 16, generator=gen), torch.randn(30, 2, 16, generator=gen), torch.randn(30, 2, 16,
                                                                                                     generator=gen)
    pos = torch.arange(30)
    keep = select_keys(q, k, pos, spec, {})
    cols = keep.any(0).nonzero().flatten()
    got = kept_attention(q, nvfp4_round(k[cols]), nvfp4_round(v[cols]), keep[:, cols], spec.scale)
    want = attention_scores(q, nvfp4_round(k), nvfp4_round(v), pos, spec, None, keep=keep)
    assert float((got - want).abs().max()) <= 1e-5
