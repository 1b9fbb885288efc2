"""Softmax-router MoE families beyond the core: OLMo-style post-norm, Mellum, Hunyuan, Aria, Granite variants."""

from __future__ import annotations

from dataclasses import replace

from freetoken_agent.runtime.model.adapters import (
    Config,
    activation_name,
    gqa_spec,
    sliding_layers,
    model_spec,
    required_field,
    rope_params,
    adapter,
)
from freetoken_agent.runtime.model.spec import LayerSpec, MLPSpec, ModelSpec, MoESpec, RouterSpec, WeightNames


def _softmax_moe(cfg: Config, inter: int, norm_topk: bool, **fields: object) -> MoESpec:
    return MoESpec(
        num_experts=int(required_field(cfg, "num_experts", "num_local_experts", "moe_num_experts", "n_routed_experts")),
        top_k=int(required_field(cfg, "num_experts_per_tok", "moe_topk", "moe_k")),
        intermediate=inter,
        router=RouterSpec(scoring="softmax", norm_topk=norm_topk),
        activation=activation_name(cfg),  # type: ignore[arg-type]
        **fields,  # type: ignore[arg-type]
    )


@adapter("flex_olmo")
def flex_olmo(cfg: Config) -> ModelSpec:
    moe = _softmax_moe(cfg, int(cfg["intermediate_size"]), bool(cfg.get("norm_topk_prob", False)))
    bias = bool(cfg.get("attention_bias", False))
    attn = gqa_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm="full", clip_qkv=cfg.get("clip_qkv"))
    names = WeightNames(attn_in_norm=None, attn_out_norm="post_attention_layernorm", ffn_in_norm=None,
                        ffn_out_norm="post_feedforward_layernorm")
    return model_spec(cfg, [LayerSpec(attention=attn, moe=moe) for _ in range(cfg["num_hidden_layers"])], names=names)


@adapter("mellum")
def mellum(cfg: Config) -> ModelSpec:
    n = int(cfg["num_hidden_layers"])
    moe = _softmax_moe(cfg, int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob", False)))
    dense = MLPSpec(int(cfg["intermediate_size"]), activation_name(cfg))  # type: ignore[arg-type]
    types = cfg.get("layer_types") or ["full_attention"] * n
    mlp_types = cfg.get("mlp_layer_types") or ["sparse"] * n
    bias = bool(cfg.get("attention_bias", False))
    layers = []
    for i in range(n):
        attn = gqa_spec(cfg, layer_type=types[i], qkv_bias=bias, o_bias=bias, qk_norm="head",
                    sliding_window=cfg.get("sliding_window") if types[i] == "sliding_attention" else None)
        layers.append(LayerSpec(attention=attn, moe=moe) if mlp_types[i] == "sparse" else
                      LayerSpec(attention=attn, mlp=dense))
    return model_spec(cfg, layers, ignored_tensors=(r"^mtp\.",))


@adapter("hunyuan_v1_moe")
def hunyuan_v1_moe(cfg: Config) -> ModelSpec:
    inter = int(cfg["intermediate_size"])
    topk = cfg.get("moe_topk")  # published Hunyuan-A13B gives one top-k per layer
    moes = [_softmax_moe({**cfg, "moe_topk": topk[i] if isinstance(topk, list) else topk}, inter, True,
                         shared=MLPSpec(inter, activation_name(cfg)))  # type: ignore[arg-type]
            for i in range(int(cfg["num_hidden_layers"]))]
    bias = bool(cfg.get("attention_bias", False))
    attn = gqa_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head", qk_norm_after_rope=True)
    if attn.rope is not None and attn.rope.kind == "dynamic" and attn.rope.alpha:
        # transformers' Hunyuan rotary: "dynamic" with an alpha is a fixed NTK stretch, not length-dependent
        attn = replace(attn, rope=replace(attn.rope, kind="ntk_alpha"))
    names = WeightNames(router="gate.wg", shared="shared_mlp", q_norm="query_layernorm", k_norm="key_layernorm")
    return model_spec(cfg, [LayerSpec(attention=attn, moe=moe) for moe in moes], names=names)


@adapter("aria_text")
def aria_text(cfg: Config) -> ModelSpec:
    inter = int(cfg["intermediate_size"])
    shared_n = int(cfg.get("moe_num_shared_experts") or 0)
    moe = MoESpec(
        num_experts=int(cfg["moe_num_experts"]), top_k=int(cfg["moe_topk"]), intermediate=inter,
        router=RouterSpec(scoring="none", topk_before_scoring=True), activation="silu",
        shared=(MLPSpec(inter * shared_n, activation_name(cfg),  # type: ignore[arg-type]
                        bias=bool(cfg.get("mlp_bias", False))) if shared_n else None),
    )
    bias = bool(cfg.get("attention_bias", False))
    attn = gqa_spec(cfg, qkv_bias=bias, o_bias=bias)
    names = WeightNames(router="router", gate_up_layout="concat_transposed",
                        fused_names=("experts.fc1.weight", "experts.fc2.weight"))
    return model_spec(cfg, [LayerSpec(attention=attn, moe=moe) for _ in range(cfg["num_hidden_layers"])], names=names)


@adapter("granitemoeshared", "granitemoe_swa")
def granite_shared(cfg: Config) -> ModelSpec:
    n = int(cfg["num_hidden_layers"])
    shared = int(cfg.get("shared_intermediate_size") or 0)
    moe = MoESpec(
        num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["intermediate_size"]), router=RouterSpec(scoring="none", topk_before_scoring=True),
        activation=activation_name(cfg),  # type: ignore[arg-type]
        shared=MLPSpec(shared, activation_name(cfg), fused=True) if shared else None,  # type: ignore[arg-type]
    )
    swa = cfg["model_type"] == "granitemoe_swa"
    sliding = sliding_layers(cfg)
    thetas = cfg.get("layer_rope_theta")
    bias = bool(cfg.get("attention_bias", False))
    layers = []
    for i in range(n):
        # a per-layer theta replaces only the base (the rope type and its parameters stay); theta 0 is NoPE
        lcfg = {**cfg, "rope_parameters": {**rope_params(cfg), "rope_theta": thetas[i]}} if thetas else cfg
        attn = gqa_spec(lcfg, qkv_bias=bias, o_bias=bias, scale=float(cfg.get("attention_multiplier", 1.0)), sinks=swa,
                    sliding_window=cfg.get("sliding_window") if sliding[i] else None,
                    **({"rope": None} if thetas and not thetas[i] else {}))
        layers.append(LayerSpec(attention=attn, moe=moe))
    names = WeightNames(moe_prefix="block_sparse_moe", router="router" if swa else "router.layer", shared="shared_mlp",
                        shared_at_layer=True, fused_names=("input_linear.weight", "output_linear.weight"))
    return model_spec(
        cfg, layers,
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_divisor=float(cfg.get("logits_scaling", 1.0)),
        names=names,
    )


@adapter("cohere2_moe")
def cohere2_moe(cfg: Config) -> ModelSpec:
    """Cohere 2 MoE: parallel attention + MoE from one LayerNorm, RoPE only on sliding layers, scaled logits."""
    n = int(cfg["num_hidden_layers"])
    act = activation_name(cfg)
    inter = int(cfg["intermediate_size"])
    shared_n = int(cfg.get("num_shared_experts") or 0)
    sigmoid = cfg.get("expert_selection_fn", "softmax") == "sigmoid"
    moe = MoESpec(
        num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]), intermediate=inter,
        router=RouterSpec(scoring="sigmoid" if sigmoid else "none", topk_before_scoring=True,
                          norm_topk=sigmoid and bool(cfg.get("norm_topk_prob", True))),
        activation=act, shared=MLPSpec(inter * shared_n, act) if shared_n else None,  # type: ignore[arg-type]
        shared_average=cfg.get("shared_expert_combination_strategy") == "average",
    )
    dense = MLPSpec(int(cfg.get("prefix_dense_intermediate_size") or inter), act)  # type: ignore[arg-type]
    types = cfg.get("layer_types") or ["full_attention"] * n
    mlp_types = cfg.get("mlp_layer_types") or ["sparse"] * n
    bias = bool(cfg.get("attention_bias", False))
    layers = []
    for i in range(n):
        sliding = types[i] == "sliding_attention"
        force_rope = mlp_types[i] == "dense" and cfg.get("prefix_dense_sliding_window_pattern") == 1
        attn = gqa_spec(cfg, style="interleaved", qkv_bias=bias, o_bias=bias,
                    sliding_window=cfg.get("sliding_window") if sliding else None,
                    **({} if sliding or force_rope else {"rope": None}))
        layers.append(LayerSpec(attention=attn, moe=moe) if mlp_types[i] == "sparse" else
                      LayerSpec(attention=attn, mlp=dense))
    rms = cfg.get("rms_norm_eps") is not None
    names = WeightNames(ffn_in_norm=None)
    return model_spec(cfg, layers, names=names, parallel_block=True, norm_kind="rms" if rms else "layer",
                  norm_eps=float(cfg["rms_norm_eps"] if rms else cfg.get("layer_norm_eps", 1e-5)),
                  logits_divisor=1.0 / float(cfg.get("logit_scale") or 1.0))


@adapter("phimoe")
def phimoe(cfg: Config) -> ModelSpec:
    """PhiMoE: SparseMixer top-2 routing, LayerNorms with bias, optional lm_head bias."""
    moe = MoESpec(
        num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["intermediate_size"]),
        router=RouterSpec(scoring="sparsemixer", jitter_eps=float(cfg.get("router_jitter_noise") or 0.01)),
        activation=activation_name(cfg),  # type: ignore[arg-type]
    )
    bias = bool(cfg.get("attention_bias", False))
    attn = gqa_spec(cfg, qkv_bias=bias, o_bias=bias, sliding_window=cfg.get("sliding_window"))
    if attn.rope is not None and attn.rope.kind != "default":
        # transformers' PhiMoE rotary computes the frequencies once (seq_len None: longrope's short factors) and
        # scales cos/sin by short_mscale / long_mscale, switched at original_max_position_embeddings
        p = rope_params(cfg)
        attn = replace(attn, rope=replace(attn.rope, frequency_update=False, short_mscale=float(p["short_mscale"]),
                                          long_mscale=float(p["long_mscale"])))
    return model_spec(cfg, [LayerSpec(attention=attn, moe=moe) for _ in range(cfg["num_hidden_layers"])],
                  names=WeightNames(moe_prefix="block_sparse_moe"), norm_kind="layer", norm_bias=True,
                  lm_head_bias=bool(cfg.get("lm_head_bias", False)))


@adapter("dbrx")
def dbrx(cfg: Config) -> ModelSpec:
    """DBRX: fused Wqkv with clip_qkv, bias-free LayerNorms, softmax top-k renormalized by a p-norm."""
    attn_cfg, ffn = cfg.get("attn_config") or {}, cfg.get("ffn_config") or {}
    d, heads = int(cfg["d_model"]), int(cfg["n_heads"])
    flat = {**cfg, "hidden_size": d, "num_attention_heads": heads, "num_key_value_heads": attn_cfg.get("kv_n_heads", 1),
            "rope_theta": attn_cfg.get("rope_theta", 10000.0), "max_position_embeddings": cfg.get("max_seq_len", 2048),
            "num_hidden_layers": cfg["n_layers"]}
    p = ffn.get("moe_normalize_expert_weights", 1.0)  # transformers' default when absent (dbrx-instruct)
    moe = MoESpec(
        num_experts=int(ffn["moe_num_experts"]), top_k=int(ffn["moe_top_k"]), intermediate=int(ffn["ffn_hidden_size"]),
        router=RouterSpec(scoring="softmax", norm_topk=p is not None, norm_p=float(p or 1.0)),
        activation=activation_name(ffn.get("ffn_act_fn") or {}, "name"),
    )
    attn = gqa_spec(flat, clip_qkv=attn_cfg.get("clip_qkv"))
    names = WeightNames(layers="transformer.blocks", embed="transformer.wte", final_norm="transformer.norm_f",
                        attn="norm_attn_norm.attn", fused_qkv="Wqkv", o_proj="out_proj", moe_prefix="ffn",
                        router="router.layer", gate_up_layout="dbrx", attn_in_norm="norm_attn_norm.norm_1",
                        ffn_in_norm="norm_attn_norm.norm_2")
    return model_spec(flat, [LayerSpec(attention=attn, moe=moe) for _ in range(int(cfg["n_layers"]))], names=names,
                  norm_kind="layer", norm_eps=1e-5)


@adapter("jetmoe")
def jetmoe(cfg: Config) -> ModelSpec:
    """JetMoE: mixture-of-attention-heads (routed query/output experts over shared KV) and a biased MoE MLP."""
    from freetoken_agent.runtime.model.adapters import rope_spec
    from freetoken_agent.runtime.model.spec import AttentionSpec

    hkv, dh, k = int(cfg["num_key_value_heads"]), int(cfg["kv_channels"]), int(cfg["num_experts_per_tok"])
    attn = AttentionSpec(kind="moa", num_heads=hkv * k, num_kv_heads=hkv, head_dim=dh, v_head_dim=dh,
                         scale=dh**-0.5, rope=rope_spec(cfg, dh))
    moe = MoESpec(
        num_experts=int(cfg["num_local_experts"]), top_k=k, intermediate=int(cfg["intermediate_size"]),
        router=RouterSpec(scoring="none", topk_before_scoring=True),
        activation=activation_name(cfg, "activation_function"), output_bias=True,
    )
    names = WeightNames(attn="self_attention", router="router.layer",
                        fused_names=("input_linear.weight", "output_linear.weight"))
    return model_spec(cfg, [LayerSpec(attention=attn, moe=moe) for _ in range(int(cfg["num_hidden_layers"]))],
                  names=names, norm_eps=float(cfg.get("rms_norm_eps") or 1e-6))


@adapter("doge")
def doge(cfg: Config) -> ModelSpec:
    """Doge: dynamic-mask attention (learned per-key bias, top-k window), learned residual scales and, with
    ``is_moe``, the cross-domain product-key MoE over rank-1 experts beside a dense MLP."""
    act = activation_name(cfg)
    dense = MLPSpec(int(cfg["intermediate_size"]), act, bias=bool(cfg.get("mlp_bias", False)))  # type: ignore[arg-type]
    bias = bool(cfg.get("attention_bias", False))
    attn = gqa_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head", dynamic_mask=True,
                keep_window=int(cfg.get("keep_window_size") or 2048), sliding_window=cfg.get("sliding_window"))
    if cfg.get("is_moe"):
        moe = MoESpec(num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                      intermediate=dense.intermediate, kind="product_key", activation=act,  # type: ignore[arg-type]
                      router=RouterSpec(norm_topk=bool(cfg.get("norm_topk_prob", False))), shared=dense)
        layers = [LayerSpec(attention=attn, moe=moe) for _ in range(int(cfg["num_hidden_layers"]))]
    else:
        layers = [LayerSpec(attention=attn, mlp=dense) for _ in range(int(cfg["num_hidden_layers"]))]
    names = WeightNames(residual_weights=("input_residual", "post_attention_residual"))
    return model_spec(cfg, layers, names=names)
