"""Mamba-2 selective state-space mixer (Granite-4 hybrid, Nemotron-H), run as its exact per-token recurrence.

Legend: T tokens, H heads of P channels (I = H·P), G groups of N state channels, K conv width. Per layer the cache
holds the conv state [K-1, I + 2·G·N] and the SSM state [H, P, N] for the position ``cache.length``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.model.activations import params_in
from freetoken_agent.runtime.model.mixers.conv import causal_conv
from freetoken_agent.runtime.model.spec import RecurrentSpec
from freetoken_agent.runtime.model.layers import elementwise, mixer_linear, unit_rms_norm


def mamba2(
    x: torch.Tensor, w: dict[str, torch.Tensor], spec: RecurrentSpec, layer: int, cache: KVCache, eps: float
) -> torch.Tensor:
    t = x.shape[0]
    h, p, g, n = spec.num_v_heads, spec.head_v_dim, spec.num_k_heads, spec.head_k_dim
    inner = h * p
    z, xbc, dt = mixer_linear(x, w["in_proj.weight"], w.get("in_proj.bias")).split([inner, inner + 2 * g * n, h], dim=-1)
    state = cache.get_state(layer)
    conv_state, ssm = (None, None) if state is None else state
    xbc, conv_state = causal_conv(xbc, w["conv1d.weight"], w.get("conv1d.bias"), conv_state, spec.activation,
                                   params_in(w))
    xs, b, c = xbc.float().split([inner, g * n, g * n], dim=-1)
    xs, b, c = xs.view(t, h, p), b.view(t, g, n), c.view(t, g, n)
    b, c = b.repeat_interleave(h // g, dim=1), c.repeat_interleave(h // g, dim=1)  # [T, H, N]
    dt = elementwise(F.softplus, dt.float() + w["dt_bias"].float())  # [T, H]
    lo, hi = spec.dt_limit
    if lo > 0 or hi < float("inf"):
        dt = dt.clamp(lo, hi)
    a = -torch.exp(w["A_log"].float())  # [H]
    if ssm is None:
        ssm = torch.zeros(h, p, n, dtype=torch.float32, device=x.device)
    ys = torch.empty(t, h, p, dtype=torch.float32, device=x.device)
    for i in range(t):
        decay = torch.exp(dt[i] * a)[:, None, None]  # [H, 1, 1]
        ssm = ssm * decay + (dt[i][:, None] * xs[i])[:, :, None] * b[i][:, None, :]
        ys[i] = (ssm * c[i][:, None, :]).sum(-1) + w["D"].float()[:, None] * xs[i]
    cache.set_state(layer, conv_state, ssm)
    y = ys.reshape(t, inner) * elementwise(F.silu, z.float())  # gate before the norm
    y = unit_rms_norm(y.view(t, spec.norm_groups, -1), eps)
    y = (w["norm.weight"] * y.reshape(t, inner).to(x.dtype))
    return mixer_linear(y, w["out_proj.weight"], w.get("out_proj.bias"))
