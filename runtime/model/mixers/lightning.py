"""MiniMax lightning attention: linear attention with a per-head exponential decay, as its exact recurrence.

Legend: T tokens, H heads of Dh channels. The cache holds the state Σ_j decay^(t-j) k_jᵀ v_j [H, Dh, Dh].
"""

from __future__ import annotations

import torch

from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.model.activations import activation_fn, params_in
from freetoken_agent.runtime.model.spec import RecurrentSpec
from freetoken_agent.runtime.model.layers import elementwise, mixer_linear


def lightning(
    x: torch.Tensor, w: dict[str, torch.Tensor], spec: RecurrentSpec, layer: int, cache: KVCache, eps: float
) -> torch.Tensor:
    t, h, dh = x.shape[0], spec.num_v_heads, spec.head_v_dim
    qkv = elementwise(activation_fn(spec.activation, params_in(w)), mixer_linear(x, w["qkv_proj.weight"])).view(t, h, 3 * dh)
    q, k, v = qkv.float().split(dh, dim=-1)  # [T, H, Dh] each
    decay = torch.exp(-torch.tensor(spec.slopes, dtype=torch.float32, device=x.device))[:, None, None]  # [H, 1, 1]
    state = cache.get_state(layer)
    kv = torch.zeros(h, dh, dh, dtype=torch.float32, device=x.device) if state is None else state[0]
    out = torch.empty_like(q)
    for i in range(t):
        kv = decay * kv + k[i][:, :, None] * v[i][:, None, :]
        out[i] = (q[i][:, None, :] @ kv)[:, 0]
    cache.set_state(layer, kv)
    o = out.reshape(t, h * dh)
    o = w["norm.weight"] * (o * elementwise(torch.rsqrt, o.pow(2).mean(-1, keepdim=True) + spec.norm_eps)).to(x.dtype)
    o = elementwise(torch.sigmoid, mixer_linear(x, w["output_gate.weight"])) * o
    return mixer_linear(o, w["out_proj.weight"])
