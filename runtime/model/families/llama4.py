"""Llama 4 text: sigmoid top-k router scaling the expert input, chunked local attention, NoPE layers with
temperature tuning, weightless qk norm, dense/MoE interleave."""

from __future__ import annotations

from typing import Any

from freetoken_agent.runtime.model.adapters import Config, activation_name, gqa_spec, model_spec, adapter
from freetoken_agent.runtime.model.spec import LayerSpec, MLPSpec, ModelSpec, MoESpec, RouterSpec, WeightNames


@adapter("llama4_text")
def llama4_text(cfg: Config) -> ModelSpec:
    n = int(cfg["num_hidden_layers"])
    act = activation_name(cfg)
    moe = MoESpec(
        num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["intermediate_size"]),
        router=RouterSpec(scoring="sigmoid", topk_before_scoring=True), activation=act,  # type: ignore[arg-type]
        shared=MLPSpec(int(cfg["intermediate_size"]), act), scale_input=True,  # type: ignore[arg-type]
    )
    dense = MLPSpec(int(cfg.get("intermediate_size_mlp") or cfg["intermediate_size"]), act)  # type: ignore[arg-type]
    # published configs carry "no_rope_layers": [] and no layer_types; transformers derives them: every
    # no_rope_layer_interval-th layer is NoPE, the others rotate and (with a chunk size) attend within chunks
    interval = int(cfg.get("no_rope_layer_interval") or 4)
    use_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    step = int(cfg.get("interleave_moe_layer_step") or 1)
    moe_layers = set(cfg["moe_layers"] if cfg.get("moe_layers") is not None else range(step - 1, n, step))
    chunked = cfg.get("attention_chunk_size") is not None
    types = cfg.get("layer_types") or ["chunked_attention" if r and chunked else "full_attention" for r in use_rope]
    bias = bool(cfg.get("attention_bias", False))
    layers = []
    for i in range(n):
        fields: dict[str, Any] = dict(qkv_bias=bias, o_bias=bias, style="interleaved")
        if types[i] == "chunked_attention" and cfg.get("attention_chunk_size"):
            fields["chunk_size"] = int(cfg["attention_chunk_size"])
        if use_rope[i]:
            if cfg.get("use_qk_norm"):
                fields.update(qk_norm="head_unit", qk_norm_after_rope=True)
        else:
            fields["rope"] = None
            if cfg.get("attn_temperature_tuning"):
                fields.update(q_scale_beta=float(cfg["attn_scale"]), q_scale_period=int(cfg["floor_scale"]),
                              q_scale_offset=1)
        attn = gqa_spec(cfg, **fields)
        layers.append(LayerSpec(attention=attn, moe=moe) if i in moe_layers else LayerSpec(attention=attn, mlp=dense))
    names = WeightNames(moe_prefix="feed_forward", mlp="feed_forward", router="router", shared="shared_expert",
                        gate_up_layout="concat_transposed")
    return model_spec(cfg, layers, names=names)
