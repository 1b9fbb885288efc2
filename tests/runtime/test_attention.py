"""The engine's own attention paths against torch's ``scaled_dot_product_attention`` with an explicit mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from freetoken_agent.runtime.model import layers
from freetoken_agent.runtime.model.spec import AttentionSpec


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    t, h, _ = q.shape
    s, hkv, dv = v.shape
    allowed = torch.arange(s)[None, :] <= q_pos[:, None]
    rep = h // hkv
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().repeat_interleave(rep, 1).transpose(0, 1),
                                         v.float().repeat_interleave(rep, 1).transpose(0, 1), attn_mask=allowed,
                                         scale=scale)  # fmt: skip
    return out.transpose(0, 1).reshape(t, h * dv)


@pytest.mark.parametrize("h,hkv", [(8, 2), (4, 4)])
@pytest.mark.parametrize("t,s", [(1, 1), (1, 37), (5, 5), (20, 20), (20, 75), (64, 300)])
@pytest.mark.parametrize("block_bytes", [1 << 10, 8 << 20])  # many query blocks, or one
def test_causal_attention_matches_sdpa(h: int, hkv: int, t: int, s: int, block_bytes: int,
                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(layers, "CAUSAL_BLOCK_BYTES", block_bytes)
    gen = torch.Generator().manual_seed(t * 1000 + s)
    q, k, v = torch.randn(t, h, 16, generator=gen), torch.randn(s, hkv, 16, generator=gen), torch.randn(s, hkv, 12, generator=gen)
    spec = AttentionSpec(kind="gqa", num_heads=h, num_kv_heads=hkv, head_dim=16, v_head_dim=12, scale=0.3, rope=None)
    suffix = torch.arange(s - t, s)  # a prompt, or new tokens after a cached prefix
    got = layers.attention_scores(q, k, v, suffix, spec, None)
    assert (got - _reference(q, k, v, suffix, 0.3)).abs().max() < 1e-5
    if t > 1:  # queries that are not the last positions (the general mask)
        early = torch.arange(s - t, s) - (s - t) // 2
        got = layers._causal_attention(q, k, v, early, 0.3)
        assert (got - _reference(q, k, v, early, 0.3)).abs().max() < 1e-5


def test_causal_attention_in_bf16_tracks_fp32() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 4, 32, generator=gen) for n in (24, 90, 90))
    pos = torch.arange(66, 90)
    got = layers._causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), pos, 0.2)
    assert got.dtype == torch.bfloat16
    assert (got.float() - _reference(q, k, v, pos, 0.2)).abs().max() < 3e-2
