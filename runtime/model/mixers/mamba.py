"""Mamba (selective SSM, version 1) as used by Jamba, run as its exact per-token recurrence.

Legend: T tokens, I inner channels, N state size, R time-step rank, K conv width. Per layer the cache holds the conv
state [K-1, I] and the SSM state [I, N] for the position ``cache.length``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.model.activations import params_in
from freetoken_agent.runtime.model.mixers.conv import causal_conv
from freetoken_agent.runtime.model.spec import RecurrentSpec
from freetoken_agent.runtime.model.layers import mixer_linear


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if weight is None:
        return x
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def mamba(
    x: torch.Tensor, w: dict[str, torch.Tensor], spec: RecurrentSpec, layer: int, cache: KVCache, eps: float
) -> torch.Tensor:
    t, n, rank = x.shape[0], spec.head_k_dim, spec.num_k_heads
    xs, gate = mixer_linear(x, w["in_proj.weight"], w.get("in_proj.bias")).chunk(2, dim=-1)
    state = cache.get_state(layer)
    conv_state, ssm = (None, None) if state is None else state
    xs, conv_state = causal_conv(xs, w["conv1d.weight"], w.get("conv1d.bias"), conv_state, spec.activation,
                                  params_in(w))
    dt, b, c = mixer_linear(xs, w["x_proj.weight"]).split([rank, n, n], dim=-1)
    dt = _rms(dt, w.get("dt_layernorm.weight"), eps)
    b, c = _rms(b, w.get("b_layernorm.weight"), eps).float(), _rms(c, w.get("c_layernorm.weight"), eps).float()
    delta = F.softplus(mixer_linear(dt, w["dt_proj.weight"]).float() + w["dt_proj.bias"].float())  # [T, I]
    a = -torch.exp(w["A_log"].float())  # [I, N]
    xf = xs.float()
    if ssm is None:
        ssm = torch.zeros(xs.shape[1], n, dtype=torch.float32, device=x.device)
    ys = torch.empty_like(xf)
    for i in range(t):
        ssm = ssm * torch.exp(delta[i][:, None] * a) + (delta[i] * xf[i])[:, None] * b[i][None, :]
        ys[i] = ssm @ c[i]
    cache.set_state(layer, conv_state, ssm)
    y = (ys + w["D"].float() * xf) * F.silu(gate.float())
    return mixer_linear(y.to(x.dtype), w["out_proj.weight"], w.get("out_proj.bias"))
