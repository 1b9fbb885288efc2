"""JetMoE's mixture of attention heads (MoA): each token routes to top-k query/output expert projections that share
one set of keys and values.

Legend: T tokens, K experts per token, E experts, Hkv key/value heads of Dh channels (each expert yields Hkv query
heads), D hidden. Keys/values are cached like GQA; query head (slot j, head h) attends with key/value head h.
"""

from __future__ import annotations

import torch

from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.model.layers import attention_scores
from freetoken_agent.runtime.model.moe import route
from freetoken_agent.runtime.model.rope import Rotary
from freetoken_agent.runtime.model.spec import AttentionSpec, RouterSpec
from freetoken_agent.runtime.model.layers import mixer_linear

_ROUTER = RouterSpec(scoring="none", topk_before_scoring=True)


def _per_slot(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K, In] (or [T, In] shared by all slots), ids [T, K], weight [E, Out, In] → [T, K, Out]."""
    t, k = ids.shape
    out = x.new_zeros((t, k, weight.shape[1]))
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        rows = x[tok] if x.dim() == 2 else x[tok, slot]
        out[tok, slot] = mixer_linear(rows, weight[e])
    return out


def moa_attention(
    x: torch.Tensor, w: dict[str, torch.Tensor], spec: AttentionSpec, rotary: Rotary | None, layer: int,
    cache: KVCache, positions: torch.Tensor, eps: float,
) -> torch.Tensor:
    t, hkv, dh = x.shape[0], spec.num_kv_heads, spec.head_dim
    top_k = spec.num_heads // hkv
    ids, gates = route(x, _ROUTER, top_k, w["router.weight"])
    q = _per_slot(x, ids, w["input_linear.weight"]).view(t, top_k * hkv, dh)  # heads ordered (slot, head)
    k, v = mixer_linear(x, w["kv_proj.weight"]).view(t, 2, hkv, dh).unbind(1)
    if rotary is not None:
        cos, sin = rotary.cos_sin(positions)
        q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
    k_all, v_all = cache.append(layer, k, v)
    q = q.view(t, top_k, hkv, dh).transpose(1, 2).reshape(t, hkv * top_k, dh)  # group query heads by kv head
    out = attention_scores(q, k_all, v_all, positions, spec, None).view(t, hkv, top_k, dh).transpose(1, 2)
    out = _per_slot(out.reshape(t, top_k, hkv * dh), ids, w["output_linear.weight"])  # [T, K, D]
    return (out * gates.to(out.dtype)[:, :, None]).sum(dim=1) + w["bias"]
