"""Inkling's relative-position attention (``AttentionSpec.kind == "relpos"``): no rotary; a learned bias per backward
distance, mixed per query and head from ``d_rel`` relative states; short causal convolutions on keys and values.

Legend: T new tokens, S cached + new positions, D hidden, H query heads, Hkv key/value heads, G = H / Hkv, Dh head
dim, R = ``d_rel``, E = bias extent, K conv kernel. The KV cache holds the convolved, normalized keys and values; the
convolutions' last K-1 inputs are the layer's recurrent state (``conv_states``).

Two variants (``RelPosSpec.variant``):
  * ``inkling``: per-head RMSNorm'd q/k, scale 1/Dh, convs y = x + conv(x), bias and queries log-scaled on full
    layers when ``log_floor`` is set;
  * ``inkling2``: q and the relative states scaled by learned [H, ·] tensors and L2-clipped, keys L2-clipped, values
    unit-RMS normalized, scale 1/sqrt(Dh), convs (x + conv(x)) / sqrt(K+1) — on full layers with per-token taps
    (static + projected from the layer input, (x + y) / sqrt(2K+1)) — a per-token sink logit per head, and the output
    gated by sigmoid(gate(x)). Full layers may read keys and values from their own inputs (``kx``, ``vx``).
"""

from __future__ import annotations

import math

import torch

from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.model.compressed import Loader
from freetoken_agent.runtime.model.conv_states import KEY, VALUE, ConvFn, slot_conv
from freetoken_agent.runtime.model.layers import elementwise, linear, rms_norm, unit_rms_norm
from freetoken_agent.runtime.model.mixers.conv import causal_conv
from freetoken_agent.runtime.model.spec import AttentionSpec, RelPosSpec

Weights = dict[str, torch.Tensor]

BLOCK_BYTES = 8 << 20
"""fp32 scores per query block: the [H, Tb, S] scores and bias of one block stay small."""


def residual_conv(weight: torch.Tensor, divisor: float) -> ConvFn:
    """A static depthwise conv with its input added back, in fp32: ``(x + conv(x)) / divisor``; weight [C, 1, K]."""

    def conv(x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()
        y, new_state = causal_conv(xf, weight.float(), None, state, activation=None)
        out = y + xf
        return (out if divisor == 1.0 else out / divisor).to(x.dtype), new_state

    return conv


def dynamic_conv(static: torch.Tensor, taps: torch.Tensor, heads: int) -> ConvFn:
    """Inkling2's per-token conv: taps = static [K, C] (index = backward distance) + ``taps`` [T, Hkv·K] shared within
    each head; ``(x + Σ_lag taps[lag] · x[t - lag]) / sqrt(2K + 1)`` in fp32."""
    k = static.shape[0]

    def conv(x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        t, c = x.shape
        xf = x.float()
        prev = xf.new_zeros(k - 1, c) if state is None else state.float()
        context = torch.cat([prev, xf])  # [K-1+T, C]
        windows = context.unfold(0, k, 1).flip(-1)  # [T, C, K]: windows[t, :, lag] = x[t - lag]
        w = static.float().T.reshape(heads, c // heads, k) + taps.float().view(t, heads, 1, k)  # [T, Hkv, C/Hkv, K]
        y = (windows.view(t, heads, c // heads, k) * w).sum(-1).reshape(t, c)
        return ((y + xf) / math.sqrt(2 * k + 1)).to(x.dtype), context[context.shape[0] - (k - 1) :].clone()

    return conv


def l2_clip(x: torch.Tensor, threshold: float, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Scale each head vector x [..., H, d] (times a learned [H, d] scale) down to L2 norm ``threshold`` if longer."""
    h = x.float() if scale is None else x.float() * scale.float()
    norm = torch.linalg.vector_norm(h, dim=-1, keepdim=True)
    return (h * (threshold / (norm + 1e-6)).clamp(max=1.0)).to(x.dtype)


def log_scale(positions: torch.Tensor, r: RelPosSpec) -> torch.Tensor | None:
    """[T] factors 1 + alpha·log(max((pos+1)/floor, 1)) in fp32, or None without log scaling."""
    if r.log_floor is None:
        return None
    return 1.0 + r.log_alpha * elementwise(torch.log, ((positions + 1).float() / r.log_floor).clamp(min=1.0))


def relpos_attention(
    x: torch.Tensor, w: Weights, spec: AttentionSpec, layer: int, cache: KVCache, positions: torch.Tensor,
    eps: float, scratch: dict, kx: torch.Tensor | None = None, vx: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's rows x [T, D] → [T, D]; ``kx`` / ``vx`` [T, D] are the key / value inputs (default x)."""
    r = spec.relpos
    assert r is not None
    t, h, hkv, dh = x.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
    kx = x if kx is None else kx
    vx = x if vx is None else vx
    tau = log_scale(positions, r)
    k_conv, v_conv = _convs(w, r, hkv, kx, vx)
    k = slot_conv(linear(kx, w, "k_proj"), cache, scratch, layer, KEY, k_conv).view(t, hkv, dh)
    v = slot_conv(linear(vx, w, "v_proj"), cache, scratch, layer, VALUE, v_conv).view(t, hkv, spec.v_head_dim)
    q = linear(x, w, "q_proj").view(t, h, dh)
    rel = linear(x, w, "r_proj").view(t, h, r.d_rel)
    sinks = None
    if r.variant == "inkling":
        q, k = rms_norm(q, w["q_norm.weight"], eps), rms_norm(k, w["k_norm.weight"], eps)
    else:
        q = l2_clip(q, r.qk_clip, w["q_scale"])
        k, v = l2_clip(k, r.qk_clip), unit_rms_norm(v, eps)
        rel = l2_clip(rel, r.rel_clip, w["rel_scale"])
        sinks = linear(x, w, "sink_proj")  # [T, H]
    if tau is not None:
        q = (q.float() * tau[:, None, None]).to(q.dtype)
        if r.variant == "inkling2":
            rel = (rel.float() * tau[:, None, None]).to(rel.dtype)
    k_all, v_all = cache.append(layer, k, v)
    exact = t > 1 and kops.deterministic()  # each token with the shapes of its own decode step
    rel_logits = torch.cat([rel[i : i + 1] @ w["rel_proj"] for i in range(t)]) if exact else rel @ w["rel_proj"]
    if r.variant == "inkling" and tau is not None:  # Inkling scales the gathered bias (same values, other order)
        rel_logits = (rel_logits.float() * tau[:, None, None]).to(rel_logits.dtype)  # [T, H, E]
    if exact:
        out = torch.cat([biased_attention(q[i : i + 1], k_all[: p + 1], v_all[: p + 1], rel_logits[i : i + 1],
                                          positions[i : i + 1], spec, None if sinks is None else sinks[i : i + 1])
                         for i, p in enumerate(positions.tolist())])
    else:
        out = biased_attention(q, k_all, v_all, rel_logits, positions, spec, sinks)
    if r.variant == "inkling2":
        out = (out.float() * elementwise(torch.sigmoid, linear(x, w, "gate").float())).to(out.dtype)
    return linear(out, w, "o_proj")


def _convs(w: Weights, r: RelPosSpec, hkv: int, kx: torch.Tensor, vx: torch.Tensor) -> tuple[ConvFn, ConvFn]:
    if r.dynamic_conv:
        return (dynamic_conv(w["k_conv"], linear(kx, w, "k_taps"), hkv),
                dynamic_conv(w["v_conv"], linear(vx, w, "v_taps"), hkv))
    divisor = 1.0 if r.variant == "inkling" else math.sqrt(r.conv_kernel + 1)
    return residual_conv(w["k_conv"], divisor), residual_conv(w["v_conv"], divisor)


def biased_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_logits: torch.Tensor, q_pos: torch.Tensor,
    spec: AttentionSpec, sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Causal (windowed) attention of q [T, H, Dh] over k [S, Hkv, Dh], v [S, Hkv, Dv] plus the bias
    rel_logits[t, h, q_pos - k_pos] (zero outside [0, E)), with optional per-query sink logits [T, H] → [T, H·Dv]."""
    t, h, dh = q.shape
    s, hkv, dv = v.shape
    g, extent = h // hkv, rel_logits.shape[-1]
    k_pos = torch.arange(s, device=q.device)
    kt, vh = k.permute(1, 2, 0), v.permute(1, 0, 2)  # [Hkv, Dh, S], [Hkv, S, Dv]
    block = max(1, min(t, BLOCK_BYTES // (h * s * 4)))
    out = torch.empty(t, h, dv, dtype=v.dtype, device=q.device)
    for a in range(0, t, block):
        b = min(t, a + block)
        tb = b - a
        qb = q[a:b].reshape(tb, hkv, g, dh).permute(1, 2, 0, 3).reshape(hkv, g * tb, dh)
        scores = (torch.matmul(qb, kt) * spec.scale).view(hkv, g, tb, s).reshape(h, tb, s)  # [H, Tb, S]
        dist = q_pos[a:b, None] - k_pos[None, :]  # [Tb, S]
        index = dist.clamp(0, extent - 1)[None].expand(h, tb, s)
        bias = rel_logits[a:b].transpose(0, 1).gather(-1, index)  # [H, Tb, S]
        scores = scores + bias.masked_fill(((dist < 0) | (dist >= extent))[None], 0.0)
        allowed = dist >= 0
        if spec.sliding_window is not None:
            allowed &= dist < spec.sliding_window
        scores = scores.masked_fill(~allowed[None], float("-inf")).float()
        if sinks is not None:  # one extra logit per query and head with a zero value
            sink = sinks[a:b].T.float()[:, :, None]  # [H, Tb, 1]
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs.to(v.dtype).view(hkv, g * tb, s), vh)  # [Hkv, G·Tb, Dv]
        out[a:b] = o.view(hkv, g, tb, dv).permute(2, 0, 1, 3).reshape(tb, h, dv)
    return out.reshape(t, h * dv)


LEAVES: dict[str, dict[str, str]] = {
    "inkling": dict(q_proj="q_proj", k_proj="k_proj", v_proj="v_proj", r_proj="r_proj", o_proj="o_proj",
                    rel_proj="rel_logits_proj.proj", k_conv="k_sconv.conv1d.weight", v_conv="v_sconv.conv1d.weight",
                    q_norm="q_norm.weight", k_norm="k_norm.weight"),
    # Inkling 2 as its checkpoints store it (transformers renames these on load; we read the files as they are)
    "inkling2": dict(q_proj="wq_du", k_proj="wk_dv", v_proj="wv_dv", r_proj="wr_du", o_proj="wo_ud",
                     rel_proj="rel_logits_proj.proj", k_conv="k_sconv.weight", v_conv="v_sconv.weight",
                     k_conv_static="k_sconv.static_w", v_conv_static="v_sconv.static_w", k_taps="k_sconv.weight_proj",
                     v_taps="v_sconv.weight_proj", q_scale="q_l2_clip.scale", rel_scale="rel_l2_clip.scale",
                     sink_proj="attn_sink_proj", gate="gate_attn"),
}
"""Per variant: our key → the checkpoint's name under the attention prefix (linears without ``.weight``; the
dynamic-conv tap projections are bare tensors)."""


def relpos_weights(ld: Loader, prefix: str, a: AttentionSpec, d: int) -> Weights:
    """Load one relpos attention's tensors through a ``weights`` loader (its ``take`` / ``linear`` / ``norm``)."""
    r = a.relpos
    assert r is not None
    names = LEAVES[r.variant]
    w: Weights = {}
    h, hkv, dh, k = a.num_heads, a.num_kv_heads, a.head_dim, r.conv_kernel
    for key, n_out, n_in in (("q_proj", h * dh, d), ("k_proj", hkv * dh, d), ("v_proj", hkv * a.v_head_dim, d),
                             ("r_proj", h * r.d_rel, d), ("o_proj", d, h * a.v_head_dim)):
        ld.linear(w, prefix, names[key], n_out, n_in, False, key=key)
    w["rel_proj"] = ld.take(f"{prefix}.{names['rel_proj']}", (r.d_rel, r.extent))
    for key, c in (("k_conv", hkv * dh), ("v_conv", hkv * a.v_head_dim)):
        if r.dynamic_conv:
            w[key] = ld.take(f"{prefix}.{names[key + '_static']}", (k, c), torch.float32)
            taps = key[0] + "_taps"
            w[f"{taps}.weight"] = ld.take(f"{prefix}.{names[taps]}", (hkv * k, d))
        else:
            w[key] = ld.take(f"{prefix}.{names[key]}", (c, 1, k), torch.float32)
    if r.variant == "inkling":
        w["q_norm.weight"] = ld.norm(f"{prefix}.{names['q_norm']}", dh)
        w["k_norm.weight"] = ld.norm(f"{prefix}.{names['k_norm']}", dh)
    else:
        w["q_scale"] = ld.take(f"{prefix}.{names['q_scale']}", (h, dh))
        w["rel_scale"] = ld.take(f"{prefix}.{names['rel_scale']}", (h, r.d_rel))
        ld.linear(w, prefix, names["sink_proj"], h, d, False, key="sink_proj")
        ld.linear(w, prefix, names["gate"], h * a.v_head_dim, d, False, key="gate")
    return w
