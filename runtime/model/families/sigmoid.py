"""Sigmoid routers with a selection-only correction bias (DeepSeek-V3 style) over GQA attention.

One configurable builder serves the family; each adapter only says where its tensors live and which quirks apply.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from freetoken_agent.runtime.model.adapters import (
    SARVAM_NAMES,
    Config,
    activation_name,
    gqa_spec,
    model_spec,
    mtp_ignored,
    optional_field,
    required_field,
    adapter,
)
from freetoken_agent.runtime.model.spec import (
    LayerSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    RouterSpec,
    SparseIndexSpec,
    WeightNames,
)


def sigmoid_router(cfg: Config, **overrides: Any) -> RouterSpec:
    fields: dict[str, Any] = dict(
        scoring="sigmoid", norm_topk=bool(optional_field(cfg, "norm_topk_prob", "moe_renormalize", default=True)),
        norm_eps=1e-20, correction_bias=True,
        n_group=int(optional_field(cfg, "n_group", "num_expert_group", default=1)),
        topk_group=int(optional_field(cfg, "topk_group", default=1)), group_score="top2_sum",
        group_masked_value=float("-inf"),
        scaling=float(optional_field(cfg, "routed_scaling_factor", "router_scaling_factor", "route_scale",
                                     default=1.0)),
    )
    fields.update(overrides)
    return RouterSpec(**fields)


def shared_size(cfg: Config) -> int:
    explicit = optional_field(cfg, "shared_expert_intermediate_size", "shared_experts_intermediate_size")
    if explicit:
        return int(explicit)
    count = int(optional_field(cfg, "n_shared_experts", "num_shared_experts", default=0))
    return count * int(cfg["moe_intermediate_size"])


def is_sparse(cfg: Config) -> list[bool]:
    """Per layer: MoE (True) or dense MLP, from ``mlp_layer_types`` or ``first_k_dense_replace``-style fields."""
    n = int(cfg["num_hidden_layers"])
    if cfg.get("mlp_layer_types"):
        return [t == "sparse" for t in cfg["mlp_layer_types"]]
    first_dense = int(optional_field(cfg, "first_k_dense_replace", "num_dense_layers", default=0))
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)  # Qwen-style: every step-th layer is sparse
    return [i >= first_dense and i not in mlp_only and (i + 1) % step == 0 for i in range(n)]


def moe_layers(
    cfg: Config,
    attn_for: Any,
    router: RouterSpec,
    moe_fields: dict[str, Any] | None = None,
    dense_size: int | None = None,
) -> list[LayerSpec]:
    act = activation_name(cfg)
    shared = shared_size(cfg)
    fields: dict[str, Any] = dict(
        num_experts=int(required_field(cfg, "n_routed_experts", "num_experts", "num_local_experts")),
        top_k=int(required_field(cfg, "num_experts_per_tok", "num_experts_per_token")),
        intermediate=int(cfg["moe_intermediate_size"]),
        router=router,
        activation=act,
        shared=MLPSpec(shared, act) if shared else None,  # type: ignore[arg-type]
    )
    moe = MoESpec(**{**fields, **(moe_fields or {})})
    dense_size = dense_size or cfg.get("intermediate_size") or cfg["moe_intermediate_size"]  # all-sparse configs
    dense = MLPSpec(int(dense_size), act)  # type: ignore[arg-type]
    return [
        LayerSpec(attention=attn_for(i), moe=moe) if sparse else LayerSpec(attention=attn_for(i), mlp=dense)
        for i, sparse in enumerate(is_sparse(cfg))
    ]


def _types(cfg: Config) -> list[str]:
    return list(cfg.get("layer_types") or ["full_attention"] * int(cfg["num_hidden_layers"]))


@adapter("solar_open")
def solar_open(cfg: Config) -> ModelSpec:
    attn = gqa_spec(cfg, qkv_bias=bool(cfg.get("attention_bias", False)))
    return model_spec(cfg, moe_layers(cfg, lambda i: attn, sigmoid_router(cfg)), ignored_tensors=mtp_ignored(cfg))


@adapter("exaone_moe")
def exaone_moe(cfg: Config) -> ModelSpec:
    types, window = _types(cfg), cfg.get("sliding_window")

    def attn(i: int) -> Any:
        sliding = types[i] == "sliding_attention"
        # Full-attention layers of a sliding-window model use no positional encoding (NoPE).
        return gqa_spec(cfg, qk_norm="head", sliding_window=window if sliding else None,
                    **({} if window is None or sliding else {"rope": None}))

    names = WeightNames(correction_bias="e_score_correction_bias")
    return model_spec(cfg, moe_layers(cfg, attn, sigmoid_router(cfg)), names=names, ignored_tensors=mtp_ignored(cfg))


@adapter("hy_v3")
def hy_v3(cfg: Config) -> ModelSpec:
    bias = bool(cfg.get("attention_bias", False))
    attn = gqa_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head")
    router = sigmoid_router(cfg, norm_topk=True, n_group=1, topk_group=1)
    names = WeightNames(router="router.gate", correction_bias="expert_bias", shared="shared_mlp")
    # HYV3MLP: every dense and shared MLP has mlp_bias; a shared size of 0 falls back to intermediate_size
    mlp_bias, act = bool(cfg.get("mlp_bias", False)), activation_name(cfg)
    shared = MLPSpec(shared_size(cfg) or int(cfg["intermediate_size"]), act, bias=mlp_bias)
    layers = [replace(ly, mlp=replace(ly.mlp, bias=mlp_bias)) if ly.mlp else ly
              for ly in moe_layers(cfg, lambda i: attn, router, moe_fields={"shared": shared})]
    return model_spec(cfg, layers, names=names, ignored_tensors=mtp_ignored(cfg))


@adapter("sarvam_moe")
def sarvam_moe(cfg: Config) -> ModelSpec:
    attn = gqa_spec(cfg, qkv_bias=bool(cfg.get("attention_bias", False)),
                qk_norm="head" if cfg.get("use_qk_norm", True) else "none")
    return model_spec(cfg, moe_layers(cfg, lambda i: attn, sigmoid_router(cfg)), names=SARVAM_NAMES,
                  ignored_tensors=mtp_ignored(cfg))


@adapter("mimo_v2_flash")
def mimo_v2_flash(cfg: Config) -> ModelSpec:
    types, kv = _types(cfg), int(cfg["num_key_value_heads"])
    head_dim = int(optional_field(cfg, "head_dim", default=cfg["hidden_size"] // cfg["num_attention_heads"]))

    def attn(i: int) -> Any:
        sliding = types[i] == "sliding_attention"
        return gqa_spec(cfg, layer_type=types[i], num_kv_heads=kv * 2 if sliding else kv,
                    v_head_dim=int(optional_field(cfg, "v_head_dim", default=head_dim)),
                    qkv_bias=bool(cfg.get("attention_bias", False)), sinks=sliding,
                    sliding_window=cfg.get("sliding_window") if sliding else None,
                    v_scale=float(optional_field(cfg, "attention_value_scale", default=1.0)))

    names = WeightNames(sinks="attention_sink_bias")
    return model_spec(cfg, moe_layers(cfg, attn, sigmoid_router(cfg)), names=names, ignored_tensors=mtp_ignored(cfg))


@adapter("afmoe")
def afmoe(cfg: Config) -> ModelSpec:
    types = _types(cfg)
    bias = bool(cfg.get("attention_bias", False))

    def attn(i: int) -> Any:
        local = types[i] == "sliding_attention"
        return gqa_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head", output_gate="sigmoid",
                    sliding_window=cfg.get("sliding_window") if local else None,
                    **({} if local else {"rope": None}))

    router = sigmoid_router(cfg, n_group=1, topk_group=1, norm_topk=True)
    names = WeightNames(router="router.gate", correction_bias="expert_bias", attn_out_norm="post_attention_layernorm",
                        ffn_in_norm="pre_mlp_layernorm", ffn_out_norm="post_mlp_layernorm")
    mup = float(cfg["hidden_size"]) ** 0.5 if cfg.get("mup_enabled") else 1.0  # muP: embeddings scaled by √D
    return model_spec(cfg, moe_layers(cfg, attn, router), names=names, embedding_multiplier=mup)


@adapter("laguna")
def laguna(cfg: Config) -> ModelSpec:
    types = _types(cfg)
    heads = cfg.get("num_attention_heads_per_layer") or [cfg["num_attention_heads"]] * len(types)
    bias = bool(cfg.get("attention_bias", False))
    gating = cfg.get("gating", True)
    per_head = gating is True or gating == "per-head"  # transformers always gates: anything else is per channel

    def attn(i: int) -> Any:
        return gqa_spec(cfg, layer_type=types[i], num_heads=int(heads[i]), qkv_bias=bias, o_bias=bias, qk_norm="head",
                    output_gate="softplus", output_gate_per_head=per_head,
                    sliding_window=cfg.get("sliding_window") if types[i] == "sliding_attention" else None)

    router = sigmoid_router(cfg, n_group=1, topk_group=1, norm_topk=True, norm_eps=0.0,
                            scaling=float(cfg.get("moe_routed_scaling_factor") or 1.0),
                            logit_softcap=float(cfg.get("moe_router_logit_softcapping") or 0.0))
    names = WeightNames(shared="shared_expert", correction_bias="experts.e_score_correction_bias", output_gate="g_proj")
    return model_spec(cfg, moe_layers(cfg, attn, router), names=names)


@adapter("flint")
def flint(cfg: Config) -> ModelSpec:
    types = _types(cfg)
    bias = bool(cfg.get("attention_bias", False))

    def attn(i: int) -> Any:
        sliding = types[i] == "sliding_attention"
        return gqa_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head", sinks=True,
                    sliding_window=cfg.get("sliding_window") if sliding else None,
                    **({} if sliding else {"rope": None}))

    router = RouterSpec(scoring="sigmoid", norm_topk=bool(cfg.get("norm_topk_prob", True)))
    names = WeightNames(shared="shared_expert", sinks="softmax_offset")
    return model_spec(cfg, moe_layers(cfg, attn, router), names=names)


@adapter("kolibri1")
def kolibri1(cfg: Config) -> ModelSpec:
    types, window = _types(cfg), cfg.get("sliding_window")

    def attn(i: int) -> Any:
        sliding = types[i] == "sliding_attention"
        return gqa_spec(cfg, qk_norm="head", sliding_window=window if sliding else None,
                    **({} if window is None or sliding else {"rope": None}))

    router = RouterSpec(scoring="sigmoid", norm_topk=bool(cfg.get("norm_topk_prob", False)), correction_bias=True,
                        correction_on_logits=True)
    return model_spec(cfg, moe_layers(cfg, attn, router), names=KOLIBRI_NAMES, checkpoint_renames=KOLIBRI_RENAMES)


@adapter("beam")
def beam(cfg: Config) -> ModelSpec:
    """Beam: sandwich norms, depth-scaled residuals, per-head-biased output gates, NoPE full layers with scalable
    softmax, final logit softcap."""
    import math

    types = _types(cfg)
    bias = bool(cfg.get("attention_bias", False))

    def attn(i: int) -> Any:
        rope = (cfg.get("rope_parameters") or {}).get(types[i]) is not None
        return gqa_spec(cfg, layer_type=types[i], qkv_bias=bias, o_bias=bias, qk_norm="head", output_gate="sigmoid",
                    output_gate_bias=True, sliding_window=cfg.get("sliding_window") if types[i] == "sliding_attention"
                    else None, **({} if rope else {"rope": None, "q_scale_power": 0.1, "q_scale_period": 2048,
                                                   "q_scale_offset": 1}))

    layers = []
    for i, layer in enumerate(moe_layers(cfg, attn, sigmoid_router(cfg))):
        a, m = 2 * (i + 1), 2 * (i + 1) + 1
        scales = (math.sqrt((a - 1) / a), 1 / math.sqrt(a), math.sqrt((m - 1) / m), 1 / math.sqrt(m))
        layers.append(LayerSpec(attention=layer.attention, mlp=layer.mlp, moe=layer.moe, residual_scales=scales))
    names = WeightNames(attn_out_norm="post_attention_layernorm", ffn_in_norm="pre_feedforward_layernorm",
                        ffn_out_norm="post_feedforward_layernorm")
    return model_spec(cfg, layers, names=names, final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0))


@adapter("minimax_m3_vl_text")
def minimax_m3(cfg: Config) -> ModelSpec:
    """MiniMax-M3 text: zero-centered norms, partial rope, GPT-OSS-style clamped SwiGLU experts and shared expert,
    sigmoid router with correction bias, and block-sparse indexer attention on ``minimax_m3_sparse`` layers."""
    from freetoken_agent.runtime.model.adapters import rope_spec
    from freetoken_agent.runtime.model.spec import BlockIndexerSpec

    n = int(cfg["num_hidden_layers"])
    types = _types(cfg)
    alpha, limit = float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0))
    head_dim = int(optional_field(cfg, "head_dim", default=cfg["hidden_size"] // cfg["num_attention_heads"]))
    # transformers rotates head_dim · partial_rotary_factor channels; rotary_dim is unused
    rope = rope_spec(cfg, head_dim)
    bx = BlockIndexerSpec(num_heads=int(cfg.get("index_n_heads") or cfg["num_key_value_heads"]),
                          head_dim=int(cfg.get("index_head_dim") or head_dim),
                          block_size=int(cfg.get("index_block_size") or 128),
                          topk_blocks=int(cfg.get("index_topk_blocks") or 16),
                          local_blocks=int(cfg.get("index_local_blocks") or 0))
    attns = [gqa_spec(cfg, qk_norm="head", rope=rope, block_indexer=bx if types[i] == "minimax_m3_sparse" else None)
             for i in range(n)]
    shared = MLPSpec(int(cfg["shared_intermediate_size"]), "swiglu_oai", fused=True,
                     fused_names=("gate_up_proj", "down_proj"), swiglu_alpha=alpha, swiglu_limit=limit)
    moe = MoESpec(num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                  intermediate=int(cfg["intermediate_size"]),
                  router=RouterSpec(scoring="sigmoid", norm_topk=True, correction_bias=True,
                                    scaling=float(cfg.get("routed_scaling_factor") or 1.0)),
                  activation="swiglu_oai", swiglu_alpha=alpha, swiglu_limit=limit, shared=shared)
    dense = MLPSpec(int(cfg.get("dense_intermediate_size") or cfg["intermediate_size"]), "swiglu_oai", fused=True,
                    fused_names=("gate_up_proj", "down_proj"), swiglu_alpha=alpha, swiglu_limit=limit)
    mlp_types = cfg.get("mlp_layer_types") or ["sparse"] * n
    layers = [LayerSpec(attention=attns[i], moe=moe) if mlp_types[i] == "sparse" else
              LayerSpec(attention=attns[i], mlp=dense) for i in range(n)]
    return model_spec(cfg, layers, norm_weight_offset=1.0, ignored_tensors=mtp_ignored(cfg))


@adapter("kolibri1_1")
def kolibri1_1(cfg: Config) -> ModelSpec:
    """Kolibri 1.1: sliding-window GQA layers with RoPE, and NoPE indexed-attention layers (``model/indexed.py``) of
    which some read the keys and values another indexed layer cached; sandwich norms; a sigmoid router scored on
    its logits plus a correction bias; shared experts; leading dense layers (``mlp_only_layers``)."""
    n = int(cfg["num_hidden_layers"])
    types = _types(cfg)
    if len(types) != n or any(t not in ("sliding_attention", "indexed_attention") for t in types):
        raise ValueError(f"layer_types must be {n} entries of 'sliding_attention' / 'indexed_attention', got {types!r}")
    sources = list(cfg.get("kv_source_layers") or range(n))
    index_layers = set(cfg.get("index_layers") or [])
    indexed = [i for i, t in enumerate(types) if t == "indexed_attention"]
    if len(sources) != n or any(not 0 <= s <= i or types[s] != types[i] or sources[s] != s
                                for i, s in enumerate(sources)):
        raise ValueError("kv_source_layers must name, per layer, an earlier layer of its type with its own K/V")
    if indexed and indexed[0] not in index_layers:
        raise ValueError("the first indexed-attention layer must be an indexer (index_layers)")
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    if head_dim % 16:
        raise ValueError(f"NVFP4 rounding of keys and values needs head_dim a multiple of 16, got {head_dim}")

    def attn(i: int) -> Any:
        if types[i] == "sliding_attention":
            return gqa_spec(cfg, qk_norm="head", sliding_window=int(cfg["sliding_window"]))
        ix = SparseIndexSpec(
            topk=int(cfg.get("index_topk", 2048)), pool_size=int(cfg.get("index_pool_size", 16384)),
            compression=int(cfg.get("index_compression", 16)), num_heads=int(cfg.get("index_num_heads", 12)),
            local=int(cfg.get("index_num_local_tokens", 128)), sinks=int(cfg.get("index_num_sink_tokens", 8)),
            pool_source=i in index_layers,
        )  # fmt: skip
        return gqa_spec(cfg, qk_norm="head", rope=None, sparse_index=ix,
                        kv_source=sources[i] if sources[i] != i else None)

    router = RouterSpec(scoring="sigmoid", norm_topk=bool(cfg.get("norm_topk_prob", False)), correction_bias=True,
                        correction_on_logits=True)
    layers = moe_layers(cfg, attn, router, dense_size=int(cfg.get("mlp_only_intermediate_size") or 3584))
    return model_spec(cfg, layers, names=KOLIBRI_NAMES, checkpoint_renames=KOLIBRI_RENAMES)


KOLIBRI_NAMES = WeightNames(correction_bias="moe.router.expert_bias", correction_at_layer=True,
                            attn_out_norm="post_attn_norm", ffn_out_norm="post_ffn_norm")
"""Kolibri's tensor names as its checkpoints store them (and ``save_pretrained`` writes them back)."""
KOLIBRI_RENAMES: tuple[tuple[str, str, bool], ...] = (
    (r"\.post_self_attn_layernorm\.", ".post_attn_norm.", False),
    (r"\.post_mlp_layernorm\.", ".post_ffn_norm.", False),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".moe.router.expert_bias", False),
)
"""A Kolibri checkpoint under transformers' in-memory names read as the stored ones."""
