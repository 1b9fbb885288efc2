"""ZAYA (Zyphra): compressed convolutional attention (``model/cca.py``) with L2-normalized q/k and a learned key
temperature, an MLP router whose state flows from layer to layer with a skip expert (``model/mlp_router.py``),
learned affine residuals and input scaling; every layer is MoE, top-1."""

from __future__ import annotations

from freetoken_agent.runtime.model.adapters import (
    Config,
    activation_name,
    model_spec,
    optional_field,
    rope_spec,
    adapter,
)
from freetoken_agent.runtime.model.spec import (
    AttentionSpec,
    LayerSpec,
    ModelSpec,
    MoESpec,
    RouterSpec,
    WeightNames,
)


@adapter("zaya")
def zaya(cfg: Config) -> ModelSpec:
    n = int(cfg["num_hidden_layers"])
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    head_dim = int(optional_field(cfg, "head_dim", default=int(cfg["hidden_size"]) // heads))
    if heads % kv_heads or (kv_heads * head_dim) % 2:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads, and the value width even")
    types = cfg.get("layer_types") or ["hybrid"] * n
    if len(types) != n or any(t not in ("hybrid", "hybrid_sliding") for t in types):
        raise ValueError(f"layer_types must be {n} entries of 'hybrid' / 'hybrid_sliding', got {types!r}")
    window = cfg.get("sliding_window")
    if "hybrid_sliding" in types and not window:
        raise ValueError("sliding_window must be set when layer_types contains 'hybrid_sliding'")
    bias = bool(cfg.get("attention_bias", False))
    moe = MoESpec(
        num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["moe_intermediate_size"]),
        router=RouterSpec(scoring="softmax", mlp_hidden=int(cfg["router_hidden_size"])),
        activation=activation_name(cfg),  # type: ignore[arg-type]
    )

    def attention(layer_type: str) -> AttentionSpec:
        return AttentionSpec(
            kind="cca", num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim,
            scale=head_dim**-0.5, rope=rope_spec(cfg, head_dim, layer_type=layer_type), qkv_bias=bias, o_bias=bias,
            sliding_window=int(window) if layer_type == "hybrid_sliding" else None,
            cca_kernels=(int(cfg.get("cca_time0", 2)), int(cfg.get("cca_time1", 2))),
        )

    layers = [LayerSpec(attention=attention(t), moe=moe) for t in types]
    names = WeightNames(embed_affine="model.input_hidden_states",
                        residual_affine=("post_attention_residual_scale", "post_mlp_residual_scale"))
    return model_spec(cfg, layers, names=names, tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                  lm_head_bias=bool(cfg.get("lm_head_bias", False)))
