"""One check of a parsed ``config.json`` before any adapter reads it: types, ranges and consistency.

``FIELDS`` is a declarative table of the fields the adapters read (grouped by meaning; names vary across families)
mapped to a ``runtime.rules.Rule``. Fields not in the table are not judged (configs carry many we never read), and a
field's absence is the adapter's business (a required one missing is a ``ConfigError`` there). ``CONSISTENCY`` holds
the checks across fields that every architecture needs (experts per token within the expert count, query heads a
multiple of key/value heads, ...). Every refusal is one ``ConfigError`` naming the field.

The rules accept every config transformers itself builds for the supported types (checked over all of them by
``tests/runtime/test_bad_input.py``); they refuse what would crash deep in the engine or, worse, run as garbage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from freetoken_agent.runtime.errors import ConfigError
from freetoken_agent.runtime.rules import Int, Num, Rule

Config = dict[str, Any]


def _all(rule: Rule, names: Iterable[str]) -> dict[str, Rule]:
    return {name: rule for name in names}


EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Names of the routed-expert count across families."""
TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_topk", "moe_k",
                "top_k_experts")
"""Names of the experts-per-token count across families."""
EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon",
              "rms_norm_eps_moe_gate")

FIELDS: dict[str, Rule] = {
    "model_type": Rule("str"),
    **_all(Int(1), ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings")),
    "num_attention_heads": Int(1, per_layer=True),
    **_all(Int(1, nullable=True, per_layer=True), (
        "num_key_value_heads", "head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank", "moe_intermediate_size",
        "attention_chunk_size", "rotary_dim")),
    "sliding_window": Int(0, nullable=True, per_layer=True),  # 0 with use_sliding_window off (qwen2_moe's default)
    **_all(Int(0, nullable=True, per_layer=True), (
        "intermediate_size", "qk_rope_head_dim", "qk_nope_head_dim", "shared_expert_intermediate_size",
        "shared_intermediate_size", "moe_shared_expert_intermediate_size", "shared_experts_intermediate_size")),
    # experts and routing
    **_all(Int(0, nullable=True, per_layer=True), EXPERT_COUNT_FIELDS),
    **_all(Int(1, nullable=True, per_layer=True), TOP_K_FIELDS),
    **_all(Int(0, nullable=True), ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts",
                                   "zero_expert_num", "first_k_dense_replace", "num_dense_layers",
                                   "num_nextn_predict_layers", "moe_layer_start_index", "expert_layer_offset",
                                   "attn_layer_offset", "max_window_layers")),
    **_all(Int(1, nullable=True), ("n_group", "num_expert_group", "topk_group", "decoder_sparse_step",
                                   "moe_layer_interval", "interleave_moe_layer_step", "expert_layer_period",
                                   "attn_layer_period", "full_attention_interval")),
    **_all(Num(nullable=True), ("routed_scaling_factor", "router_scaling_factor", "route_scale",
                                "moe_routed_scaling_factor", "embedding_multiplier", "residual_multiplier",
                                "attention_multiplier", "logit_scale", "swiglu_alpha")),
    **_all(Num(0, low_open=True, nullable=True), ("logits_scaling", "swiglu_limit", "final_logit_softcapping",
                                                  "attn_logit_softcapping", "clip_qkv")),
    "moe_router_logit_softcapping": Num(0, nullable=True),
    # norms and positions
    **_all(Num(0, low_open=True, nullable=True), EPS_FIELDS),
    "rope_theta": Num(0, low_open=True, nullable=True),
    "partial_rotary_factor": Num(0, 1, low_open=True, nullable=True),
    **_all(Rule("dict", nullable=True), ("rope_scaling", "rope_parameters", "text_config")),
    # special tokens: any integer (hub configs carry pad_token_id -1 and ids past the vocabulary; transformers only
    # warns, and such an id simply never matches)
    **_all(Int(nullable=True, per_layer=True), ("bos_token_id", "eos_token_id", "pad_token_id")),
    # switches and names
    **_all(Rule("bool", nullable=True), (
        "tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob", "use_qk_norm", "use_sliding_window",
        "qkv_bias", "use_bias", "moe_renormalize", "rope_interleave", "mup_enabled", "use_expert_bias",
        "lm_head_bias")),
    **_all(Rule("str", nullable=True), ("hidden_act", "mlp_hidden_act", "scoring_func", "topk_method", "dtype",
                                        "torch_dtype")),
    **_all(Rule("list", nullable=True, items=Rule("str")), ("layer_types", "mlp_layer_types")),
    **_all(Rule("list", nullable=True, items=Int(0)), ("mlp_only_layers", "moe_layers")),
}

ROPE_FIELDS: dict[str, Rule] = {
    "rope_type": Rule("str", nullable=True),
    "type": Rule("str", nullable=True),
    "rope_theta": Num(0, low_open=True, nullable=True),
    "factor": Num(0, low_open=True, nullable=True),
    "partial_rotary_factor": Num(0, 1, low_open=True, nullable=True),
    "original_max_position_embeddings": Int(1, nullable=True),
    **_all(Num(nullable=True), ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "low_freq_factor",
                                "high_freq_factor", "attention_factor", "alpha")),
}
"""Fields of ``rope_parameters`` / ``rope_scaling`` (one such object, or one per layer type)."""


def validate_config(cfg: Any, where: str = "config.json") -> None:
    """Raise one ``ConfigError`` naming the field for the first value of ``cfg`` that breaks a rule."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where} must hold a JSON object, got {type(cfg).__name__}")
    # published Hunyuan-A13B writes false for the group-routing options it does not use (transformers ignores them)
    cfg = {k: v for k, v in cfg.items() if not (v is False and k in ("n_group", "topk_group", "routed_scaling_factor"))}
    _check_fields(cfg, FIELDS, where)
    for key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(key)
        if isinstance(rope, dict):  # one object, or one per layer type ({"full_attention": {...}, ...})
            nested = [(f"{key}.{k}", v) for k, v in rope.items() if isinstance(v, dict)]
            for name, sub in nested or [(key, rope)]:
                _check_fields(sub, ROPE_FIELDS, where, prefix=f"{name}.")
    for check in CONSISTENCY:
        if (msg := check(cfg)) is not None:
            raise ConfigError(f"{where}: {msg}")
    if isinstance(cfg.get("text_config"), dict):
        validate_config(cfg["text_config"], f"{where} (text_config)")


def _check_fields(cfg: Config, fields: dict[str, Rule], where: str, prefix: str = "") -> None:
    for key, rule in fields.items():
        if key in cfg and (msg := rule.problem(cfg[key])) is not None:
            raise ConfigError(f"{where}: {prefix}{key} {msg}")


# ----------------------------------------------------------------------------------------------- consistency


def _first(cfg: Config, names: Iterable[str]) -> tuple[str, Any] | None:
    return next(((n, cfg[n]) for n in names if cfg.get(n) is not None), None)


def _most(value: Any) -> int:
    """A scalar or per-layer list of counts as its largest entry."""
    return max(value) if isinstance(value, list) else int(value)


def _top_k_within_experts(cfg: Config) -> str | None:
    count, top = _first(cfg, EXPERT_COUNT_FIELDS), _first(cfg, TOP_K_FIELDS)
    if count is None or top is None or _most(count[1]) == 0:
        return None
    # zero-computation experts (LongCat) are routed to like real ones
    routable = _most(count[1]) + int(cfg.get("zero_expert_num") or 0)
    if _most(top[1]) > routable:
        return (f"{top[0]} ({top[1]}) must not exceed the number of experts ({count[0]} = {count[1]}"
                + (f" + zero_expert_num = {routable}" if routable != _most(count[1]) else "") + ")")
    return None


def _heads_divide(cfg: Config) -> str | None:
    q, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if isinstance(q, int) and isinstance(kv, int) and q % kv:
        return (f"num_attention_heads ({q}) must be a multiple of num_key_value_heads ({kv}): each key/value head "
                "serves a whole group of query heads")
    return None


def _expert_groups(cfg: Config) -> str | None:
    groups, count = _first(cfg, ("n_group", "num_expert_group")), _first(cfg, EXPERT_COUNT_FIELDS)
    if groups is None or groups[1] <= 1:
        return None
    if count is not None and isinstance(count[1], int) and count[1] % groups[1]:
        return f"{count[0]} ({count[1]}) must be divisible by {groups[0]} ({groups[1]})"
    topk_group = cfg.get("topk_group")
    if isinstance(topk_group, int) and topk_group > groups[1]:
        return f"topk_group ({topk_group}) must not exceed {groups[0]} ({groups[1]})"
    return None


def _window_when_used(cfg: Config) -> str | None:
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is True and (window == 0 or (isinstance(window, list) and 0 in window)):
        return "use_sliding_window is true but sliding_window is 0: give the window size (≥ 1)"
    return None


def _layer_lists(cfg: Config) -> str | None:
    n = cfg.get("num_hidden_layers")
    for key in ("layer_types", "mlp_layer_types"):
        value = cfg.get(key)
        if isinstance(value, list) and isinstance(n, int) and len(value) != n:
            return f"{key} has {len(value)} entries but num_hidden_layers is {n}"
    return None


CONSISTENCY: list[Callable[[Config], str | None]] = [
    _top_k_within_experts, _heads_divide, _expert_groups, _window_when_used, _layer_lists,
]
"""Checks across fields; each returns None or what is wrong (naming the fields)."""
