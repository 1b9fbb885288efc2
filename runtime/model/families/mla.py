"""Multi-head latent attention (MLA) families beyond DeepSeek-V2/V3: Sarvam-MLA, A.X K1, GLM-4-MoE-Lite, Mistral 4."""

from __future__ import annotations

from typing import Any

from freetoken_agent.runtime.model.adapters import (
    Config,
    activation_name,
    mla_spec,
    model_spec,
    mtp_ignored,
    rope_params,
    adapter,
)
from freetoken_agent.runtime.model.families.sigmoid import moe_layers, sigmoid_router
from freetoken_agent.runtime.model.spec import (
    IndexerSpec,
    LayerSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    RouterSpec,
    WeightNames,
)


@adapter("sarvam_mla", "glm4_moe_lite")
def deepseek_like_mla(cfg: Config) -> ModelSpec:
    attn = mla_spec(cfg)
    return model_spec(cfg, moe_layers(cfg, lambda i: attn, sigmoid_router(cfg)), ignored_tensors=mtp_ignored(cfg))


@adapter("axk1")
def axk1(cfg: Config) -> ModelSpec:
    attn = mla_spec(cfg)
    layers = moe_layers(cfg, lambda i: attn, sigmoid_router(cfg), moe_fields={"output_norm": True})
    return model_spec(cfg, layers, ignored_tensors=mtp_ignored(cfg))


@adapter("mistral4")
def mistral4(cfg: Config) -> ModelSpec:
    p = rope_params(cfg)
    fields: dict[str, Any] = {}
    if p.get("llama_4_scaling_beta"):
        fields = dict(q_scale_beta=float(p["llama_4_scaling_beta"]),
                      q_scale_period=int(p.get("original_max_position_embeddings") or cfg["max_position_embeddings"]))
    attn = mla_spec(cfg, **fields)
    router = sigmoid_router(cfg, scoring="softmax", correction_bias=False)
    return model_spec(cfg, moe_layers(cfg, lambda i: attn, router), names=WeightNames())


def _indexer(cfg: Config, i: int, style: str, **fields: object) -> IndexerSpec:
    types = cfg.get("indexer_types") or ["full"] * int(cfg["num_hidden_layers"])
    return IndexerSpec(num_heads=int(cfg["index_n_heads"]), head_dim=int(cfg["index_head_dim"]),
                       topk=int(cfg["index_topk"]), rope_dim=int(cfg["qk_rope_head_dim"]),
                       rope_style=style, shared=types[i] == "shared", **fields)  # type: ignore[arg-type]


@adapter("deepseek_v32", "glm_moe_dsa", "axk2")
def deepseek_sparse(cfg: Config) -> ModelSpec:
    """MLA with DeepSeek sparse attention (lightning indexer + top-k keys); GLM-5 rotates the indexer interleaved;
    A.X K2 adds gated queries and gated RMSNorms (before attention, and before each MoE)."""
    axk2 = cfg["model_type"] == "axk2"
    style = "interleaved" if cfg["model_type"] == "glm_moe_dsa" else "half"
    attns = [mla_spec(cfg, indexer=_indexer(cfg, i, style), mla_q_gate=axk2)
             for i in range(int(cfg["num_hidden_layers"]))]
    layers = moe_layers(cfg, lambda i: attns[i], sigmoid_router(cfg))
    if axk2:
        sparse = WeightNames(gated_norm_roles=("attn_in", "ffn_in"))
        dense = WeightNames(gated_norm_roles=("attn_in",))
        layers = [LayerSpec(attention=ly.attention, mlp=ly.mlp, moe=ly.moe, names=sparse if ly.moe else dense)
                  for ly in layers]
    return model_spec(cfg, layers, ignored_tensors=mtp_ignored(cfg))


@adapter("longcat_flash")
def longcat_flash(cfg: Config) -> ModelSpec:
    """LongCat-Flash: each stored layer holds two attention + dense-MLP sub-blocks; a shortcut MoE (with identity
    "zero" experts) reads the first sub-block's MLP input and joins the stream after the second."""
    n = int(cfg.get("num_layers") or cfg["num_hidden_layers"])
    d = int(cfg["hidden_size"])
    act = activation_name(cfg)
    moe = MoESpec(
        num_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["moe_topk"]),
        intermediate=int(cfg["expert_ffn_hidden_size"]),
        router=RouterSpec(scoring="softmax", correction_bias=True, bias=bool(cfg.get("router_bias", False)),
                          scaling=float(cfg.get("routed_scaling_factor") or 1.0)),
        activation=act, zero_experts=int(cfg.get("zero_expert_num") or 0),  # type: ignore[arg-type]
    )
    dense = MLPSpec(int(cfg["ffn_hidden_size"]), act)  # type: ignore[arg-type]
    attn = mla_spec(cfg, mla_q_scale=(d / int(cfg["q_lora_rank"])) ** 0.5,
                    mla_kv_scale=(d / int(cfg["kv_lora_rank"])) ** 0.5)
    layers = []
    for i in range(n):
        for sub in (0, 1):
            names = WeightNames(attn=f"self_attn.{sub}", mlp=f"mlps.{sub}", attn_in_norm=f"input_layernorm.{sub}",
                                ffn_in_norm=f"post_attention_layernorm.{sub}", router="router.classifier",
                                correction_bias="router.e_score_correction_bias")
            layers.append(LayerSpec(attention=attn, mlp=dense, moe=moe if sub == 0 else None,
                                    moe_shortcut="compute" if sub == 0 else "add", prefix=f"model.layers.{i}",
                                    names=names))
    # transformers stores (never used) weights for the identity experts too
    zero_ids = "|".join(str(e) for e in range(moe.num_experts, moe.num_experts + moe.zero_experts))
    ignored = mtp_ignored({**cfg, "num_hidden_layers": n}) + ((rf"\.mlp\.experts\.({zero_ids})\.",) if zero_ids else ())
    return model_spec({**cfg, "num_hidden_layers": n}, layers, ignored_tensors=ignored)


@adapter("dots3_note_text")
def dots3_note_text(cfg: Config) -> ModelSpec:
    """dots3: MLA everywhere — indexed (sparse) layers and sliding-window layers — with scaled latents, a normed
    rotary key, per-head sigmoid output gates and per-layer-type rope."""
    n = int(cfg["num_hidden_layers"])
    per_layer = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items() if str(k).isdigit()}
    types = cfg.get("layer_types") or ["indexed_attention"] * n
    d, eps = int(cfg["hidden_size"]), float(cfg.get("rms_norm_eps", 1e-6))
    common = dict(mla_q_latent_scale=(d / int(cfg["q_lora_rank"])) ** 0.5, mla_kv_scale=(d / int(cfg["kv_lora_rank"])) ** 0.5,
                  k_rope_norm=True, lora_norm_eps=eps, output_gate="sigmoid", output_gate_per_head=True)

    def attn(i: int):  # type: ignore[no-untyped-def]
        from freetoken_agent.runtime.model.adapters import rope_spec

        lcfg = {**cfg, **per_layer.get(i, {})}  # per-layer head / rank overrides
        layer_common = {**common, "mla_kv_scale": (d / int(lcfg["kv_lora_rank"])) ** 0.5}
        base = mla_spec(lcfg, **layer_common)
        rope = rope_spec(lcfg, base.qk_rope_dim, "interleaved", rotary_dim=base.qk_rope_dim, layer_type=types[i])
        if types[i] == "sliding_attention":
            return mla_spec(lcfg, **layer_common, rope=rope, scale=base.head_dim**-0.5,
                        sliding_window=cfg.get("sliding_window"))
        return mla_spec(lcfg, **layer_common, rope=rope, scale=base.head_dim**-0.5,
                    indexer=_indexer(cfg, i, "interleaved"))

    attns = [attn(i) for i in range(n)]
    names = WeightNames(output_gate="g_proj")
    # one shared MLP of shared_experts_intermediate_size x n_shared_experts channels (as transformers builds it)
    shared = int(cfg.get("shared_experts_intermediate_size") or 0) * int(cfg.get("n_shared_experts") or 0)
    moe_fields = {"shared": MLPSpec(shared, activation_name(cfg)) if shared else None}
    return model_spec(cfg, moe_layers(cfg, lambda i: attns[i], sigmoid_router(cfg), moe_fields=moe_fields), names=names,
                  ignored_tensors=mtp_ignored(cfg))


@adapter("hy_v4")
def hy_v4(cfg: Config) -> ModelSpec:
    """Hunyuan HY-V4: MLA + sparse-attention indexer (shared layers), learnable sinks, per-channel output gates,
    clamped-SiLU experts and hyper-connections (several residual streams)."""
    from freetoken_agent.runtime.model.adapters import rope_spec

    n = int(cfg["num_hidden_layers"])
    rope_dim, eps = int(cfg["qk_rope_head_dim"]), float(cfg.get("rms_norm_eps", 1e-6))
    # interleaved pairs in both ropes, as transformers 5.25 turns them (5.24 turned them by halves)
    rope = rope_spec(cfg, rope_dim, "interleaved", rotary_dim=rope_dim)
    attns = [mla_spec(cfg, rope=rope, sinks=True, output_gate="sigmoid",
                  indexer=_indexer(cfg, i, "interleaved", rope_last=True, k_norm_eps=eps, scale_after_relu=True))
             for i in range(n)]
    leaves = ("linear_gate", "up_proj", "down_proj")
    layers = []
    for ly in moe_layers(cfg, lambda i: attns[i], sigmoid_router(cfg),
                         moe_fields={"activation": "silu_clamp", "swiglu_limit": float(cfg.get("swiglu_limit") or 10.0)}):
        moe = ly.moe
        if moe is not None and moe.shared is not None:
            from dataclasses import replace

            moe = replace(moe, shared=replace(moe.shared, leaves=leaves))
        mlp = None if ly.mlp is None else MLPSpec(ly.mlp.intermediate, ly.mlp.activation, leaves=leaves)
        layers.append(LayerSpec(attention=ly.attention, mlp=mlp, moe=moe))
    names = WeightNames(output_gate="linear_gate", sinks="learnable_sink_param")
    return model_spec(cfg, layers, names=names, hyper_streams=int(cfg.get("hc_mult") or 4),
                  hyper_magnitude=float(cfg.get("hc_magnitude") or 2.0), hyper_eps=float(cfg.get("hc_eps") or 1e-6),
                  ignored_tensors=mtp_ignored(cfg))
