"""Qwen4-Exp query-selected attention (``AttentionSpec.qsa``): gated GQA whose keys are chosen per query by a block
indexer.

Legend: T new tokens (one sequence), S cached + new positions, H / Hkv heads, Dh head dim, Hi / Di indexer heads and
head dim, r block size (``ratio``), B = budget / r blocks kept. The cache holds keys, values and the indexer's raw
keys [S, Di]. A query at position p sees its n = (p + 1) // r complete blocks [j·r, (j+1)·r): the indexer scores
each block by relu(q_i · k_j) summed over its heads / sqrt(Di), with k_j the (1 + w)-RMS-normed mean of the block's
raw keys rotated at position j·r; the top min(B, n) blocks are kept, and the tokens n·r..p always.
"""

from __future__ import annotations

import math

import torch

from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.model.layers import attention_scores, dense_linear, elementwise, linear
from freetoken_agent.runtime.model.ngram import group_norm
from freetoken_agent.runtime.model.rope import Rotary
from freetoken_agent.runtime.model.spec import AttentionSpec, QSASpec

Weights = dict[str, torch.Tensor]
INDEXER = "self_attn.indexer"
"""Prefix of the indexer's tensors under the layer (``index_qk_proj``, ``q_layernorm``, ``k_layernorm``)."""


def qsa_keep(iq: torch.Tensor, raw_keys: torch.Tensor, positions: torch.Tensor, ix: QSASpec, rotary: Rotary | None,
             k_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """Indexer queries iq [T, Hi, Di] (normed, rotated) over raw keys [S, Di] → which keys each query sees [T, S]."""
    s, r = raw_keys.shape[0], ix.ratio
    blocks = s // r
    keep = torch.zeros(iq.shape[0], s, dtype=torch.bool, device=iq.device)
    complete = (positions + 1) // r  # [T]
    k_pos = torch.arange(s, device=iq.device)
    keep |= (k_pos[None, :] >= complete[:, None] * r) & (k_pos[None, :] <= positions[:, None])  # the tail
    if blocks == 0:
        return keep
    pooled = raw_keys[: blocks * r].view(blocks, r, -1).float().mean(dim=1).to(raw_keys.dtype)
    pooled = group_norm(pooled, k_norm, pooled.shape[-1], eps)  # [blocks, Di]
    if rotary is not None:
        cos, sin = rotary.cos_sin(torch.arange(blocks, device=iq.device) * r)
        pooled = rotary.apply(pooled[:, None, :], cos, sin)[:, 0]
    if kops.deterministic():  # fixed-order products and head sum: a query's bits whatever T and S
        t, hi, di = iq.shape
        per_head = torch.relu(dense_linear(iq.float().reshape(t * hi, di), pooled.float().contiguous())).view(t, hi, -1)
        scores = per_head[:, 0]
        for j in range(1, hi):
            scores = scores + per_head[:, j]
        scores = scores / math.sqrt(ix.head_dim)
    else:
        scores = torch.relu(torch.einsum("thd,bd->thb", iq.float(), pooled.float())).sum(dim=1) / math.sqrt(ix.head_dim)
    chosen = torch.zeros(iq.shape[0], blocks, dtype=torch.bool, device=iq.device)  # [T, blocks]
    # relu makes ties (many blocks at 0): rank each query's own n complete blocks exactly as the reference does
    for n in complete.unique().tolist():
        if n == 0:
            continue
        rows = (complete == n).nonzero().flatten()
        top = scores[rows, :n].topk(min(ix.budget // r, n), dim=-1).indices
        chosen[rows[:, None], top] = True
    keep[:, : blocks * r] |= chosen.repeat_interleave(r, dim=-1)
    return keep


def qsa_attention(
    x: torch.Tensor, w: Weights, extra: Weights, spec: AttentionSpec, rotary: Rotary | None, layer: int,
    cache: KVCache, positions: torch.Tensor, eps: float,
) -> torch.Tensor:
    """One sequence's rows x [T, D] → [T, D]: gated queries, (1 + w)-normed q/k, rotary, the indexer's key choice."""
    ix = spec.qsa
    assert ix is not None
    t, h, hkv, dh = x.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
    q, gate = linear(x, w, "q_proj").view(t, h, 2 * dh).chunk(2, dim=-1)
    q = group_norm(q, w["q_norm.weight"], dh, eps)
    k = group_norm(linear(x, w, "k_proj").view(t, hkv, dh), w["k_norm.weight"], dh, eps)
    v = linear(x, w, "v_proj").view(t, hkv, dh)
    iq, raw = linear(x, extra, f"{INDEXER}.index_qk_proj").split([ix.num_heads * ix.head_dim, ix.head_dim], dim=-1)
    iq = group_norm(iq.reshape(t, ix.num_heads, ix.head_dim), extra[f"{INDEXER}.q_layernorm.weight"], ix.head_dim,
                    eps)
    if rotary is not None:
        cos, sin = rotary.cos_sin(positions)
        q, k, iq = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin), rotary.apply(iq, cos, sin)
    k_all, v_all, raw_all = cache.append(layer, k, v, raw.to(k.dtype))
    keep = qsa_keep(iq, raw_all, positions, ix, rotary, extra[f"{INDEXER}.k_layernorm.weight"], eps)
    out = attention_scores(q, k_all, v_all, positions, spec, None, keep=keep)
    return linear(out * elementwise(torch.sigmoid, gate.reshape(t, h * dh)), w, "o_proj")
