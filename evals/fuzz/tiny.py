"""Discovery of every MoE causal-LM model type in the installed transformers, and tiny random checkpoints of each.

The one home of the tiny configs: the parity tests (``tests/runtime/arch_configs.py`` re-exports this module) and
the option fuzzer (``evals/fuzz/options.py``) build their checkpoints here. transformers is imported lazily.
The list is never hand-kept: ``moe_causal_lm_types()`` reads transformers' registries, so a new MoE architecture in a
newer transformers shows up in the parametrized test as an unsupported (skipped, with no reason) type.
Tiny configs are derived generically from each config class's defaults (``shrink``), with per-type overrides in
``OVERRIDES`` where the generic rules do not fit.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

_EXPERT_COUNT = re.compile(r"^(num_(local_)?experts|n_routed_experts|moe_num_experts)$")

N_LAYERS = 3

# Generic sizes; a key is only set when the default config has it.
_SIZES: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, d_model=64, intermediate_size=96, moe_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    shared_expert_intermediate_size=48, shared_intermediate_size=48, dense_intermediate_size=96,
    intermediate_size_mlp=96, ffn_hidden_size=96, expert_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48,
    shared_experts_intermediate_size=32, prefix_dense_intermediate_size=96,
    kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, qk_head_dim=24,
    index_head_dim=16, index_n_heads=2, index_topk=8, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_head_dim=16, linear_num_heads=4,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, kv_channels=16,
    model_max_length=512, rotary_dim=8, router_hidden_size=32,
    mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_dt_rank=8, mamba_num_heads=8, mamba_head_dim=16,
    ssm_state_size=16, n_groups=2, mamba_chunk_size=16, chunk_size=16,
)
_COUNTS = dict(experts=8, top_k=2)
_TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k_experts", "moe_top_k")
_DROP = ("per_layer_config",)


def moe_causal_lm_types() -> list[str]:
    """Every model type whose config declares an expert count and which has a ``*ForCausalLM`` in transformers."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type, config_name in CONFIG_MAPPING_NAMES.items():
        causal = f"{config_name.removesuffix('Config')}ForCausalLM"
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not hasattr(transformers, causal):
            continue
        try:
            defaults = transformers.AutoConfig.for_model(model_type).to_dict()
        except Exception:  # noqa: BLE001 - configs that cannot build with defaults are not decoder LMs we can test
            continue
        keys = set(defaults) | set(defaults.get("ffn_config") or {})
        if any(_EXPERT_COUNT.match(k) for k in keys):
            found.append(model_type)
    return sorted(found)


def causal_lm_class(model_type: str) -> Any:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    name = name or f"{CONFIG_MAPPING_NAMES[model_type].removesuffix('Config')}ForCausalLM"
    return getattr(transformers, name)


def _shrink_list(values: list[Any], n: int) -> list[Any]:
    """A per-layer list cut to ``n`` layers that still shows every distinct value (as far as n allows)."""
    out = list(values[:n])
    missing = [v for v in dict.fromkeys(map(repr, values)) if v not in map(repr, out)]
    for k, rep in enumerate(missing[: max(n - 1, 0)]):
        out[n - 1 - k] = next(v for v in values if repr(v) == rep)
    return out


def shrink(model_type: str, defaults: dict[str, Any], n: int = N_LAYERS) -> dict[str, Any]:
    """Tiny-config kwargs from a default config dict: every size that exists gets a tiny value."""
    out: dict[str, Any] = {}
    old_n = defaults.get("num_hidden_layers") or defaults.get("num_layers") or defaults.get("n_layers")
    for key, value in defaults.items():
        if key in _SIZES and (value is not None or key == "head_dim"):
            out[key] = _SIZES[key]
        elif _EXPERT_COUNT.match(key):
            out[key] = _COUNTS["experts"]
        elif key in _TOPK_KEYS:
            out[key] = min(_COUNTS["top_k"], _COUNTS["experts"])
        elif key in ("num_hidden_layers", "num_layers", "n_layers"):
            out[key] = n
        elif key == "q_lora_rank" and value is not None:
            out[key] = 20
        elif key in ("first_k_dense_replace", "num_dense_layers") and value:
            out[key] = 1
        elif key in ("n_group", "num_expert_group") and value and value > 1:
            out[key] = 2
        elif key == "topk_group" and value and value > 1:
            out[key] = 1
        elif key in ("sliding_window", "sliding_window_size", "attention_chunk_size") and value:
            out[key] = 8
        elif key == "mlp_only_layers" and value:
            out[key] = [i for i in value if i < n]
        elif key == "moe_layer_end_index" and value is not None:
            out[key] = n - 1
        elif key == "max_window_layers":
            out[key] = n
        elif isinstance(value, list) and old_n and len(value) == old_n:
            out[key] = _shrink_list(value, n)
        elif key in _DROP:
            out[key] = {}
        elif key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            out[key] = None
    if defaults.get("kv_lora_rank"):  # MLA: one latent per head
        out["num_key_value_heads"] = out.get("num_attention_heads", 4)
        if "head_dim" in defaults:
            out["head_dim"] = _SIZES["qk_rope_head_dim"]
    if "n_shared_experts" in defaults and not defaults["n_shared_experts"]:
        out["n_shared_experts"] = 1
    out["initializer_range"] = 0.15
    return out


# Per-type adjustments on top of ``shrink`` (applied last).
OVERRIDES: dict[str, dict[str, Any]] = {
    # 16 * 0.334 rotates an odd channel count; the real head_dim (192) gives an even one
    "mimo_v2_flash": dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    # head_dim * partial_rotary_factor must equal qk_rope_head_dim, as in the real config (128 * 0.5 = 64)
    # moe_layers holds layer indices (not one entry per layer); a small floor_scale exercises NoPE temperature tuning
    "llama4_text": dict(moe_layers=[0, 2], floor_scale=4, attn_scale=0.5),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"]),  # the default (None) does not build
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention", "linear_attention"]),
    # relu² MLPs blow activations up at init 0.15; HF's chunked SSM scan then drifts ~2e-4 from the exact recurrence
    "nemotron_h": dict(initializer_range=0.08),
    # the default periods put attention every 8th layer; with 3 layers: mamba, attention, mamba; MoE on 0 and 2
    "jamba": dict(attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0),
    # one dense prefix layer and a shared expert so both code paths run (defaults: all sparse, no shared expert)
    "cohere2_moe": dict(mlp_layer_types=["dense", "sparse", "sparse"], prefix_dense_intermediate_size=96,
                        num_shared_experts=1),
    # nested sub-configs: the generic shrink only sees top-level fields; the attention config needs a rope theta
    "dbrx": dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 96, "moe_num_experts": 8, "moe_top_k": 2,
                             "moe_normalize_expert_weights": 1.0}, max_seq_len=512),
    # exercise a "shared" indexer layer and two MoE layers (the default prefix is three dense layers)
    "glm_moe_dsa": dict(indexer_types=["full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse"]),
    # non-trivial residual scales (all 1 by default) so the α/β path is exercised
    "minimax": dict(linear_attn_alpha_factor=0.9, linear_attn_beta_factor=1.1, full_attn_alpha_factor=1.2,
                    mlp_alpha_factor=0.8, mlp_beta_factor=1.3),
    "longcat_flash": dict(zero_expert_num=4),  # 256 identity experts would drown the 8 real ones
    # the default Doge is dense; its MoE needs a square expert count (product keys: 4 x 4) and a small window
    "doge": dict(is_moe=True, num_experts=16, keep_window_size=16),
    # the SWA layers' GQA head_dim must equal the MLA qk head dim (nope + rope)
    "dots3_note_text": dict(head_dim=24, per_layer_config={
        "02": {"num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 16}}),
    # one block-sparse layer with 4-key blocks so the indexer's block choice and local blocks really bite
    "minimax_m3_vl_text": dict(layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
                               mlp_layer_types=["dense", "sparse", "sparse"], index_block_size=4,
                               index_topk_blocks=3, index_local_blocks=1, index_n_heads=2, index_head_dim=16),
    # ZAYA supports top-1 only; a sliding layer so both ropes and the window run
    "zaya": dict(num_experts_per_tok=1, layer_types=["hybrid_sliding", "hybrid", "hybrid"], sliding_window=8,
                 initializer_range=0.3),  # at 0.15 greedy decoding settles on one token
    # log scaling from position 4, a bias extent shorter than the prompt and a dense first layer so all paths run
    "inkling_text": dict(log_scaling_n_floor=4, rel_extent=12, mlp_layer_types=["dense", "sparse", "sparse"]),
    # blocks of two layers so both the boundary and the running-sum residuals run; a head narrower than the vocab
    "inkling2_text": dict(n_layers_per_attn_res_block=2, log_scaling_n_floor=4, rel_extent=12,
                          unpadded_vocab_size=500),
    # pre-loop, two loop layers (sliding + full) run three passes, a post-loop layer
    "inkling2_loop_text": dict(num_hidden_layers=5, n_layers_per_attn_res_block=2, loop_layer_index_start=2,
                               loop_layer_index_end=4, loop_num_passes=3, loop_gate_rank=8,
                               layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding"],
                               log_scaling_n_floor=4, rel_extent=12, unpadded_vocab_size=500),
    # small hashed n-gram tables (2 shards), PLE on both Gated DeltaNet layers, a QSA budget of 2 blocks of 4 tokens
    # (the 24-token prompt has up to 6 complete blocks), an EOS for the n-gram segments
    "qwen4_exp_text": dict(ngram_vocab_size_base=1000, split_ngram_parts=2, ple_layer_ids=[1, 2], indexer_n_heads=2,
                           indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
                           hc_lowrank=16, eos_token_id=3),
    "mistral4": dict(qk_nope_head_dim=8, head_dim=16, qk_head_dim=16),
    # two indexers (pools of 16 keys in blocks of 4), an indexed layer with its own KV that uses the first pool, one
    # reading the first indexer's KV under the second's pool; top-4 + 2 sinks + 3 local keys, so both selections bite
    # within 24-56 tokens; a dense first layer
    "kolibri1_1": dict(num_hidden_layers=6, layer_types=["sliding_attention", "indexed_attention", "indexed_attention",
                                                         "sliding_attention", "indexed_attention", "indexed_attention"],
                       index_layers=[1, 4], kv_source_layers=[0, 1, 2, 3, 4, 1], mlp_only_layers=[0],
                       mlp_only_intermediate_size=96, index_topk=4, index_pool_size=16, index_compression=4,
                       index_num_heads=2, index_num_local_tokens=3, index_num_sink_tokens=2),
    # a global (no rope, scaled logits) layer between two sliding ones, a dense first layer (its size has no generic
    # key; the default is 32768)
    "ergo": dict(first_dense_intermediate_size=96, global_attention_scale=1.3,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # all three attention kinds (sliding only, CSA, HCA) and both routers (hash, learned); small compression rates,
    # window and top-k so compressed entries, the indexer's choice and the window all bite within 24-56 tokens;
    # 8 indexer heads: with 2, all-zero relu scores tie often and top-k's tie order differs between batch shapes
    "deepseek_v4": dict(layer_types=["sliding_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention"],
                        mlp_layer_types=["hash_moe", "moe", "moe"], num_key_value_heads=1, o_groups=2, o_lora_rank=16,
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                        index_topk=3, index_n_heads=8, hc_sinkhorn_iters=5,
                        swiglu_limit=1.0),  # the default (10) never clamps the tiny model's gates and ups
    # the MoE block on, small per-layer inputs, the last two layers reading earlier layers' KV (double-wide MLPs),
    # full layers with their own head size and one KV head read as keys and values, logit soft-capping
    "gemma4_text": dict(num_hidden_layers=5, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                          "sliding_attention", "full_attention"],
                        enable_moe_block=True, moe_intermediate_size=32, vocab_size_per_layer_input=512,
                        hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
                        attention_k_eq_v=True, final_logit_softcapping=30.0,
                        tie_word_embeddings=False,  # tied, the x8-scaled embeddings make greedy repeat one token
                        per_layer_config={1: {"head_dim": 32, "num_key_value_heads": 1},
                                          4: {"head_dim": 32, "num_key_value_heads": 1}}),
}


def make_config(model_type: str, **overrides: Any) -> Any:
    import transformers

    defaults = transformers.AutoConfig.for_model(model_type).to_dict()
    kwargs = {**shrink(model_type, defaults), **OVERRIDES.get(model_type, {}), **overrides}
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def make_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """A transformers model with seeded random weights (fp32, eval mode); routers get a strong signal."""
    torch.manual_seed(seed)
    config = make_config(model_type, **overrides)
    model = causal_lm_class(model_type)._from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("position_bias"):  # DeepSeek-V4 compressor slots (zeros at init)
                p.copy_(torch.randn_like(p))
            elif model_type == "qwen4_exp_text" and (name.endswith("ple.conv1d.weight") or "norm" in name):
                p.copy_(torch.randn_like(p) * 0.3)  # zero-initialized there ((1 + w) norms, the PLE conv)
            elif name.endswith((".query", "sconv.static_weight")):  # Inkling 2's residual queries, conv taps (zeros)
                p.copy_(torch.randn_like(p) * 0.5)
            elif name.endswith(("qk_norm.temp", ".hidden_states_scale", ".residual_scale", "input_hidden_states_scale",
                                "router_states_scale")):  # ZAYA's key temperature (zeros) and scales (ones)
                p.copy_(1 + torch.randn_like(p) * 0.2)
            elif name.endswith(("residual_gate.weight", "post_expert_norm.weight")):  # Ergo's gates (zeros), norms
                p.copy_(torch.randn_like(p) * 0.5 if "gate" in name else 1 + torch.randn_like(p) * 0.3)
            elif name.endswith((".hidden_states_bias", ".residual_bias", "input_hidden_states_bias")):  # ZAYA (zeros)
                p.copy_(torch.randn_like(p) * 0.1)
            elif name.endswith(("e_score_correction_bias", "sinks", "expert_bias")):
                p.copy_(torch.randn_like(p) * 0.1 if "bias" in name else torch.randn_like(p) * 0.5)
            elif (".gate.weight" in name or "router" in name) and p.dim() == 2:
                p.copy_(torch.randn_like(p) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias", "balancing_biases")):
                b.copy_(torch.randn_like(b) * 0.1)
            elif name.endswith("tid2eid"):  # hash routing table (zeros at init): distinct random experts per token
                experts = torch.rand(b.shape[0], model.config.num_local_experts).argsort(-1).to(b.dtype)
                b.copy_(experts[:, : b.shape[1]])
        for module in model.modules():  # learned activations (PReLU, xIELU): trained-like values, distinct per site
            if type(module).__name__ in ("PReLU", "XIELUActivation"):
                for p in module.parameters():
                    p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def save_checkpoint(model_type: str, folder: Path, seed: int = 0, **overrides: Any) -> Any:
    model = make_model(model_type, seed, **overrides)
    model.save_pretrained(folder)
    return model
