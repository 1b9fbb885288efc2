"""Multi-head latent attention (MLA) families beyond DeepSeek-V2/V3: Sarvam-MLA, A.X K1, GLM-4-MoE-Lite, Mistral 4."""

from __future__ import annotations

from typing import Any

from freetoken_agent.runtime.model.adapters import Config, _mla, _model, _mtp_ignored, _rope_params, adapter
from freetoken_agent.runtime.model.families.sigmoid import moe_layers, sigmoid_router
from freetoken_agent.runtime.model.spec import IndexerSpec, ModelSpec, WeightNames


@adapter("sarvam_mla", "glm4_moe_lite")
def deepseek_like_mla(cfg: Config) -> ModelSpec:
    attn = _mla(cfg)
    return _model(cfg, moe_layers(cfg, lambda i: attn, sigmoid_router(cfg)), ignored_tensors=_mtp_ignored(cfg))


@adapter("axk1")
def axk1(cfg: Config) -> ModelSpec:
    attn = _mla(cfg)
    layers = moe_layers(cfg, lambda i: attn, sigmoid_router(cfg), moe_fields={"output_norm": True})
    return _model(cfg, layers, ignored_tensors=_mtp_ignored(cfg))


@adapter("mistral4")
def mistral4(cfg: Config) -> ModelSpec:
    p = _rope_params(cfg)
    fields: dict[str, Any] = {}
    if p.get("llama_4_scaling_beta"):
        fields = dict(q_scale_beta=float(p["llama_4_scaling_beta"]),
                      q_scale_period=int(p.get("original_max_position_embeddings") or cfg["max_position_embeddings"]))
    attn = _mla(cfg, **fields)
    router = sigmoid_router(cfg, scoring="softmax", correction_bias=False)
    return _model(cfg, moe_layers(cfg, lambda i: attn, router), names=WeightNames())


def _indexer(cfg: Config, i: int, style: str) -> IndexerSpec:
    types = cfg.get("indexer_types") or ["full"] * int(cfg["num_hidden_layers"])
    return IndexerSpec(num_heads=int(cfg["index_n_heads"]), head_dim=int(cfg["index_head_dim"]),
                       topk=int(cfg["index_topk"]), rope_dim=int(cfg["qk_rope_head_dim"]),
                       rope_style=style, shared=types[i] == "shared")  # type: ignore[arg-type]


@adapter("deepseek_v32", "glm_moe_dsa")
def deepseek_sparse(cfg: Config) -> ModelSpec:
    """MLA with DeepSeek sparse attention (lightning indexer + top-k keys); GLM-5 rotates the indexer interleaved."""
    style = "interleaved" if cfg["model_type"] == "glm_moe_dsa" else "half"
    attns = [_mla(cfg, indexer=_indexer(cfg, i, style)) for i in range(int(cfg["num_hidden_layers"]))]
    layers = moe_layers(cfg, lambda i: attns[i], sigmoid_router(cfg))
    return _model(cfg, layers, ignored_tensors=_mtp_ignored(cfg))
