"""Inkling (Thinking Machines): relative-position attention without rotary, short convolutions on keys, values and
both sub-layer outputs, a sigmoid router whose shared experts act as a softmax sink, normed embeddings, muP logits;
Inkling 2 adds block attention residuals, softcapped SwiGLU experts and (``inkling2_loop_text``) looped layers.

The attention lives in ``model/relpos.py``, the router in ``model/shared_sink.py``, the conv states in
``model/conv_states.py``, Inkling 2's layer loop in ``model/attn_residual.py``; this module only reads
``config.json``.
"""

from __future__ import annotations

from dataclasses import replace

from freetoken_agent.runtime.model.adapters import Config, activation_name, eos_ids, optional_field, adapter
from freetoken_agent.runtime.model.attn_residual import (
    FINAL_QUERY,
    GATES,
    INPUT_NORMS,
    MESSAGE_QUERIES,
    ROOT,
    attn_query,
    mlp_query,
)
from freetoken_agent.runtime.model.spec import (
    AttentionSpec,
    AttnResidualSpec,
    ExtraTensor,
    LayerSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    RelPosSpec,
    RouterSpec,
    WeightNames,
)


def layer_is_sliding(cfg: Config) -> list[bool]:
    """Per layer: sliding-window attention (``hybrid_sliding``) or full (``hybrid``); transformers' default when
    the config has neither ``layer_types`` nor ``local_layer_ids``: every layer but each sixth is sliding."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types:
        if len(types) != n or any(t not in ("hybrid", "hybrid_sliding") for t in types):
            raise ValueError(f"layer_types must be {n} entries of 'hybrid' / 'hybrid_sliding', got {types!r}")
        return [t == "hybrid_sliding" for t in types]
    local = cfg.get("local_layer_ids")
    if local is not None:
        return [i in set(local) for i in range(n)]
    return [bool((i + 1) % 6) for i in range(n)]


def relpos_attention_spec(cfg: Config, sliding: bool, variant: str) -> AttentionSpec:
    """The attention of one layer: the ``swa_*`` sizes and the window on sliding layers, log scaling on full ones."""
    prefix = "swa_" if sliding else ""
    heads = int(cfg[f"{prefix}num_attention_heads"])
    kv_heads = int(cfg[f"{prefix}num_key_value_heads"])
    head_dim = int(cfg[f"{prefix}head_dim"])
    window = int(optional_field(cfg, "sliding_window_size", "sliding_window"))
    if heads % kv_heads:
        raise ValueError(f"{prefix}num_attention_heads {heads} is not a multiple of {prefix}num_key_value_heads")
    floor = cfg.get("log_scaling_n_floor")
    relpos = RelPosSpec(
        d_rel=int(cfg["d_rel"]), extent=window if sliding else int(cfg["rel_extent"]),
        conv_kernel=int(optional_field(cfg, "conv_kernel_size", "sconv_kernel_size", default=4)),
        variant=variant,  # type: ignore[arg-type]
        log_floor=None if sliding or floor is None else int(floor), log_alpha=float(cfg.get("log_scaling_alpha", 0.1)),
        dynamic_conv=variant == "inkling2" and not sliding,
        qk_clip=float(cfg.get("qk_l2_clip_threshold") or 0.0), rel_clip=float(cfg.get("rel_l2_clip_threshold") or 0.0),
    )
    # Inkling normalizes q and k per head (RMSNorm), hence 1/Dh; Inkling 2 keeps the usual 1/sqrt(Dh)
    scale = 1.0 / head_dim if variant == "inkling" else head_dim**-0.5
    return AttentionSpec(kind="relpos", num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                         v_head_dim=head_dim, scale=scale, rope=None, sliding_window=window if sliding else None,
                         relpos=relpos)


def lm_head_rows(cfg: Config) -> int | None:
    rows = cfg.get("unpadded_vocab_size")
    return int(rows) if rows is not None and int(rows) < int(cfg["vocab_size"]) else None


@adapter("inkling_text")
def inkling(cfg: Config) -> ModelSpec:
    n = int(cfg["num_hidden_layers"])
    act = activation_name(cfg)
    sliding = layer_is_sliding(cfg)
    mlp_types = cfg.get("mlp_layer_types") or ["sparse"] * n
    if len(mlp_types) != n or any(t not in ("dense", "sparse") for t in mlp_types):
        raise ValueError(f"mlp_layer_types must be {n} entries of 'dense' / 'sparse', got {mlp_types!r}")
    n_shared = int(cfg.get("n_shared_experts") or 0)
    if n_shared < 1:
        raise ValueError("Inkling's router scores its shared experts as a sink: n_shared_experts must be >= 1")
    inter = int(cfg["moe_intermediate_size"])
    moe = MoESpec(
        num_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["num_experts_per_tok"]), intermediate=inter,
        router=RouterSpec(scoring="sigmoid", correction_bias=True, scaling=float(cfg.get("route_scale", 1.0)),
                          shared_sink=n_shared, global_scale=True),
        activation=act,  # type: ignore[arg-type]
        shared=MLPSpec(inter, act),  # type: ignore[arg-type]
    )
    dense = MLPSpec(int(cfg["intermediate_size"]), act, out_scale=True)  # type: ignore[arg-type]
    kernel = int(optional_field(cfg, "conv_kernel_size", "sconv_kernel_size", default=4))
    layers = [
        LayerSpec(attention=relpos_attention_spec(cfg, sliding[i], "inkling"),
                  moe=moe if mlp_types[i] == "sparse" else None, mlp=dense if mlp_types[i] == "dense" else None,
                  post_conv=kernel)
        for i in range(n)
    ]
    return ModelSpec(
        model_type=cfg["model_type"], vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        layers=tuple(layers), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        logits_divisor=float(cfg.get("logits_mup_width_multiplier", 1.0)), lm_head_rows=lm_head_rows(cfg),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        names=WeightNames(correction_bias="gate.e_score_correction_bias", embed_norm="model.embed_tokens.embed_norm"),
        ignored_tensors=(r"^model\.mtp\.",),
        bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
        eos_token_ids=eos_ids(cfg),
    )


def _inkling2_extras(cfg: Config, sliding: bool, looped: bool) -> tuple[ExtraTensor, ...]:
    """A layer's tensors owned by ``model/attn_residual.py``: input norms, output convolutions, loop gates."""
    d, k = int(cfg["hidden_size"]), int(optional_field(cfg, "conv_kernel_size", "sconv_kernel_size", default=4))
    norms = ("attn_norm",) if sliding else INPUT_NORMS
    extras = [(f"{name}.weight", (d,)) for name in (*norms, "mlp_norm")]
    extras += [(f"{name}.weight", (d, 1, k)) for name in ("attn_sconv", "mlp_sconv")]
    if looped:
        rank = int(cfg["loop_gate_rank"])
        for gate in GATES:
            extras += [(f"{gate}.down_weight", (rank, 2 * d)), (f"{gate}.forget_weight", (d, rank)),
                       (f"{gate}.gain_weight", (d, rank))]
    return tuple(ExtraTensor(name, shape) for name, shape in extras)


@adapter("inkling2_text", "inkling2_loop_text")
def inkling2(cfg: Config) -> ModelSpec:
    """Inkling 2 (and its looped variant): block attention residuals, softcapped SwiGLU experts, softcapped logits.
    Weight names are those of the published checkpoints (``model.llm.*``)."""
    n, d = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    sliding = layer_is_sliding(cfg)
    block = int(cfg.get("n_layers_per_attn_res_block") or 6)
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"scoring_func {cfg.get('scoring_func')!r} is not supported (Inkling 2 routes with sigmoid)")
    loop = cfg["model_type"] == "inkling2_loop_text"
    start, end, passes = 0, 0, 1
    if loop:
        start, end = int(cfg["loop_layer_index_start"]), int(cfg["loop_layer_index_end"])
        passes = int(cfg["loop_num_passes"])
        if not (0 < start <= end <= n and start % block == 0 and end % block == 0 and passes >= 1):
            raise ValueError(f"loop layers {start}..{end} must lie in 1..{n} on multiples of {block}, passes >= 1")
    moe = MoESpec(
        num_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["moe_intermediate_size"]),
        router=RouterSpec(scoring="sigmoid", norm_topk=True, norm_eps=1e-20, correction_bias=True,
                          scaling=float(cfg.get("route_scale", 1.0))),
        activation="softcap_swiglu",
        softcaps=(float(cfg.get("mlp_gate_softcap", 4.0)), float(cfg.get("mlp_up_softcap", 25.0))),
    )
    layers = [
        LayerSpec(attention=relpos_attention_spec(cfg, sliding[i], "inkling2"), moe=moe,
                  extras=_inkling2_extras(cfg, sliding[i], loop and start <= i < end))
        for i in range(n)
    ]
    # every later pass over the loop layers is a visit of its own (KV and conv states), sharing the layer's weights
    visits = [replace(layers[j], prefix=f"{ROOT}.layers.{j}") for _ in range(passes - 1) for j in range(start, end)]
    extras: list[tuple[str, tuple[int, ...]]] = [(FINAL_QUERY, (d,))]
    extras += [(attn_query(i), (d,) if sliding[i] else (3, d)) for i in range(1, n)]
    extras += [(mlp_query(i), (d,)) for i in range(n)]
    if loop:  # the checkpoint holds the message queries even for a single pass
        extras += [(name, (2 * (end - start), d)) for name in MESSAGE_QUERIES]
    return ModelSpec(
        model_type=cfg["model_type"], vocab_size=int(cfg["vocab_size"]), hidden_size=d,
        layers=tuple(layers + visits), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0), lm_head_rows=lm_head_rows(cfg),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        attn_residual=AttnResidualSpec(block_layers=block, weight_layers=n, loop_start=start, loop_end=end,
                                       loop_passes=passes, loop_gate_rank=int(cfg.get("loop_gate_rank") or 0)),
        extras=tuple(ExtraTensor(name, shape) for name, shape in extras),
        names=WeightNames(
            embed=f"{ROOT}.embed", embed_norm=f"{ROOT}.embed_norm", final_norm=f"{ROOT}.norm",
            lm_head=f"{ROOT}.unembed", layers=f"{ROOT}.layers", attn="attn", attn_in_norm=None, ffn_in_norm=None,
            correction_bias="gate.bias", gate_up_layout="interleaved",
            fused_names=("experts.w13_weight", "experts.w2_weight"),
        ),
        bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
        eos_token_ids=eos_ids(cfg),
    )
