"""Ergo (Amazon): sliding-window layers with RoPE and every n-th layer global without position embeddings (its
logits optionally scaled), a fused q|k|v projection with per-head q/k RMSNorm, sandwich norms around both sub-layers,
learned residual gates instead of plain adds, leading dense relu² MLPs, and MoE layers whose ungated relu² experts
each end in their own RMSNorm before a sigmoid router's weighted sum, plus a relu² shared expert ending in a norm."""

from __future__ import annotations

from freetoken_agent.runtime.model.adapters import Config, adapter, gqa_spec, model_spec, optional_field
from freetoken_agent.runtime.model.families.sigmoid import sigmoid_router
from freetoken_agent.runtime.model.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec, WeightNames

ERGO_NAMES = WeightNames(
    router="gate.linear", fused_qkv="qkv_proj", gate_up_layout="concat_transposed",
    fused_names=("experts.up_proj", "experts.down_proj"),
    attn_in_norm="input_layernorm", attn_out_norm="post_attention_layernorm",
    ffn_in_norm="pre_feedforward_layernorm", ffn_out_norm="post_feedforward_layernorm",
    residual_gates=("attention_residual_gate", "feedforward_residual_gate"),
)  # fmt: skip
"""Ergo's tensor names as transformers holds them (its experts: ``up_proj`` [E, D, I] and ``down_proj`` [E, I, D], no
gate)."""

ERGO_RENAMES: tuple[tuple[str, str, bool], ...] = (
    (r"^tok_embeddings\.", "model.embed_tokens.", False),
    (r"^norm\.", "model.norm.", False),
    (r"^output\.", "lm_head.", False),
    (r"^layers\.", "model.layers.", False),
    (r"\.attention_norm\.", ".input_layernorm.", False),
    (r"\.post_attention_norm\.", ".post_attention_layernorm.", False),
    (r"\.ffn_norm\.", ".pre_feedforward_layernorm.", False),
    (r"\.post_ffn_norm\.", ".post_feedforward_layernorm.", False),
    (r"\.post_attention_residual\.scale$", ".attention_residual_gate.weight", False),
    (r"\.post_ffn_residual\.scale$", ".feedforward_residual_gate.weight", False),
    (r"\.attention\.wqkv\.", ".self_attn.qkv_proj.", False),
    (r"\.attention\.wo\.", ".self_attn.o_proj.", False),
    (r"\.attention\.(q|k)_norm\.", r".self_attn.\1_norm.", False),
    (r"\.feed_forward\.up\.", ".mlp.up_proj.", False),
    (r"\.feed_forward\.down\.", ".mlp.down_proj.", False),
    (r"\.feed_forward\.gate_kernel$", ".mlp.gate.linear.weight", True),  # stored [D, E]
    (r"\.feed_forward\.router_bias$", ".mlp.gate.e_score_correction_bias", False),
    (r"\.feed_forward\.(up|down)_proj$", r".mlp.experts.\1_proj", False),
    (r"\.feed_forward\.expert_output_norm\.scale$", ".mlp.experts.post_expert_norm.weight", False),
    (r"\.feed_forward\.shared_(up|down)_proj$", r".mlp.shared_experts.\1_proj.weight", True),  # stored [in, out]
    (r"\.feed_forward\.shared_expert_output_norm\.scale$", ".mlp.shared_experts.norm.weight", False),
)
"""The released checkpoints' own names (what ``save_pretrained`` writes back) → transformers' (its
``conversion_mapping`` for ergo); checkpoints already under transformers' names match no rule."""


@adapter("ergo")
def ergo(cfg: Config) -> ModelSpec:
    n = int(cfg["num_hidden_layers"])
    heads, d = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    if d % heads:
        raise ValueError(f"hidden_size ({d}) must be a multiple of num_attention_heads ({heads}): Ergo's head_dim")
    head_dim = d // heads
    # absent fields take ErgoConfig's defaults (a config.json written by transformers carries them all)
    every = int(cfg.get("global_attention_every_n_layers") or 4)
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    dense_n = int(cfg.get("num_dense_blocks", 1))
    mlp_types = cfg.get("mlp_layer_types") or ["dense" if i < dense_n else "sparse" for i in range(n)]
    if len(types) != n or len(mlp_types) != n:
        raise ValueError(f"layer_types and mlp_layer_types must have {n} entries")
    if any(t not in ("sliding_attention", "full_attention") for t in types) or any(
            t not in ("dense", "sparse") for t in mlp_types):
        raise ValueError(f"unknown Ergo layer types: {types!r} / {mlp_types!r}")
    window = int(optional_field(cfg, "sliding_window", "local_attention_window", default=512))
    if "sliding_attention" in types and window < 1:
        raise ValueError("sliding_window must be set when layer_types contains 'sliding_attention'")
    global_scale = cfg.get("global_attention_scale")
    params = cfg.get("rope_parameters") or {}
    if params and not all(isinstance(v, dict) or v is None for v in params.values()):
        params = {"sliding_attention": params, "full_attention": None}  # flat: the sliding layers' rope
    rope_cfg = {**cfg, "rope_parameters": params or None, "head_dim": head_dim,  # the rope turns the whole head
                "rope_theta": cfg.get("rope_theta", 1_000_000.0)}  # (adapters.WHOLE_HEAD_ROPE)

    def attention(kind: str) -> AttentionSpec:
        if kind == "sliding_attention":
            return gqa_spec(rope_cfg, "interleaved", layer_type=kind, qk_norm="head", sliding_window=window)
        scale = head_dim**-0.5 * (float(global_scale) if global_scale is not None else 1.0)
        return gqa_spec(rope_cfg, qk_norm="head", scale=scale, rope=None)  # global layers: no position embeddings

    moe = MoESpec(
        num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["moe_intermediate_size"]), activation="relu2", gated=False,
        router=sigmoid_router(cfg, scaling=float(cfg.get("moe_routed_scaling_factor", 8**0.5)), norm_topk=True,
                              n_group=1, topk_group=1),
        shared=MLPSpec(int(cfg["shared_intermediate_size"]), "relu2", gated=False), shared_out_norm=True,
        expert_out_norm=True,
    )  # fmt: skip
    dense = MLPSpec(int(cfg["first_dense_intermediate_size"]), "relu2", gated=False)
    layers = [LayerSpec(attention=attention(t), moe=moe) if m == "sparse"
              else LayerSpec(attention=attention(t), mlp=dense) for t, m in zip(types, mlp_types)]
    return model_spec(cfg, layers, names=ERGO_NAMES, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                      norm_eps=float(cfg.get("rms_norm_eps", 1e-12)), checkpoint_renames=ERGO_RENAMES)
