"""The option variants are read from the transformers config classes' own fields, nested sub-configs included."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from freetoken_agent.evals.fuzz.variants import GENERATORS, sample, variants


def _options(model_type: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for v in variants(model_type):
        out.setdefault(v.kind, set()).add(f"{v.option}={v.value}")
    return out


def test_each_kind_of_option_is_generated_from_the_config_fields() -> None:
    from transformers.activations import ACT2CLS
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    qwen = _options("qwen2_moe")
    assert {f"hidden_act={a}" for a in ACT2CLS if a != "silu"} == qwen["act"]
    assert {f"rope_parameters.rope_type={k}" for k in ("default", *ROPE_INIT_FUNCTIONS)} == qwen["rope"]
    assert {"partial_rotary_factor=0.3125 (dim 5)", "partial_rotary_factor=0.5625 (dim 9)"} <= qwen["partial_rotary"]
    assert {"use_sliding_window=True", "qkv_bias=False", "norm_topk_prob=True"} <= qwen["bool"]
    assert {"decoder_sparse_step=2", "mlp_only_layers=[1]"} <= qwen["pattern"]
    assert {"shared_expert_intermediate_size=0"} <= qwen["shared"]
    assert "num_experts_per_tok=[2, 3, 2]" in qwen["per_layer"]
    assert "moe_latent_size=32" in _options("nemotron_h")["latent"]
    dbrx = _options("dbrx")  # nested sub-configs: the fields of ffn_config / attn_config
    assert "ffn_config.ffn_act_fn.name=gelu" in dbrx["act"]
    assert "ffn_config.moe_top_k=[2, 3, 2]" in dbrx["per_layer"]
    assert "mup_enabled=True" in _options("afmoe")["bool"]
    deepseek = _options("deepseek_v3")
    assert "n_shared_experts=2" in deepseek["shared"] and "routed_scaling_factor=3.75" in deepseek["scale"]


def test_a_nested_variant_overrides_the_whole_sub_config() -> None:
    v = next(v for v in variants("dbrx", ("act",)) if v.option == "ffn_config.ffn_act_fn.name" and v.value == "relu")
    ffn = v.overrides["ffn_config"]
    assert ffn["ffn_act_fn"]["name"] == "relu" and ffn["moe_num_experts"] == 8  # the rest of the sub-config kept


def test_sample_is_seeded_and_spreads_over_kinds() -> None:
    found = variants("qwen3_moe")
    a, b = sample(found, 8, seed=3), sample(found, 8, seed=3)
    assert [v.name for v in a] == [v.name for v in b]
    assert len({v.kind for v in a}) >= min(8, len({v.kind for v in found}))
    assert set(GENERATORS) >= {v.kind for v in found}
