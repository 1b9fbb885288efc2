"""ZAYA's compressed convolutional attention (``AttentionSpec.kind == "cca"``): q/k mixed over time by two causal
convolutions with residual paths, values half from the current token and half from the previous one.

Legend: T new tokens (one sequence), D hidden, H query heads, Hkv key/value heads, G = H / Hkv, Dh head dim,
C = (H + Hkv)·Dh conv channels, K = (t0 - 1) + (t1 - 1) conv lookback. Per sequence the layer keeps (as its state
slots, ``conv_states``) the last K pre-conv [q | k] rows and the previous token's delayed value projection.

  q, k = q_proj(x), k_proj(x);  r_q = (q + repeat(k)) / 2 per head;  r_k = mean of r_q over each KV group
  [q' | k'] = grouped_conv(depthwise_conv([q | k]))   (depthwise kernel t0, grouped kernel t1, one group per head)
  q, k = q' + r_q, k' + r_k;  q, k ← sqrt(Dh)·q/|q|, sqrt(Dh)·k/|k|·temp[kv head];  rotary on both
  v = [v_current(x_t) | v_delayed(x_{t-1})]   (v_delayed of a zero input before the first token)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.model.compressed import Loader
from freetoken_agent.runtime.model.conv_states import KEY, VALUE, ConvFn, slot_conv
from freetoken_agent.runtime.model.layers import attention_scores, dense_linear, linear
from freetoken_agent.runtime.model.mixers.conv import causal_conv
from freetoken_agent.runtime.model.rope import Rotary
from freetoken_agent.runtime.model.spec import AttentionSpec

Weights = dict[str, torch.Tensor]


def _qk_conv(w: Weights, heads: int) -> ConvFn:
    """The two stacked convolutions over [q | k] rows, continuing the last K rows of the previous forward."""
    dw, gw = w["conv_qk_depthwise.weight"], w["conv_qk_grouped.weight"]  # [C, 1, t0], [C, Dh, t1]
    lookback = (dw.shape[-1] - 1) + (gw.shape[-1] - 1)

    def conv(x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        prev = x.new_zeros(lookback, x.shape[1]) if state is None else state
        full = torch.cat([prev, x])  # [K + T, C]
        if kops.deterministic():  # each output in one fixed order, whatever T (conv1d's bits depend on the length)
            t0 = dw.shape[-1]
            y = causal_conv(full[t0 - 1 :], dw, w.get("conv_qk_depthwise.bias"), full[: t0 - 1], None)[0]
            y = _grouped_taps(y, gw, w.get("conv_qk_grouped.bias"), heads)
        else:
            y = F.conv1d(full.T[None], dw, w.get("conv_qk_depthwise.bias"), groups=dw.shape[0])
            y = F.conv1d(y, gw, w.get("conv_qk_grouped.bias"), groups=heads)[0].T  # [T, C]
        return y, full[full.shape[0] - lookback :].contiguous()

    return conv


def _grouped_taps(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups: int) -> torch.Tensor:
    """``conv1d(y.T, weight, bias, groups=groups)`` as one fixed-order product per group: y [T + t1 - 1, C], weight
    [C, C / groups, t1] → [T, C]; each output is a row of a ``dense_linear`` over its window of t1 inputs."""
    c, per, taps = weight.shape
    t = y.shape[0] - taps + 1
    windows = torch.stack([y[j : j + t] for j in range(taps)], dim=-1).view(t, groups, per * taps)  # [T, G, per·t1]
    outs = [dense_linear(windows[:, g].contiguous(), weight[g * per : (g + 1) * per].reshape(per, per * taps),
                         None if bias is None else bias[g * per : (g + 1) * per]) for g in range(groups)]
    return torch.cat(outs, dim=-1)


def _delay(bias_row: torch.Tensor) -> ConvFn:
    """Shift rows by one token: the first row comes from the state (or ``bias_row``, v_delayed of a zero input)."""

    def shift(x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        first = bias_row.to(x.dtype)[None] if state is None else state
        return torch.cat([first, x[:-1]]), x[-1:].clone()

    return shift


def cca_attention(
    x: torch.Tensor, w: Weights, spec: AttentionSpec, rotary: Rotary | None, layer: int, cache: KVCache,
    positions: torch.Tensor, scratch: dict,
) -> torch.Tensor:
    """One sequence's rows x [T, D] → [T, D]."""
    t, h, hkv, dh = x.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
    g = h // hkv
    q, k = linear(x, w, "q_proj"), linear(x, w, "k_proj")  # [T, H·Dh], [T, Hkv·Dh]
    r_q = (q.view(t, h, dh) + k.view(t, hkv, 1, dh).expand(t, hkv, g, dh).reshape(t, h, dh)) * 0.5
    r_k = r_q.view(t, hkv, g, dh).mean(dim=-2)
    mixed = slot_conv(torch.cat([q, k], dim=-1), cache, scratch, layer, KEY, _qk_conv(w, h + hkv))
    q = mixed[:, : h * dh].view(t, h, dh) + r_q
    k = mixed[:, h * dh :].view(t, hkv, dh) + r_k
    eps = torch.finfo(q.dtype).eps
    q = q * (dh**0.5 / q.norm(dim=-1, keepdim=True).clamp_min(eps))
    k = k * (dh**0.5 / k.norm(dim=-1, keepdim=True).clamp_min(eps)) * w["temp"][None, :, None]
    delayed_bias = w.get("v_proj_delayed.bias", x.new_zeros(w["v_proj_delayed.weight"].shape[0]))
    delayed = slot_conv(linear(x, w, "v_proj_delayed"), cache, scratch, layer, VALUE, _delay(delayed_bias))
    v = torch.cat([linear(x, w, "v_proj_current"), delayed], dim=-1).view(t, hkv, dh)
    if rotary is not None:
        cos, sin = rotary.cos_sin(positions)
        q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
    k_all, v_all = cache.append(layer, k, v)
    return linear(attention_scores(q, k_all, v_all, positions, spec, None), w, "o_proj")


def cca_weights(ld: Loader, prefix: str, a: AttentionSpec, d: int, t0: int, t1: int) -> Weights:
    """Load one CCA attention's tensors (``{prefix}.qkv_proj.*``, ``o_proj``, ``qk_norm.temp``) through a loader."""
    w: Weights = {}
    h, hkv, dh = a.num_heads, a.num_kv_heads, a.head_dim
    c, p = (h + hkv) * dh, f"{prefix}.qkv_proj"
    for key, n_out in (("q_proj", h * dh), ("k_proj", hkv * dh), ("v_proj_current", hkv * dh // 2),
                       ("v_proj_delayed", hkv * dh // 2)):
        ld.linear(w, p, key, n_out, d, a.qkv_bias)
    for key, shape in (("conv_qk_depthwise", (c, 1, t0)), ("conv_qk_grouped", (c, dh, t1))):
        w[f"{key}.weight"] = ld.take(f"{p}.{key}.weight", shape)
        w[f"{key}.bias"] = ld.take(f"{p}.{key}.bias", (c,))
    ld.linear(w, prefix, "o_proj", d, h * dh, a.o_bias)
    w["temp"] = ld.take(f"{prefix}.qk_norm.temp", (hkv,))
    return w
