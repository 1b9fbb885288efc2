"""Hybrid models: recurrent mixers (Gated DeltaNet, ...) interleaved with attention layers."""

from __future__ import annotations

from dataclasses import replace

import torch

from freetoken_agent.runtime.model.adapters import (
    Config,
    activation_name,
    gqa_spec,
    model_spec,
    mtp_ignored,
    optional_field,
    adapter,
)
from freetoken_agent.runtime.model.spec import (
    LayerSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    RecurrentSpec,
    RouterSpec,
    WeightNames,
)


def _deltanet(cfg: Config, layout: str, norm: str = "norm") -> RecurrentSpec:
    return RecurrentSpec(
        kind="gated_deltanet", num_k_heads=int(cfg["linear_num_key_heads"]),
        num_v_heads=int(cfg["linear_num_value_heads"]), head_k_dim=int(cfg["linear_key_head_dim"]),
        head_v_dim=int(cfg["linear_value_head_dim"]), conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        layout=layout, norm=norm, activation=activation_name(cfg),  # type: ignore[arg-type]
    )


@adapter("qwen3_next", "qwen3_5_moe_text")
def qwen3_next(cfg: Config) -> ModelSpec:
    cfg = {"partial_rotary_factor": 0.25, **cfg}  # transformers' default when the config names none
    n = int(cfg["num_hidden_layers"])
    act = activation_name(cfg)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    moe = MoESpec(
        num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["moe_intermediate_size"]),
        router=RouterSpec(scoring="softmax", norm_topk=bool(cfg.get("norm_topk_prob", True))),
        activation=act,  # type: ignore[arg-type]
        shared=MLPSpec(shared, act) if shared else None, shared_gate=bool(shared),  # type: ignore[arg-type]
    )
    dense = MLPSpec(int(cfg.get("intermediate_size") or cfg["moe_intermediate_size"]), act)  # type: ignore[arg-type]
    # published Qwen3-Next configs have no layer_types: every full_attention_interval-th layer is full attention
    interval = int(cfg.get("full_attention_interval") or 4)
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                       for i in range(n)]
    step, mlp_only = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
    bias = bool(cfg.get("attention_bias", False))
    attn = gqa_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head", q_gate=True)
    recurrent = _deltanet(cfg, "grouped" if cfg["model_type"] == "qwen3_next" else "split")
    layers = []
    for i in range(n):
        is_moe = i not in mlp_only and (i + 1) % step == 0
        layers.append(LayerSpec(attention=attn, recurrent=recurrent if types[i] == "linear_attention" else None,
                                moe=moe if is_moe else None, mlp=None if is_moe else dense))
    names = WeightNames(shared="shared_expert")
    return model_spec(cfg, layers, names=names, norm_weight_offset=1.0,
                  ignored_tensors=(r"^mtp\.",))


@adapter("lara_mini")
def lara_mini(cfg: Config) -> ModelSpec:
    n = int(cfg["num_hidden_layers"])
    act = activation_name(cfg)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    moe = MoESpec(
        num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["moe_intermediate_size"]),
        router=RouterSpec(scoring="softmax", norm_topk=bool(cfg.get("norm_topk_prob", True))),
        activation=act, shared=MLPSpec(shared, act) if shared else None,  # type: ignore[arg-type]
    )
    types = cfg.get("layer_types") or ["full_attention"] * n
    recurrent = _deltanet(cfg, "fused", norm="out_norm")
    bias = bool(cfg.get("attention_bias", False))
    layers = []
    for i in range(n):
        sliding = types[i] == "sliding_attention"  # only sliding layers use rotary positions
        attn = gqa_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head",
                    sliding_window=cfg.get("sliding_window") if sliding else None, **({} if sliding else {"rope": None}))
        layers.append(LayerSpec(attention=attn, moe=moe,
                                recurrent=recurrent if types[i] == "linear_attention" else None))
    return model_spec(cfg, layers, names=WeightNames(shared="shared_expert"))


@adapter("lfm2_moe")
def lfm2_moe(cfg: Config) -> ModelSpec:
    n = int(cfg["num_hidden_layers"])
    act = activation_name(cfg)
    w = ("w1", "w3", "w2")
    bias = bool(cfg.get("use_expert_bias", True))
    moe = MoESpec(
        num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["moe_intermediate_size"]),
        router=RouterSpec(scoring="sigmoid", norm_topk=bool(cfg.get("norm_topk_prob", True)), norm_eps=1e-6,
                          correction_bias=bias, scaling=float(cfg.get("routed_scaling_factor") or 1.0)),
        activation=act,  # type: ignore[arg-type]
    )
    dense = MLPSpec(int(cfg["intermediate_size"]), act, leaves=w)  # type: ignore[arg-type]
    types = cfg.get("layer_types") or ["full_attention"] * n
    conv = RecurrentSpec(kind="short_conv", num_k_heads=1, num_v_heads=1, head_k_dim=0, head_v_dim=0,
                         conv_kernel=int(cfg.get("conv_L_cache", 3)), conv_bias=bool(cfg.get("conv_bias", False)))
    attn = gqa_spec(cfg, qk_norm="head")
    first_dense = int(cfg.get("num_dense_layers") or 0)
    layers = [
        LayerSpec(attention=attn, recurrent=conv if types[i] == "conv" else None,
                  moe=moe if i >= first_dense else None, mlp=dense if i < first_dense else None)
        for i in range(n)
    ]
    names = WeightNames(moe_prefix="feed_forward", mlp="feed_forward", correction_bias="expert_bias",
                        attn_in_norm="operator_norm", ffn_in_norm="ffn_norm", q_norm="q_layernorm",
                        k_norm="k_layernorm", o_proj="out_proj", recurrent="conv", final_norm="model.embedding_norm")
    return model_spec(cfg, layers, names=names, norm_eps=float(cfg.get("norm_eps", 1e-5)))


def _float(value: object) -> float:
    """transformers writes non-finite floats as ``{"__float__": "Infinity"}``."""
    return float(value["__float__"] if isinstance(value, dict) else value)  # type: ignore[index,arg-type]


def _mamba2(cfg: Config, prefix: str = "mamba_") -> RecurrentSpec:
    """Mamba-2 spec from Granite-style (``mamba_*``) or Nemotron-style (unprefixed) config fields."""
    g = lambda *names: optional_field(cfg, *names)
    heads = int(g(f"{prefix}n_heads", "mamba_num_heads"))
    head_dim = int(g(f"{prefix}d_head", "mamba_head_dim"))
    groups = int(g(f"{prefix}n_groups", "n_groups"))
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    return RecurrentSpec(
        kind="mamba2", num_k_heads=groups, num_v_heads=heads, head_k_dim=int(g(f"{prefix}d_state", "ssm_state_size")),
        head_v_dim=head_dim, conv_kernel=int(g(f"{prefix}d_conv", "conv_kernel")),
        conv_bias=bool(g(f"{prefix}conv_bias", "use_conv_bias")), proj_bias=bool(g(f"{prefix}proj_bias", "use_bias")),
        norm_groups=groups, dt_limit=(_float(limit[0]), _float(limit[1])),
        activation=activation_name(cfg, "mamba_hidden_act" if "mamba_hidden_act" in cfg else "hidden_act"),
    )


@adapter("granitemoehybrid")
def granitemoehybrid(cfg: Config) -> ModelSpec:
    n = int(cfg["num_hidden_layers"])
    act = activation_name(cfg)
    shared = int(cfg.get("shared_intermediate_size") or 0)
    moe = MoESpec(
        num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["intermediate_size"]), router=RouterSpec(scoring="none", topk_before_scoring=True),
        activation=act, shared=MLPSpec(shared, act, fused=True) if shared else None,  # type: ignore[arg-type]
    )
    types = cfg.get("layer_types") or ["attention"] * n
    bias = bool(cfg.get("attention_bias", False))
    rope = cfg.get("position_embedding_type") == "rope"
    attn = gqa_spec(cfg, qkv_bias=bias, o_bias=bias, scale=float(cfg.get("attention_multiplier", 1.0)),
                **({} if rope else {"rope": None}))
    mamba = _mamba2(cfg)
    layers = [LayerSpec(attention=attn, moe=moe, recurrent=mamba if types[i] in ("mamba", "linear_attention") else None)
              for i in range(n)]
    names = WeightNames(moe_prefix="block_sparse_moe", router="router.layer", shared="shared_mlp",
                        shared_at_layer=True, fused_names=("input_linear.weight", "output_linear.weight"),
                        recurrent="mamba")
    return model_spec(
        cfg, layers, names=names,
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_divisor=float(cfg.get("logits_scaling", 1.0)),
    )


@adapter("nemotron_h")
def nemotron_h(cfg: Config) -> ModelSpec:
    """Nemotron-H: every block is one sub-layer (Mamba-2, attention, MoE or a plain relu² MLP) with its own norm."""
    act = activation_name({"mlp_hidden_act": "relu2", **cfg}, "mlp_hidden_act")
    mlp_bias = bool(cfg.get("mlp_bias"))
    # NemotronHMLP: a shared size of 0 (or none) falls back to intermediate_size
    shared = int(cfg.get("moe_shared_expert_intermediate_size") or cfg["intermediate_size"])
    from freetoken_agent.runtime.model.families.sigmoid import sigmoid_router

    moe = MoESpec(
        num_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["moe_intermediate_size"]), router=sigmoid_router(cfg), activation=act,  # type: ignore[arg-type]
        gated=False, shared=MLPSpec(shared, act, gated=False, bias=mlp_bias),  # type: ignore[arg-type]
        latent=int(cfg.get("moe_latent_size") or 0), latent_bias=mlp_bias,
    )
    dense = MLPSpec(int(cfg["intermediate_size"]), act, gated=False, bias=mlp_bias)  # type: ignore[arg-type]
    attn = gqa_spec(cfg, rope=None)  # transformers' NemotronH attention has no biases, whatever attention_bias says
    # its Mamba-2 projections take their bias from use_bias (mamba_proj_bias is not read)
    mamba = replace(_mamba2(cfg, prefix="mamba_"), proj_bias=bool(cfg.get("use_bias", False)))
    layers = []
    for kind in cfg.get("layers_block_type") or cfg["layer_types"]:
        if kind in ("linear_attention", "mamba", "M"):
            layers.append(LayerSpec(attention=attn, recurrent=mamba, parts="mixer"))
        elif kind in ("full_attention", "attention", "*"):
            layers.append(LayerSpec(attention=attn, parts="mixer"))
        elif kind in ("moe", "E"):
            layers.append(LayerSpec(attention=attn, moe=moe, parts="ffn"))
        else:
            layers.append(LayerSpec(attention=attn, mlp=dense, parts="ffn"))
    names = WeightNames(layers="backbone.layers", embed="backbone.embeddings", final_norm="backbone.norm_f",
                        attn="mixer", recurrent="mixer", moe_prefix="mixer", mlp="mixer", attn_in_norm="norm",
                        ffn_in_norm="norm", fused_names=("experts.up_proj", "experts.down_proj"))
    # transformers never ties this type's lm_head (no tied-weights keys): tie_word_embeddings changes nothing
    return model_spec(cfg, layers, names=names, norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
                      tie_embeddings=False,
                  ignored_tensors=(r"^mtp\.",))


@adapter("jamba")
def jamba(cfg: Config) -> ModelSpec:
    n = int(cfg["num_hidden_layers"])
    act = activation_name(cfg)
    moe = MoESpec(
        num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["intermediate_size"]), router=RouterSpec(scoring="softmax"), activation=act,  # type: ignore[arg-type]
    )
    dense = MLPSpec(int(cfg["intermediate_size"]), act)  # type: ignore[arg-type]
    inner = int(cfg.get("mamba_expand", 2)) * int(cfg["hidden_size"])
    rank = cfg.get("mamba_dt_rank") or "auto"
    rank = -(-int(cfg["hidden_size"]) // 16) if rank == "auto" else int(rank)
    mamba = RecurrentSpec(kind="mamba", num_k_heads=rank, num_v_heads=inner, head_k_dim=int(cfg["mamba_d_state"]),
                          head_v_dim=0, conv_kernel=int(cfg["mamba_d_conv"]), conv_bias=bool(cfg["mamba_conv_bias"]),
                          proj_bias=bool(cfg["mamba_proj_bias"]), inner_norms=True, activation=act)
    attn = gqa_spec(cfg, rope=None)
    a_period, a_offset = int(cfg["attn_layer_period"]), int(cfg["attn_layer_offset"])
    e_period, e_offset = int(cfg["expert_layer_period"]), int(cfg["expert_layer_offset"])
    layers = [
        LayerSpec(attention=attn, recurrent=None if i % a_period == a_offset else mamba,
                  moe=moe if i % e_period == e_offset else None, mlp=None if i % e_period == e_offset else dense)
        for i in range(n)
    ]
    names = WeightNames(moe_prefix="feed_forward", mlp="feed_forward", router="router", recurrent="mamba",
                        ffn_in_norm="pre_ff_layernorm", final_norm="model.final_layernorm")
    return model_spec(cfg, layers, names=names)


def _lightning_slopes(heads: int, layer: int, num_layers: int) -> tuple[float, ...]:
    """MiniMax-01's ALiBi-style decay per head, shrinking with depth."""
    base = 1 / (2 ** (8 / heads))
    factor = 1 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return tuple(float(torch.tensor(base, dtype=torch.float32) ** (h + 1) * factor) for h in range(heads))


@adapter("minimax")
def minimax(cfg: Config) -> ModelSpec:
    """MiniMax-01: lightning (linear) attention layers interleaved with softmax attention; normed residuals."""
    n = int(cfg["num_hidden_layers"])
    moe = MoESpec(
        num_experts=int(cfg["num_local_experts"]), top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["intermediate_size"]), router=RouterSpec(scoring="softmax", norm_topk=True),
        activation=activation_name(cfg),  # type: ignore[arg-type]
    )
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    types = cfg.get("layer_types") or ["full_attention"] * n
    attn = gqa_spec(cfg)
    f = lambda name: float(cfg.get(name, 1))
    layers = []
    for i in range(n):
        linear = types[i] == "linear_attention"
        kind = "linear_attn" if linear else "full_attn"
        mixer = RecurrentSpec(kind="lightning", num_k_heads=heads, num_v_heads=heads, head_k_dim=head_dim,
                              head_v_dim=head_dim, slopes=_lightning_slopes(heads, i, n),
                              activation=activation_name(cfg)) if linear else None
        scales = (f(f"{kind}_alpha_factor"), f(f"{kind}_beta_factor"), f("mlp_alpha_factor"), f("mlp_beta_factor"))
        layers.append(LayerSpec(attention=attn, moe=moe, recurrent=mixer, residual_scales=scales))
    names = WeightNames(moe_prefix="block_sparse_moe", recurrent="self_attn")
    return model_spec(cfg, layers, names=names, residual_from_norm=True,
                  ignored_tensors=(r"self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)$",))


def _kimi_linear_fields(cfg: Config) -> Config:
    """Published Kimi-Linear configs nest the KDA fields in ``linear_attn_config`` (1-based ``kda_layers`` /
    ``full_attn_layers``); transformers flattens them, with its defaults when they are absent."""
    if cfg["model_type"] != "kimi_linear":
        return cfg
    nested = cfg.get("linear_attn_config") or {}
    n = int(cfg["num_hidden_layers"])
    flat = {**cfg, "linear_num_heads": nested.get("num_heads", cfg.get("linear_num_heads", 32)),
            "linear_head_dim": nested.get("head_dim", cfg.get("linear_head_dim", 128)),
            "linear_conv_kernel_dim": nested.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4))}
    if not cfg.get("layer_types"):
        if "full_attn_layers" in nested and "kda_layers" in nested:
            types: list[str | None] = [None] * n
            for i in nested["full_attn_layers"]:
                types[int(i) - 1] = "full_attention"
            for i in nested["kda_layers"]:
                types[int(i) - 1] = "linear_attention"
            flat["layer_types"] = types
        else:
            flat["layer_types"] = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if not cfg.get("mlp_layer_types"):
        first_dense = int(cfg.get("first_k_dense_replace", 1))
        flat["mlp_layer_types"] = ["dense" if i < first_dense else "sparse" for i in range(n)]
    return flat


@adapter("kimi_linear", "bailing_hybrid")
def kimi_linear(cfg: Config) -> ModelSpec:
    """Kimi Linear / Bailing (Ling) hybrid: Kimi Delta Attention layers plus MLA layers, DeepSeek-V3 style MoE.

    Kimi: low-rank gates, NoPE MLA. Bailing: full-rank gates with a bounded "safe" decay, rotary MLA whose output
    is gated per head, Bailing tensor names."""
    from freetoken_agent.runtime.model.adapters import mla_spec
    from freetoken_agent.runtime.model.families.sigmoid import moe_layers, sigmoid_router

    cfg = _kimi_linear_fields(cfg)
    n = int(cfg["num_hidden_layers"])
    bailing = cfg["model_type"] == "bailing_hybrid"
    types = cfg.get("layer_types") or ["full_attention"] * n
    kda = RecurrentSpec(kind="kda", num_k_heads=int(cfg["linear_num_heads"]), num_v_heads=int(cfg["linear_num_heads"]),
                        head_k_dim=int(cfg["linear_head_dim"]), head_v_dim=int(cfg["linear_head_dim"]),
                        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)), gate_lowrank=not bailing,
                        safe_gate_bound=float(cfg["kda_lower_bound"]) if bailing and cfg.get("kda_safe_gate") else None,
                        out_proj="dense" if bailing else "o_proj", activation=activation_name(cfg))
    attn = mla_spec(cfg, output_gate="sigmoid", output_gate_per_head=True) if bailing else mla_spec(cfg, rope=None)
    layers = [
        LayerSpec(attention=spec.attention, mlp=spec.mlp, moe=spec.moe,
                  recurrent=kda if types[i] == "linear_attention" else None)
        for i, spec in enumerate(moe_layers(cfg, lambda i: attn, sigmoid_router(cfg)))
    ]
    if bailing:
        names = WeightNames(embed="model.word_embeddings", attn="attention", recurrent="attention", o_proj="dense",
                            output_gate="g_proj", correction_bias="gate.expert_bias")
    else:
        names = WeightNames(moe_prefix="block_sparse_moe", mlp="block_sparse_moe", recurrent="self_attn")
    return model_spec(cfg, layers, names=names, max_position=int(cfg.get("model_max_length") or 4096),
                  ignored_tensors=mtp_ignored(cfg), tie_embeddings=False)  # transformers never ties these heads
