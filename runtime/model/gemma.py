"""Gemma 4 pieces the generic decoder calls: per-layer inputs (PLE), the MoE block's router input, and attention
over the KV another layer cached (KV sharing).

Per-layer inputs: each token gets, for every layer l, a vector p_l [P] = (RMSNorm(W·e / √D)_l + E_pl[token]·√P)
/ √2 (e the scaled token embedding, E_pl one packed [V, L·P] table); at the end of layer l the stream takes
h + RMSNorm(W_up(act(W_gate(h)) · p_l)), and every layer's output is then scaled by its learned ``layer_scalar``.

Legend: T tokens, D hidden, L layers, P per-layer width, H heads, Dh head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.model.layers import (
    Span,
    attention_scores,
    dense_linear,
    elementwise,
    linear,
    rms_norm,
    unit_rms_norm,
)
from freetoken_agent.runtime.model.rope import Rotary
from freetoken_agent.runtime.model.spec import AttentionSpec, LayerSpec, ModelSpec

Weights = dict[str, torch.Tensor]


def per_layer_inputs(token_ids: torch.Tensor, embeds: torch.Tensor, w: Weights, spec: ModelSpec) -> torch.Tensor:
    """token ids [T] and their scaled embeddings [T, D] → every layer's input [T, L, P]."""
    t, layers, p = token_ids.shape[0], spec.num_layers, spec.per_layer_input
    if token_ids.numel() and int(token_ids.max()) >= spec.per_layer_vocab:
        raise ValueError(f"token id {int(token_ids.max())} has no per-layer embedding "
                         f"(a table of {spec.per_layer_vocab} rows)")
    tokens = F.embedding(token_ids, w["embed"]) * torch.tensor(p**0.5, dtype=w["embed"].dtype)  # [T, L·P]
    projected = dense_linear(embeds, w["projection"]) * spec.hidden_size**-0.5  # [T, L·P]
    projected = rms_norm(projected.view(t, layers, p), w["norm"], spec.norm_eps)
    return (projected + tokens.view(t, layers, p)) * 2**-0.5


def per_layer_activation(layer: LayerSpec) -> str:
    """The activation of a layer's per-layer-input gate: the config's, as its MLP has it (GELU-tanh without one)."""
    return layer.mlp.activation if layer.mlp is not None else "gelu_tanh"


def per_layer_residual(
    h: torch.Tensor, inputs: torch.Tensor | None, norms: Weights, act: Callable[[torch.Tensor], torch.Tensor],
    eps: float,
) -> torch.Tensor:
    """The end of a layer: h [T, D] takes the gated per-layer input [T, P] (when given), then the layer scalar."""
    if inputs is not None:
        g = dense_linear(elementwise(act, dense_linear(h, norms["ple_gate"])) * inputs, norms["ple_proj"])  # [T, D]
        h = h + rms_norm(g, norms["ple_norm"], eps)
    return h * norms["layer_scalar"] if "layer_scalar" in norms else h


def router_input(h: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """What Gemma 4's router projects: the raw residual [T, D], RMS-normalized without weights, times its learned
    scale and 1/√D."""
    return unit_rms_norm(h, eps) * scale * h.shape[-1] ** -0.5


def reused_kv_attention(
    x: torch.Tensor, w: Weights, spec: AttentionSpec, rotary: Rotary | None, cache: KVCache | None,
    positions: torch.Tensor, eps: float, spans: list[Span] | None = None,
) -> torch.Tensor:
    """x [T, D] → [T, D]: this layer's queries over the keys and values layer ``spec.kv_source`` cached for each
    sequence (that layer has run earlier in this forward, so its cache already holds this chunk)."""
    assert spec.kv_source is not None
    t = x.shape[0]
    q = linear(x, w, "q_proj").view(t, spec.num_heads, spec.head_dim)
    if spec.qk_norm == "head":
        q = rms_norm(q, w["q_norm.weight"], eps)
    if rotary is not None:
        cos, sin = rotary.cos_sin(positions, None if spans is None else [sp.end - sp.start for sp in spans])
        q = rotary.apply(q, cos, sin)
    outs = []
    for sp in spans if spans is not None else [Span(0, t, cache, positions)]:  # type: ignore[list-item]
        k_all, v_all = sp.cache.cached(spec.kv_source)[:2]
        outs.append(attention_scores(q[sp.start : sp.end], k_all, v_all, sp.positions, spec, None))
    return linear(outs[0] if len(outs) == 1 else torch.cat(outs), w, "o_proj")
