"""Multi-head latent attention (MLA) families beyond DeepSeek-V2/V3: Sarvam-MLA, A.X K1, GLM-4-MoE-Lite, Mistral 4."""

from __future__ import annotations

from typing import Any

from freetoken_agent.runtime.model.adapters import Config, _mla, _model, _mtp_ignored, _rope_params, adapter
from freetoken_agent.runtime.model.families.sigmoid import moe_layers, sigmoid_router
from freetoken_agent.runtime.model.spec import ModelSpec, WeightNames


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
