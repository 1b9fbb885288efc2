"""Gemma 4 (text): sliding / full attention layers with per-type head sizes and rope (proportional on full layers),
q/k norms with weights and v norms without, softmax scale 1, keys as values on full layers (``attention_k_eq_v``),
KV shared across the last layers, sandwich norms, a dense MLP beside the MoE block, per-layer input embeddings,
per-layer output scalars, scaled embeddings and logit soft-capping.

Config resolution follows transformers' ``Gemma4TextConfig``: default layer pattern (5 sliding : 1 full, the last
layer full), per-layer head sizes from ``per_layer_config`` or ``global_head_dim`` / ``num_global_key_value_heads``,
KV sharing from ``num_kv_shared_layers`` (each sharing layer reads the last earlier layer of its type).
"""

from __future__ import annotations

from typing import Any

from freetoken_agent.runtime.model.activations import canonical
from freetoken_agent.runtime.model.adapters import Config, model_spec, rope_spec, adapter
from freetoken_agent.runtime.model.spec import (
    AttentionSpec,
    LayerSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    RouterSpec,
    WeightNames,
)

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
"""transformers' ropes when a config names none."""


def sliding_layers(cfg: Config, n: int) -> list[str]:
    types = list(cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise ValueError(f"layer_types must name {n} layers among {SLIDING}, {FULL}; got {types}")
    types[-1] = FULL  # transformers forces the last layer to full attention
    return types


def _per_layer(cfg: Config, types: list[str]) -> list[dict[str, Any]]:
    """Each layer's head_dim / num_key_value_heads overrides."""
    given = cfg.get("per_layer_config")
    if given is None:  # transformers' default: full layers take the global head size (and KV heads with k_eq_v)
        full: dict[str, Any] = {"head_dim": cfg.get("global_head_dim", 512)}
        if cfg.get("attention_k_eq_v", False) and cfg.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        return [full if t == FULL else {} for t in types]
    by_index = {int(k): dict(v or {}) for k, v in given.items()}  # JSON keys are strings, zero-padded ("05")
    return [by_index.get(i, {}) for i in range(len(types))]


def _kv_sources(cfg: Config, types: list[str]) -> list[int | None]:
    """Per layer: the earlier layer whose KV it reads (None: its own)."""
    n, shared = len(types), int(cfg.get("num_kv_shared_layers") or 0)
    first = n - shared
    if shared and first <= 0:
        raise ValueError(f"num_kv_shared_layers ({shared}) leaves no layer to produce the shared KV")
    sources: list[int | None] = [None] * n
    for i in range(first, n):
        own = [j for j in range(first) if types[j] == types[i]]
        if not own:
            raise ValueError(f"layer {i} ({types[i]}) shares KV but no earlier layer of its type computes any")
        sources[i] = own[-1]
    return sources


def _rotary_dim(cfg: Config, kind: str, head_dim: int) -> int | None:
    """The whole head for a ``default`` rope (transformers' Gemma 4 ignores its partial factor); None: the rope
    type decides (``proportional`` turns the whole head with zero frequencies past the proportion)."""
    params = (cfg.get("rope_parameters") or {}).get(kind) or {}
    return head_dim if params.get("rope_type", "default") == "default" else None


@adapter("gemma4_text")
def gemma4_text(cfg: Config) -> ModelSpec:
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("use_bidirectional_attention='all' is an encoder setting; a causal LM cannot decode with it")
    n, d = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    types = sliding_layers(cfg, n)
    overrides, sources = _per_layer(cfg, types), _kv_sources(cfg, types)
    act = canonical(cfg.get("hidden_activation", "gelu_pytorch_tanh"), "hidden_activation")
    # transformers' Gemma 4 rope reads only each layer type's own parameters: a top-level partial_rotary_factor is
    # ignored, and its default rope turns the whole head whatever partial factor the type's dict holds
    cfg = {**cfg, "rope_parameters": cfg.get("rope_parameters") or DEFAULT_ROPE,
           "max_position_embeddings": cfg.get("max_position_embeddings") or 131_072}  # transformers' defaults
    rope_cfg = {k: v for k, v in cfg.items() if k != "partial_rotary_factor"}
    bias = bool(cfg.get("attention_bias", False))
    moe = None
    if cfg.get("enable_moe_block", False):
        router = RouterSpec(scoring="softmax", norm_topk=True, input_scale=True, expert_scale=True)
        moe = MoESpec(num_experts=int(cfg["num_experts"]), top_k=int(cfg["top_k_experts"]),  # type: ignore[arg-type]
                      intermediate=int(cfg["moe_intermediate_size"]), router=router, activation=act)
    layers = []
    for i, kind in enumerate(types):
        head_dim = int(overrides[i].get("head_dim", cfg.get("head_dim") or d // int(cfg["num_attention_heads"])))
        attn = AttentionSpec(
            kind="gqa", num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=int(overrides[i].get("num_key_value_heads", cfg["num_key_value_heads"])),
            head_dim=head_dim, v_head_dim=head_dim, scale=1.0, rope=rope_spec(rope_cfg, head_dim, layer_type=kind,
                                                                          rotary_dim=_rotary_dim(cfg, kind, head_dim)),
            qkv_bias=bias, o_bias=bias, qk_norm="head",
            sliding_window=int(cfg.get("sliding_window", 512)) if kind == SLIDING else None,
            k_eq_v=bool(cfg.get("attention_k_eq_v", False)) and kind == FULL, v_norm=True, kv_source=sources[i],
        )
        wide = 2 if cfg.get("use_double_wide_mlp", False) and sources[i] is not None else 1
        mlp = MLPSpec(int(cfg["intermediate_size"]) * wide, act)  # type: ignore[arg-type]
        layers.append(LayerSpec(attention=attn, mlp=mlp, moe=moe, moe_beside_mlp=moe is not None))
    names = WeightNames(
        attn_out_norm="post_attention_layernorm", ffn_in_norm="pre_feedforward_layernorm",
        ffn_out_norm="post_feedforward_layernorm", moe_prefix="experts", fused_names=("gate_up_proj", "down_proj"),
        router="router.proj", router_at_layer=True, layer_scalar="layer_scalar",
        layer_norms=(("mlp_out", "post_feedforward_layernorm_1"), ("moe_in", "pre_feedforward_layernorm_2"),
                     ("moe_out", "post_feedforward_layernorm_2")) if moe is not None else (),
    )
    # checkpoints may still hold the (unused) key/value weights of the layers that share KV
    ignored = tuple(rf"^model\.layers\.{i}\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\."
                    for i, src in enumerate(sources) if src is not None)
    return model_spec(
        cfg, layers, names=names, ignored_tensors=ignored, embedding_multiplier=d**0.5,
        final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        per_layer_input=int(cfg.get("hidden_size_per_layer_input") or 0),
        per_layer_vocab=int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]),
    )
