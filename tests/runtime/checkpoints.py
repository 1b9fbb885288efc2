"""Tiny random Hugging Face MoE checkpoints built with ``transformers`` (the oracle), for tests and benchmarks.

Configs are chosen so that several experts fire per layer and greedy decoding does not collapse to one token:
8 experts, top-2, three layers (dense-first where the family has it), and a larger init range than the default so
random logits are far from uniform.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = [
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "deepseek_v2",
    "deepseek_v3", "glm4_moe", "gpt_oss", "ernie4_5_moe", "dots1", "minimax_m2",
]

_COMMON: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15, bos_token_id=None,
    eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
)
_MLA: dict[str, Any] = dict(
    kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4,
    n_shared_experts=1, first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=8,
)
_SPECIFIC: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=16),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[0]),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                      norm_topk_prob=True),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, clip_qkv=8.0),
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=2, embedding_multiplier=2.0,
                       residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0),
    "deepseek_v2": dict(_MLA, num_experts_per_tok=2, q_lora_rank=None, topk_method="group_limited_greedy",
                        n_group=4, topk_group=2, routed_scaling_factor=1.5),
    "deepseek_v3": dict(_MLA, num_experts_per_tok=2, q_lora_rank=20, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, rope_interleave=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 128, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}),
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                     n_group=2, topk_group=1, head_dim=16, use_qk_norm=True, attention_bias=True,
                     n_shared_experts=1, partial_rotary_factor=0.5, routed_scaling_factor=1.8),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=8),
    "ernie4_5_moe": dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1,
                         moe_num_shared_experts=1, tie_word_embeddings=True),
    "dots1": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                  n_shared_experts=1, head_dim=16, n_group=1, topk_group=1, routed_scaling_factor=1.3),
    "minimax_m2": dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16),
}


def make_config(arch: str, **overrides: Any) -> Any:
    import transformers

    kwargs = {**_COMMON, **_SPECIFIC[arch], **overrides}
    return transformers.AutoConfig.for_model(arch, **kwargs)


def make_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    """A transformers model with seeded random weights (fp32, eval mode)."""
    import transformers

    torch.manual_seed(seed)
    config = make_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # routers and correction biases start at zero: give them signal
        for name, p in model.named_parameters():
            if name.endswith(("e_score_correction_bias", "sinks")) or ".gate.weight" in name or "router" in name:
                p.copy_(torch.randn_like(p) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model.eval()


def save_checkpoint(arch: str, folder: Path, seed: int = 0, max_shard_size: str | None = None,
                    **overrides: Any) -> Any:
    model = make_model(arch, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model
