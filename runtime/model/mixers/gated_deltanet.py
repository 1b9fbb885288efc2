"""Gated DeltaNet (Qwen3-Next, Qwen3.5-MoE, ...): short causal conv, then a per-head delta-rule recurrence.

Legend: T tokens, Hk key heads, Hv value heads (r = Hv / Hk), Dk / Dv head dims. The cache holds per layer the conv
state [K-1, 2·Hk·Dk + Hv·Dv] and the recurrent state [Hv, Dk, Dv] for the position ``cache.length``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.model.activations import params_in
from freetoken_agent.runtime.model.mixers.conv import causal_conv
from freetoken_agent.runtime.model.spec import RecurrentSpec
from freetoken_agent.runtime.model.layers import elementwise, mixer_linear

Weights = dict[str, torch.Tensor]


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * elementwise(torch.rsqrt, (x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrence over T steps. q, k [T, H, Dk], v [T, H, Dv], beta [T, H], log-decay g [T, H] (per head) or
    [T, H, Dk] (per key channel, Kimi Delta Attention), all fp32; state [H, Dk, Dv]."""
    out = torch.empty_like(v)
    per_channel = g.dim() == 3
    for t in range(q.shape[0]):
        state = state * (g[t].exp()[:, :, None] if per_channel else g[t].exp()[:, None, None])
        memory = (state * k[t][:, :, None]).sum(dim=-2)  # [H, Dv]
        delta = (v[t] - memory) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = (state * q[t][:, :, None]).sum(dim=-2)
    return out, state


def _split_grouped(spec: RecurrentSpec, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Qwen3-Next's layout: projections grouped per key head as [q | k | v (r heads) | z (r heads)]."""
    t, hk, r = qkvz.shape[0], spec.num_k_heads, spec.num_v_heads // spec.num_k_heads
    dk, dv = spec.head_k_dim, spec.head_v_dim
    q, k, v, z = qkvz.view(t, hk, -1).split([dk, dk, r * dv, r * dv], dim=-1)
    b, a = ba.view(t, hk, 2 * r).split([r, r], dim=-1)
    return (q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), z.reshape(t, -1, dv), b.reshape(t, -1),
            a.reshape(t, -1))


def gated_deltanet(
    x: torch.Tensor, w: Weights, spec: RecurrentSpec, layer: int, cache: KVCache, eps: float
) -> torch.Tensor:
    t = x.shape[0]
    hk, hv, dk, dv = spec.num_k_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
    if spec.layout == "grouped":
        q, k, v, z, b, a = _split_grouped(spec, mixer_linear(x, w["in_proj_qkvz.weight"]),
                                          mixer_linear(x, w["in_proj_ba.weight"]))
        mixed = torch.cat([q, k, v], dim=-1)
    elif spec.layout == "fused":
        mixed, z, b, a = mixer_linear(x, w["in_proj.weight"]).split([2 * hk * dk + hv * dv, hv * dv, hv, hv], dim=-1)
        z = z.reshape(t, hv, dv)
    else:
        mixed = mixer_linear(x, w["in_proj_qkv.weight"])
        z = mixer_linear(x, w["in_proj_z.weight"]).view(t, hv, dv)
        b, a = mixer_linear(x, w["in_proj_b.weight"]), mixer_linear(x, w["in_proj_a.weight"])
    state = cache.get_state(layer)
    conv_state, rec_state = (None, None) if state is None else state
    mixed, conv_state = causal_conv(mixed, w["conv1d.weight"], w.get("conv1d.bias"), conv_state, spec.activation,
                                   params_in(w))
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv)
    beta = elementwise(torch.sigmoid, b.float())  # deterministic mode: no value on torch's scalar tail
    g = -w["A_log"].float().exp() * elementwise(F.softplus, a.float() + w["dt_bias"].float())
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    q, k = _l2norm(q.float()) * dk**-0.5, _l2norm(k.float())
    if rec_state is None:
        rec_state = torch.zeros(hv, dk, dv, dtype=torch.float32, device=x.device)
    out, rec_state = delta_rule(q, k, v.float(), g, beta, rec_state)
    cache.set_state(layer, conv_state, rec_state)
    out = gated_rms_norm(out, z, w["norm.weight"], eps, spec.gate_activation).to(x.dtype)
    return mixer_linear(out.reshape(t, hv * dv), w["out_proj.weight"])


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, act: str = "silu"
) -> torch.Tensor:
    """weight · rmsnorm(x) · act(gate), normalized over the last dim (per head)."""
    h = x.float()
    h = h * elementwise(torch.rsqrt, h.pow(2).mean(-1, keepdim=True) + eps)
    g = elementwise(torch.sigmoid if act == "sigmoid" else F.silu, gate.float())
    return (weight * h.to(x.dtype)) * g


def kimi_delta(
    x: torch.Tensor, w: Weights, spec: RecurrentSpec, layer: int, cache: KVCache, eps: float
) -> torch.Tensor:
    """Kimi Delta Attention: separate short convs on q, k, v, a per-channel forget gate, sigmoid-gated output norm."""
    t, h, dk = x.shape[0], spec.num_v_heads, spec.head_k_dim
    state = cache.get_state(layer)
    convs, rec_state = ((None, None, None), None) if state is None else (state[:3], state[3])
    parts, new_convs = [], []
    for name, conv in zip("qkv", convs):
        y, c = causal_conv(mixer_linear(x, w[f"{name}_proj.weight"]), w[f"{name}_conv1d.weight"], None, conv,
                           spec.activation, params_in(w))
        parts.append(y.view(t, h, dk).float())
        new_convs.append(c)
    q, k, v = parts
    f = _gate_proj(x, w, "f", spec).float() + w["dt_bias"].float()
    rate = w["A_log"].float().exp().reshape(1, h, 1)
    if spec.safe_gate_bound is not None:
        g = spec.safe_gate_bound * elementwise(torch.sigmoid, rate * f.view(t, h, dk))  # [T, H, Dk]
    else:
        g = -rate * elementwise(F.softplus, f.view(t, h, dk))
    beta = elementwise(torch.sigmoid, mixer_linear(x, w["b_proj.weight"]).float())
    q, k = _l2norm(q) * dk**-0.5, _l2norm(k)
    if rec_state is None:
        rec_state = torch.zeros(h, dk, dk, dtype=torch.float32, device=x.device)
    out, rec_state = delta_rule(q, k, v, g, beta, rec_state)
    cache.set_state(layer, *new_convs, rec_state)
    gate = _gate_proj(x, w, "g", spec).view(t, h, dk)
    out = gated_rms_norm(out, gate, w["o_norm.weight"], eps, act="sigmoid").to(x.dtype)
    return mixer_linear(out.reshape(t, h * dk), w["o_proj.weight"])


def _gate_proj(x: torch.Tensor, w: Weights, name: str, spec: RecurrentSpec) -> torch.Tensor:
    if spec.gate_lowrank:
        return mixer_linear(mixer_linear(x, w[f"{name}_a_proj.weight"]), w[f"{name}_b_proj.weight"])
    return mixer_linear(x, w[f"{name}_proj.weight"])
