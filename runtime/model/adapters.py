"""One small adapter per architecture family: Hugging Face ``config.json`` → ``ModelSpec``.

This is the only place that knows config field names and architecture quirks. Adding an architecture means adding
an adapter here (and a parity test), never a model file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from freetoken_agent.runtime.errors import ConfigError, UnsupportedArchitectureError
from freetoken_agent.runtime.model.activations import canonical
from freetoken_agent.runtime.model.validate import validate_config
from freetoken_agent.runtime.model.spec import (
    AttentionSpec,
    LayerSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    RopeSpec,
    RouterSpec,
    WeightNames,
)

Config = dict[str, Any]
ADAPTERS: dict[str, Callable[[Config], ModelSpec]] = {}


def adapter(*model_types: str) -> Callable[[Callable[[Config], ModelSpec]], Callable[[Config], ModelSpec]]:
    def register(fn: Callable[[Config], ModelSpec]) -> Callable[[Config], ModelSpec]:
        for name in model_types:
            ADAPTERS[name] = fn
        return fn

    return register


def supported_architectures() -> list[str]:
    return sorted(ADAPTERS)


WRAPPERS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "llama4": ("llama4_text", "language_model.model", "language_model.lm_head",
               (r"^vision_model\.", r"^multi_modal_projector\.")),
    "qwen3_5_moe": ("qwen3_5_moe_text", "model.language_model", "lm_head", (r"^model\.visual\.", r"^mtp\.")),
}
"""Multimodal checkpoints whose text model we run: wrapper type → (text model type, prefix of the text model's
tensors in place of ``model``, the lm_head's name, tensors of the other towers to leave unread)."""


def spec_from_config(config: Config) -> ModelSpec:
    """Build the spec for a parsed ``config.json``; unknown model types list the supported ones.

    The config is validated first (``runtime/model/validate.py``): a bad value is one ``ConfigError`` naming it.
    A multimodal wrapper (``WRAPPERS``) gives the spec of its language model.
    """
    if (isinstance(config, dict) and isinstance(config.get("model_type"), str) and config["model_type"] in WRAPPERS
            and isinstance(config.get("text_config"), dict)):
        return _text_model_spec(config)
    validate_config(config)
    model_type = config.get("model_type")
    if model_type not in ADAPTERS:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(supported_architectures())}"
        )
    try:
        return ADAPTERS[model_type](config)
    except KeyError as exc:
        raise ConfigError(f"config.json of {model_type!r} is missing the field {exc.args[0]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise ConfigError(f"config.json of {model_type!r} is missing or has an invalid field: {exc!r}") from None


def _text_model_spec(config: Config) -> ModelSpec:
    """The spec of a multimodal checkpoint's language model: its ``text_config`` (with the top-level
    ``tie_word_embeddings`` when it sets none), tensor names moved under the wrapper's prefix."""
    text_type, prefix, head, others = WRAPPERS[config["model_type"]]
    text = {k: config[k] for k in ("tie_word_embeddings",) if k in config}
    text.update(config["text_config"])
    text.setdefault("model_type", text_type)
    spec = spec_from_config(text)

    def move(name: str | None) -> str | None:
        return None if name is None else re.sub(r"^model\.", f"{prefix}.", name)

    names = spec.names
    names = replace(names, embed=move(names.embed), layers=move(names.layers), final_norm=move(names.final_norm),
                    lm_head=head if names.lm_head == "lm_head" else names.lm_head)
    layers = tuple(replace(layer, prefix=move(layer.prefix)) if layer.prefix else layer for layer in spec.layers)
    ignored = tuple(p.replace(r"^model\.", "^" + re.escape(prefix) + r"\.") for p in spec.ignored_tensors)
    return replace(spec, names=names, layers=layers, ignored_tensors=(*ignored, *others))


# ----------------------------------------------------------------------------------------------- shared helpers


def required_field(cfg: Config, *names: str) -> Any:
    """First present, non-null field among ``names`` (configs rename fields across versions)."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    raise KeyError(names[0])


def optional_field(cfg: Config, *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


WHOLE_HEAD_ROPE = frozenset({
    "afmoe", "aria_text", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "dbrx", "deepseek_v2",
    "deepseek_v3", "deepseek_v32", "doge", "dots1", "ergo", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint",
    "gemma4_text",
    "glm_moe_dsa",
    "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3",
    "hy_v4", "jetmoe", "kolibri1", "kolibri1_1", "lara_mini", "lfm2_moe", "llama4_text", "longcat_flash",
    "minicpm5_moe", "minimax",
    "mistral4",
    "mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_moe", "sarvam_mla",
})
"""Types whose transformers rotary computes its frequencies over the whole head (or MLA's rope dim) and never reads
``partial_rotary_factor``: a factor in their config is ignored here too (found by the option fuzzer)."""


def rope_params(cfg: Config, layer_type: str | None = None) -> dict[str, Any]:
    """Normalize ``rope_parameters`` (transformers ≥5) and ``rope_scaling``/``rope_theta`` (older configs).

    Configs with one rope per layer type (``{"full_attention": {...}, "sliding_attention": {...}}``) are resolved
    for ``layer_type`` (the first type when None).
    """
    params = dict(cfg.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) or v is None for v in params.values()):
        params = dict((params.get(layer_type) if layer_type else next(iter(params.values()))) or {})
    legacy = cfg.get("rope_scaling") or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    if "partial_rotary_factor" not in params and cfg.get("partial_rotary_factor") is not None:
        params["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    if cfg.get("model_type") in WHOLE_HEAD_ROPE and params["rope_type"] != "proportional":
        params.pop("partial_rotary_factor", None)  # (proportional rope reads it in its own frequency init)
    return params


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
"""The rope types of transformers' ``ROPE_INIT_FUNCTIONS`` (plus ``default``); Hunyuan's ``ntk_alpha`` is derived by
its adapter from ``dynamic`` with an ``alpha``."""


def rope_spec(cfg: Config, head_dim: int, style: str = "half", rotary_dim: int | None = None,
          layer_type: str | None = None) -> RopeSpec:
    p = rope_params(cfg, layer_type)
    kind = p["rope_type"]
    if kind not in ROPE_TYPES:
        raise ConfigError(f"config.json: rope type {kind!r} (rope_parameters / rope_scaling) is not supported; "
                          f"supported: {', '.join(ROPE_TYPES)}")
    proportion = float(p.get("partial_rotary_factor", 1.0))
    dim = rotary_dim if rotary_dim is not None else int(head_dim * proportion)
    if kind == "proportional":  # the whole head turns; frequencies past the proportion are zero
        dim = head_dim
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    factor = p.get("factor")
    original = p.get("original_max_position_embeddings")
    if kind in ("llama3", "yarn", "longrope"):  # transformers: a top-level value wins (Phi-3 style configs)
        original = cfg.get("original_max_position_embeddings") or original or max_pos
    if kind in ("yarn", "longrope") and factor is None:
        factor = max_pos / original
    short, long = p.get("short_factor"), p.get("long_factor")
    return RopeSpec(
        dim=dim,
        theta=float(p["rope_theta"]),
        kind=kind,
        style=style,  # type: ignore[arg-type]
        factor=float(factor if factor is not None else 1.0),
        original_max_position=original,
        max_position=max_pos,
        beta_fast=float(p.get("beta_fast") or 32.0),
        beta_slow=float(p.get("beta_slow") or 1.0),
        mscale=p.get("mscale"),
        mscale_all_dim=p.get("mscale_all_dim"),
        attention_factor=p.get("attention_factor"),
        truncate=bool(p.get("truncate", True)),
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
        short_factor=tuple(float(f) for f in short) if short is not None else None,
        long_factor=tuple(float(f) for f in long) if long is not None else None,
        alpha=float(p["alpha"]) if p.get("alpha") is not None else None,
        proportion=proportion,
    )


def _head_dim(cfg: Config) -> int:
    return int(optional_field(cfg, "head_dim", default=cfg["hidden_size"] // cfg["num_attention_heads"]))


def gqa_spec(cfg: Config, style: str = "half", layer_type: str | None = None, **overrides: Any) -> AttentionSpec:
    head_dim = _head_dim(cfg)
    fields: dict[str, Any] = dict(
        kind="gqa",
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(optional_field(cfg, "num_key_value_heads", default=cfg["num_attention_heads"])),
        head_dim=head_dim,
        v_head_dim=head_dim,
        scale=head_dim**-0.5,
        rope=rope_spec(cfg, head_dim, style, layer_type=layer_type),
    )
    fields.update(overrides)
    return AttentionSpec(**fields)


def sliding_layers(cfg: Config, default_sliding: Callable[[int], bool] | None = None) -> list[bool]:
    """Per layer: does it use sliding-window attention."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types:
        return [t == "sliding_attention" for t in types]
    return [bool(default_sliding and default_sliding(i)) for i in range(n)]


def eos_ids(cfg: Config) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def model_spec(cfg: Config, layers: list[LayerSpec], **fields: Any) -> ModelSpec:
    base: dict[str, Any] = dict(
        model_type=cfg["model_type"],
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        layers=tuple(layers),
        norm_eps=float(optional_field(cfg, "rms_norm_eps", "layer_norm_eps", default=1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
        eos_token_ids=eos_ids(cfg),
    )
    # dynamic NTK and linear scaling stretch max_position_embeddings (the trained context) by their factor; with one
    # rope per layer type (some of them null), the largest stretch over the types
    params = cfg.get("rope_parameters") or {}
    per_type = bool(params) and all(isinstance(v, dict) or v is None for v in params.values())
    stretch = 1.0
    for layer_type in [k for k, v in params.items() if v] if per_type else [None]:
        rope = rope_params(cfg, layer_type)
        if rope.get("rope_type") in ("dynamic", "linear"):
            stretch = max(stretch, float(rope.get("factor") or 1.0))
    if stretch > 1:
        base["max_position"] = int(base["max_position"] * stretch)
    base.update(fields)
    return ModelSpec(**base)


def mtp_ignored(cfg: Config) -> tuple[str, ...]:
    """Multi-token-prediction layers are stored after the last decoder layer; generation does not use them."""
    n = int(cfg["num_hidden_layers"])
    extra = int(cfg.get("num_nextn_predict_layers") or 0)
    return tuple(rf"^model\.layers\.{n + k}\." for k in range(extra))


def activation_name(cfg: Config, field: str = "hidden_act") -> str:
    """The canonical activation name of ``field`` (silu when absent); a ``ConfigError`` for unknown names."""
    return canonical(cfg.get(field) or "silu", field)


# ----------------------------------------------------------------------------------------------- softmax routers


@adapter("mixtral")
def mixtral(cfg: Config) -> ModelSpec:
    sw = cfg.get("sliding_window")
    moe = MoESpec(
        num_experts=int(required_field(cfg, "num_local_experts", "num_experts")),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["intermediate_size"]),
        router=RouterSpec(scoring="softmax", norm_topk=True),
        activation=activation_name(cfg),  # type: ignore[arg-type]
    )
    attn = gqa_spec(cfg, sliding_window=sw)
    layers = [LayerSpec(attention=attn, moe=moe) for _ in range(cfg["num_hidden_layers"])]
    return model_spec(cfg, layers, names=WeightNames(moe_prefix="block_sparse_moe"))


@adapter("qwen2_moe", "qwen3_moe")
def qwen_moe(cfg: Config) -> ModelSpec:
    qwen3 = cfg["model_type"] == "qwen3_moe"
    n = int(cfg["num_hidden_layers"])
    num_experts = int(required_field(cfg, "num_experts", "num_local_experts"))
    shared_size = int(cfg.get("shared_expert_intermediate_size") or 0)
    moe = MoESpec(
        num_experts=num_experts,
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["moe_intermediate_size"]),
        router=RouterSpec(scoring="softmax", norm_topk=bool(cfg.get("norm_topk_prob", False))),
        activation=activation_name(cfg),  # type: ignore[arg-type]
        shared=MLPSpec(shared_size, activation_name(cfg)) if shared_size else None,  # type: ignore[arg-type]
        shared_gate=bool(shared_size),
    )
    dense = MLPSpec(int(cfg["intermediate_size"]), activation_name(cfg))  # type: ignore[arg-type]
    step, mlp_only = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
    use_sw = bool(cfg.get("use_sliding_window", False))
    if qwen3:
        sliding = [use_sw and cfg.get("sliding_window") is not None] * n
    else:
        max_window = int(cfg.get("max_window_layers", n))
        sliding = sliding_layers(cfg, lambda i: use_sw and bool((i + 1) % 2) and i < max_window)
    layers = []
    for i in range(n):
        attn = gqa_spec(
            cfg,
            qkv_bias=bool(cfg.get("attention_bias", False)) if qwen3 else bool(cfg.get("qkv_bias", True)),
            o_bias=bool(cfg.get("attention_bias", False)) if qwen3 else False,
            qk_norm="head" if qwen3 else "none",
            sliding_window=cfg.get("sliding_window") if sliding[i] else None,
        )
        is_moe = i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
        layers.append(LayerSpec(attention=attn, moe=moe) if is_moe else LayerSpec(attention=attn, mlp=dense))
    return model_spec(cfg, layers, names=WeightNames(shared="shared_expert"))


@adapter("olmoe")
def olmoe(cfg: Config) -> ModelSpec:
    moe = MoESpec(
        num_experts=int(cfg["num_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["intermediate_size"]),
        router=RouterSpec(scoring="softmax", norm_topk=bool(cfg.get("norm_topk_prob", False))),
        activation=activation_name(cfg),  # type: ignore[arg-type]
    )
    attn = gqa_spec(cfg, qkv_bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)),
                qk_norm="full", clip_qkv=cfg.get("clip_qkv"))
    return model_spec(cfg, [LayerSpec(attention=attn, moe=moe) for _ in range(cfg["num_hidden_layers"])])


@adapter("granitemoe")
def granitemoe(cfg: Config) -> ModelSpec:
    moe = MoESpec(
        num_experts=int(cfg["num_local_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["intermediate_size"]),
        router=RouterSpec(scoring="none", topk_before_scoring=True),
        activation=activation_name(cfg),  # type: ignore[arg-type]
    )
    attn = gqa_spec(cfg, qkv_bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)),
                scale=float(cfg.get("attention_multiplier", 1.0)))
    names = WeightNames(moe_prefix="block_sparse_moe", router="router.layer",
                        fused_names=("input_linear.weight", "output_linear.weight"))
    return model_spec(
        cfg,
        [LayerSpec(attention=attn, moe=moe) for _ in range(cfg["num_hidden_layers"])],
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_divisor=float(cfg.get("logits_scaling", 1.0)),
        names=names,
    )


@adapter("gpt_oss")
def gpt_oss(cfg: Config) -> ModelSpec:
    moe = MoESpec(
        num_experts=int(cfg["num_local_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["intermediate_size"]),
        router=RouterSpec(scoring="none", topk_before_scoring=True, bias=True),
        activation="swiglu_oai",
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        expert_bias=True,
    )
    sliding = sliding_layers(cfg, lambda i: i % 2 == 0)
    bias = bool(cfg.get("attention_bias", True))
    layers = [
        LayerSpec(attention=gqa_spec(cfg, qkv_bias=bias, o_bias=bias, sinks=True,
                                 sliding_window=cfg.get("sliding_window") if sliding[i] else None), moe=moe)
        for i in range(cfg["num_hidden_layers"])
    ]
    names = WeightNames(router="router", gate_up_layout="interleaved_transposed")
    return model_spec(cfg, layers, names=names)


@adapter("ernie4_5_moe")
def ernie4_5_moe(cfg: Config) -> ModelSpec:
    n = int(cfg["num_hidden_layers"])
    bias = bool(cfg.get("use_bias", False))
    shared_n = int(cfg.get("moe_num_shared_experts") or 0)
    inter = int(cfg["moe_intermediate_size"])
    moe = MoESpec(
        num_experts=int(required_field(cfg, "moe_num_experts", "num_experts")),
        top_k=int(required_field(cfg, "moe_k", "num_experts_per_tok")),
        intermediate=inter,
        router=RouterSpec(scoring="softmax", norm_topk=True, norm_min=float(cfg.get("moe_norm_min", 1e-12)),
                          correction_bias=True),
        activation=activation_name(cfg),  # type: ignore[arg-type]
        shared=(MLPSpec(inter * shared_n, activation_name(cfg), bias=bias)  # type: ignore[arg-type]
                if shared_n else None),
    )
    dense = MLPSpec(int(cfg["intermediate_size"]), activation_name(cfg), bias=bias)  # type: ignore[arg-type]
    interval = int(cfg.get("moe_layer_interval", 1))
    start, end = int(cfg.get("moe_layer_start_index", 0)), cfg.get("moe_layer_end_index")
    end = n - 1 if end is None or end == -1 else int(end)
    attn = gqa_spec(cfg, style="interleaved", qkv_bias=bias, o_bias=bias)
    layers = [
        LayerSpec(attention=attn, moe=moe) if ((i + 1) % interval == 0 and start <= i <= end)
        else LayerSpec(attention=attn, mlp=dense)
        for i in range(n)
    ]
    names = WeightNames(correction_bias="moe_statics.e_score_correction_bias")
    return model_spec(cfg, layers, names=names, lm_head_bias=bias)


# ------------------------------------------------------------------------------- sigmoid routers / DeepSeek family


def _deepseek_router(cfg: Config, sigmoid: bool) -> RouterSpec:
    n_group = int(cfg.get("n_group") or 1)
    topk_group = int(cfg.get("topk_group") or 1)
    if sigmoid:
        return RouterSpec(
            scoring="sigmoid", norm_topk=bool(cfg.get("norm_topk_prob", True)), norm_eps=1e-20, correction_bias=True,
            n_group=n_group, topk_group=topk_group, group_score="top2_sum", group_masked_value=float("-inf"),
            scaling=float(cfg.get("routed_scaling_factor", 1.0)),
        )
    grouped = cfg.get("topk_method", "greedy") == "group_limited_greedy"
    return RouterSpec(
        scoring="softmax", n_group=n_group if grouped else 1, topk_group=topk_group if grouped else 1,
        group_score="max", group_masked_value=0.0, scaling=float(cfg.get("routed_scaling_factor", 1.0)),
    )


def _deepseek_layers(cfg: Config, attn_for: Callable[[int], AttentionSpec], sigmoid: bool) -> list[LayerSpec]:
    n = int(cfg["num_hidden_layers"])
    inter = int(cfg["moe_intermediate_size"])
    shared_n = int(cfg.get("n_shared_experts") or 0)
    bias = bool(cfg.get("mlp_bias", False))  # DeepSeek-V2's dense and shared MLPs (its experts have none)
    moe = MoESpec(
        num_experts=int(required_field(cfg, "n_routed_experts", "num_local_experts")),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate=inter,
        router=_deepseek_router(cfg, sigmoid),
        activation=activation_name(cfg),  # type: ignore[arg-type]
        shared=(MLPSpec(inter * shared_n, activation_name(cfg), bias=bias)  # type: ignore[arg-type]
                if shared_n else None),
    )
    dense = MLPSpec(int(cfg["intermediate_size"]), activation_name(cfg), bias=bias)  # type: ignore[arg-type]
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    return [
        LayerSpec(attention=attn_for(i), moe=moe) if (i >= first_dense and i % freq == 0)
        else LayerSpec(attention=attn_for(i), mlp=dense)
        for i in range(n)
    ]


def mla_spec(cfg: Config, **overrides: Any) -> AttentionSpec:
    nope, rope_dim = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    head_dim = nope + rope_dim
    interleave = cfg["model_type"] == "deepseek_v2" or bool(cfg.get("rope_interleave", True))
    rope = rope_spec(cfg, rope_dim, "interleaved" if interleave else "half", rotary_dim=rope_dim)
    scale = head_dim**-0.5
    p = rope_params(cfg)
    if p["rope_type"] != "default" and p.get("mscale_all_dim"):
        m = 0.1 * float(p["mscale_all_dim"]) * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
        scale *= m * m
    fields: dict[str, Any] = dict(
        kind="mla", num_heads=int(cfg["num_attention_heads"]), num_kv_heads=int(cfg["num_attention_heads"]),
        head_dim=head_dim, v_head_dim=int(cfg["v_head_dim"]), scale=scale, rope=rope,
        o_bias=bool(cfg.get("attention_bias", False)), q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_dim=nope, qk_rope_dim=rope_dim,
        lora_bias=bool(cfg.get("attention_bias", False)),
    )
    fields.update(overrides)
    return AttentionSpec(**fields)


@adapter("deepseek_v2", "deepseek_v3")
def deepseek(cfg: Config) -> ModelSpec:
    attn = mla_spec(cfg)
    layers = _deepseek_layers(cfg, lambda i: attn, sigmoid=cfg["model_type"] == "deepseek_v3")
    return model_spec(cfg, layers, ignored_tensors=mtp_ignored(cfg))


@adapter("glm4_moe")
def glm4_moe(cfg: Config, names: WeightNames | None = None) -> ModelSpec:
    bias = bool(cfg.get("attention_bias", False))
    attn = gqa_spec(cfg, qkv_bias=bias, qk_norm="head" if cfg.get("use_qk_norm") else "none")
    return model_spec(cfg, _deepseek_layers(cfg, lambda i: attn, sigmoid=True), names=names or WeightNames(),
                      ignored_tensors=mtp_ignored(cfg))


@adapter("minicpm5_moe")
def minicpm5_moe(cfg: Config) -> ModelSpec:
    """MiniCPM5-MoE: DeepSeek-V3's sigmoid group router, shared experts and scaled weights; GQA whose ``q_proj`` (as
    the files name it; ``q_gate_proj`` in transformers) holds per head [query | gate], the output gated by
    sigmoid(gate), rope over the whole head; ``mlp_layer_types`` says which layers are dense."""
    bias = bool(cfg.get("attention_bias", False))
    attn = gqa_spec(cfg, qkv_bias=bias, o_bias=bias, q_gate=True)
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("mlp_layer_types") or ["dense" if i < int(cfg.get("first_k_dense_replace", 1)) else "sparse"
                                            for i in range(n)]
    sparse = _deepseek_layers({**cfg, "first_k_dense_replace": 0, "moe_layer_freq": 1}, lambda i: attn, sigmoid=True)
    dense = MLPSpec(int(cfg["intermediate_size"]), activation_name(cfg))  # type: ignore[arg-type]
    layers = [ly if types[i] == "sparse" else LayerSpec(attention=attn, mlp=dense) for i, ly in enumerate(sparse)]
    return model_spec(cfg, layers, ignored_tensors=mtp_ignored(cfg))


@adapter("param2moe")
def param2moe(cfg: Config) -> ModelSpec:
    """Param2 (BharatGen): GLM-4-MoE's model (its config defaults the rope to the whole head) in checkpoints that
    keep their original tensor names, SarvamMoE's (fused ``query_key_value``, ``dense``, ``word_embeddings``)."""
    return glm4_moe(cfg, SARVAM_NAMES)


SARVAM_NAMES = WeightNames(correction_bias="gate.expert_bias", embed="model.word_embeddings", attn="attention",
                           fused_qkv="query_key_value", o_proj="dense", q_norm="query_layernorm",
                           k_norm="key_layernorm")
"""The original tensor names of SarvamMoE and Param2 checkpoints (transformers renames them on load)."""


@adapter("dots1")
def dots1(cfg: Config) -> ModelSpec:
    bias = bool(cfg.get("attention_bias", False))
    sliding = sliding_layers(cfg)
    layers = _deepseek_layers(
        cfg,
        lambda i: gqa_spec(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head",
                       sliding_window=cfg.get("sliding_window") if sliding[i] else None),
        sigmoid=True,
    )
    return model_spec(cfg, layers)


@adapter("minimax_m2")
def minimax_m2(cfg: Config) -> ModelSpec:
    head_dim = _head_dim(cfg)
    rotary_dim = cfg.get("rotary_dim") if "partial_rotary_factor" not in rope_params(cfg) else None
    moe = MoESpec(
        num_experts=int(cfg["num_local_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate=int(cfg["intermediate_size"]),
        router=RouterSpec(scoring="sigmoid", norm_topk=True, correction_bias=True),
        activation=activation_name(cfg),  # type: ignore[arg-type]
    )
    attn = gqa_spec(cfg, qk_norm="full", rope=rope_spec(cfg, head_dim, rotary_dim=rotary_dim))
    names = WeightNames(moe_prefix="block_sparse_moe", correction_bias="e_score_correction_bias")
    return model_spec(cfg, [LayerSpec(attention=attn, moe=moe) for _ in range(cfg["num_hidden_layers"])], names=names,
                  ignored_tensors=mtp_ignored(cfg))


# Further families register themselves on import (kept in separate files by family).
from freetoken_agent.runtime.model import families  # noqa: E402,F401
