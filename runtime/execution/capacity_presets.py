"""Bundled ``config.json`` dicts of popular MoE models for ``freetoken plan --preset NAME`` (no weights needed).

Values are the public Hugging Face configs' shape fields (what the planner needs: sizes, experts, attention);
fields that only change numerics (rope scaling details, token ids) are kept minimal.
"""

from __future__ import annotations

from typing import Any

from freetoken_agent.runtime.errors import FreeTokenError

_ROPE_1M = {"rope_type": "default", "rope_theta": 1000000.0}
_QWEN3 = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, head_dim=128,
              num_key_value_heads=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
              max_position_embeddings=40960, rms_norm_eps=1e-6, rope_parameters=_ROPE_1M, tie_word_embeddings=False,
              hidden_act="silu", num_experts=128, num_experts_per_tok=8)
_GPT_OSS = dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880,
                intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                num_experts_per_tok=4, sliding_window=128, attention_bias=True, swiglu_limit=7.0,
                max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                 "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0})
_DSV3 = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
             intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3,
             num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
             num_experts_per_tok=8, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
             v_head_dim=128, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
             max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
             rope_interleave=True, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                                    "original_max_position_embeddings": 4096, "mscale": 1.0,
                                                    "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "moe_intermediate_size": 768},
    "qwen3-235b-a22b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 94,
                        "num_attention_heads": 64, "moe_intermediate_size": 1536},
    "gpt-oss-20b": {**_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32},
    "gpt-oss-120b": {**_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128},
    "deepseek-v3": dict(_DSV3),
    "mixtral-8x7b": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32000,
                         hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=32768, rms_norm_eps=1e-5, rope_parameters=_ROPE_1M,
                         tie_word_embeddings=False, hidden_act="silu"),
    "glm-4.5-air": dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=151552,
                        hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
                        num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128,
                        n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1,
                        routed_scaling_factor=1.0, norm_topk_prob=True, attention_bias=True, use_qk_norm=False,
                        partial_rotary_factor=0.5, max_position_embeddings=131072, rms_norm_eps=1e-5,
                        rope_parameters=_ROPE_1M, tie_word_embeddings=False, hidden_act="silu"),
}


def preset_config(name: str) -> dict[str, Any]:
    """The config dict of a bundled preset (case-insensitive); unknown names list the choices."""
    key = name.lower()
    if key not in PRESETS:
        raise FreeTokenError(f"no model preset {name!r}; available: {', '.join(sorted(PRESETS))}")
    return dict(PRESETS[key])
