"""DeepSeek-V4: shared-KV attention over a sliding window plus compressed KV (HCA: pooled windows; CSA: overlapping
pooled windows chosen by a lightning indexer), hash-routed MoE bootstrap layers, sqrt-softplus router scores,
clamped GLU experts and manifold-constrained hyper-connections.

Config resolution follows transformers' ``DeepseekV4Config.__post_init__``, legacy keys included (``compress_ratios``,
``compress_rate_csa`` / ``compress_rate_hca``, ``num_hash_layers``, ``qk_rope_head_dim``, a flat ``rope_parameters``
that becomes the compressed layers' rope).
"""

from __future__ import annotations

from typing import Any

from freetoken_agent.runtime.model.activations import canonical
from freetoken_agent.runtime.model.adapters import Config, model_spec, rope_spec, adapter
from freetoken_agent.runtime.model.spec import (
    AttentionSpec,
    CompressorSpec,
    IndexerSpec,
    LayerSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    RopeSpec,
    RouterSpec,
    WeightNames,
)

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_SCORINGS = ("sqrtsoftplus", "sigmoid")


def sliding_layers(cfg: Config, n: int) -> list[str]:
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        types = [_RATIO_TO_TYPE[int(r)] for r in cfg["compress_ratios"]]
    if types is None:  # transformers' default: two HCA layers, then CSA / HCA alternating
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = list(types[:n])
    bad = [t for t in types if t not in (SLIDING, CSA, HCA)]
    if len(types) != n or bad:
        raise ValueError(f"layer_types must name {n} layers among {SLIDING}, {CSA}, {HCA}; got {types}")
    return types


def _mlp_types(cfg: Config, n: int) -> list[str]:
    types = cfg.get("mlp_layer_types")
    if types is None:
        hashed = int(cfg["num_hash_layers"]) if cfg.get("num_hash_layers") is not None else 3
        types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    types = list(types[:n])
    if len(types) != n or any(t not in ("hash_moe", "moe") for t in types):
        raise ValueError(f"mlp_layer_types must name {n} layers among hash_moe, moe; got {types}")
    return types


def _ropes(cfg: Config, head_dim: int) -> tuple[dict[str, RopeSpec], int]:
    """The sliding layers' ("main") and compressed layers' ("compress") ropes, and the rotated channel count."""
    factor = cfg.get("partial_rotary_factor")
    if factor is None:
        rope_dim = cfg.get("qk_rope_head_dim")
        factor = float(rope_dim) / head_dim if rope_dim is not None else 64 / 512
    rope_dim = int(head_dim * float(factor))
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        raise ValueError(f"the rotary part of each head must be an even count within head_dim, got {rope_dim}")
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})  # rope_scaling: older configs
    if not (isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict)):
        flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
        compress = {**flat, "rope_theta": cfg.get("compress_rope_theta", 160000.0), "partial_rotary_factor": factor}
        compress.setdefault("rope_type", compress.pop("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)  # the reference does not scale cos/sin on compressed layers
        main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0), "partial_rotary_factor": factor}
        params = {"main": main, "compress": compress}
    nested = {**cfg, "rope_parameters": params, "rope_scaling": None}
    ropes = {}
    for kind in ("main", "compress"):
        if (params[kind].get("rope_type") or params[kind].get("type")) == "proportional":
            # transformers builds it over the whole head (frequencies past the proportion are 0) and rotates
            # the trailing head_dim channels: all of them
            ropes[kind] = rope_spec(nested, head_dim, "interleaved", layer_type=kind)
        else:
            ropes[kind] = rope_spec(nested, rope_dim, "interleaved", rotary_dim=rope_dim, layer_type=kind)
    return ropes, rope_dim


def _moe(cfg: Config, hashed: bool) -> MoESpec:
    scoring = cfg.get("scoring_func", "sqrtsoftplus")
    if scoring not in _SCORINGS:
        raise ValueError(f"scoring_func {scoring!r} is not supported for deepseek_v4; supported: {_SCORINGS}")
    act = canonical(cfg.get("hidden_act", "silu"))
    limit, inter = float(cfg.get("swiglu_limit", 10.0)), int(cfg["moe_intermediate_size"])
    router = RouterSpec(scoring=scoring, norm_topk=True, norm_eps=1e-20, correction_bias=not hashed,
                        scaling=float(cfg.get("routed_scaling_factor", 1.5)), hash_table=hashed)
    # one shared expert of the routed width whatever n_shared_experts says (transformers' DeepseekV4MLP)
    shared = MLPSpec(inter, act, bias=bool(cfg.get("mlp_bias", False)), swiglu_limit=limit,  # type: ignore[arg-type]
                     glu_clamp=True, leaves=("w1", "w3", "w2"))
    return MoESpec(num_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                   intermediate=inter, router=router, activation=act, swiglu_limit=limit,  # type: ignore[arg-type]
                   glu_clamp=True, shared=shared)


def _attention(cfg: Config, kind: str, rope: RopeSpec, rope_dim: int) -> AttentionSpec:
    heads, head_dim, groups = int(cfg["num_attention_heads"]), int(cfg["head_dim"]), int(cfg.get("o_groups", 8))
    if (heads * head_dim) % groups:
        raise ValueError(f"o_groups ({groups}) must divide num_attention_heads * head_dim ({heads * head_dim})")
    rates = {CSA: 4, HCA: 128, **(cfg.get("compress_rates") or {})}
    for key, layer_type in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if cfg.get(key) is not None:
            rates[layer_type] = cfg[key]
    compressor = None
    if kind == HCA:
        compressor = CompressorSpec(rate=int(rates[HCA]))
    elif kind == CSA:
        indexer = IndexerSpec(num_heads=int(cfg.get("index_n_heads", 64)), head_dim=int(cfg.get("index_head_dim", 128)),
                              topk=int(cfg.get("index_topk", 512)), rope_dim=rope_dim, rope_style="interleaved",
                              rope_last=True)
        if indexer.head_dim < rope_dim:
            raise ValueError(f"index_head_dim ({indexer.head_dim}) is smaller than the rotary part ({rope_dim})")
        compressor = CompressorSpec(rate=int(rates[CSA]), overlap=True, indexer=indexer)
    if compressor is not None and compressor.rate < 1:
        raise ValueError(f"compress rate of {kind} must be >= 1, got {compressor.rate}")
    return AttentionSpec(
        kind="shared_kv", num_heads=heads, num_kv_heads=1, head_dim=head_dim, v_head_dim=head_dim,
        scale=head_dim**-0.5, rope=rope, sinks=True, sliding_window=int(cfg.get("sliding_window", 128)),
        q_lora_rank=int(cfg["q_lora_rank"]), compressor=compressor, o_groups=groups,
        o_group_rank=int(cfg.get("o_lora_rank", 1024)),
    )


@adapter("deepseek_v4")
def deepseek_v4(cfg: Config) -> ModelSpec:
    cfg = {**cfg, "max_position_embeddings": cfg.get("max_position_embeddings") or 1_048_576}  # transformers' default
    n = int(cfg["num_hidden_layers"])
    ropes, rope_dim = _ropes(cfg, int(cfg["head_dim"]))
    types, mlp_types = sliding_layers(cfg, n), _mlp_types(cfg, n)
    attn = {kind: _attention(cfg, kind, ropes["main" if kind == SLIDING else "compress"], rope_dim)
            for kind in set(types)}
    moes = {t: _moe(cfg, t == "hash_moe") for t in set(mlp_types)}
    layers = [LayerSpec(attention=attn[a], moe=moes[m]) for a, m in zip(types, mlp_types)]
    fields: dict[str, Any] = dict(
        hyper_streams=int(cfg.get("hc_mult", 4)), hyper_magnitude=2.0, hyper_eps=float(cfg.get("hc_eps", 1e-6)),
        hyper_sinkhorn_iters=max(int(cfg.get("hc_sinkhorn_iters", 20)), 1),  # 0 and 1 both normalize once
        ignored_tensors=(r"(^|\.)mtp\.",),
        # transformers writes V4 checkpoints with the reference's names (its conversion mapping, reversed)
        names=WeightNames(attn="attn", moe_prefix="ffn", attn_in_norm="attn_norm", ffn_in_norm="ffn_norm",
                          correction_bias="gate.bias", lm_head="head"),
    )
    return model_spec(cfg, layers, **fields)
