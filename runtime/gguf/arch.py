"""GGUF metadata → the Hugging Face ``config.json`` of the same model, and GGUF tensor names → Hugging Face names.

The engine's family adapters (``runtime/model/adapters.py``) then build the ``ModelSpec`` and load the weights
unchanged. Each supported architecture (llama.cpp's ``general.architecture``) maps to one transformers model type;
what llama.cpp's converter (``convert_hf_to_gguf.py``) changed on the way in is undone here:

- ``llama`` (Mixtral-style experts) and ``granitemoe`` use llama.cpp's interleaved ("normal") rope, so the converter
  permuted the rows of ``attn_q`` / ``attn_k`` per head (pairs ``(i, i + d/2)`` → ``(2i, 2i + 1)``);
  ``rope_permuted`` undoes it. ``qwen2moe``, ``qwen3moe`` and ``olmoe`` use NeoX rope: rows as in transformers.
- Stacked experts ``blk.N.ffn_{gate,up,down}_exps`` ``[E, I, D]`` / ``[E, D, I]`` become per-expert tensors
  ``{moe}.experts.{e}.{gate,up,down}_proj.weight``; a fused ``ffn_gate_up_exps`` ``[E, 2I, D]`` is split by rows.
- Behaviour llama.cpp hard-codes per architecture (whether top-k weights are renormalized) becomes the config field
  transformers reads, unless the file says otherwise (``expert_weights_norm``).
- ``glm4moe`` (GLM-4.5): NeoX rope over part of the head (``rope.dimension_count``); ``post_attention_norm`` is the
  FFN's input norm; multi-token-prediction layers are stored as extra blocks after the decoder's
  (``nextn_predict_layers``) and are not read.
- ``gpt-oss``: gate/up experts were split out of the interleaved ``gate_up_proj`` and transposed, with their biases;
  the reader serves them back as transformers' fused tensors (``expert_layout="gpt_oss"``); the sliding-window
  layers follow llama.cpp's pattern (every other layer, from the first) unless the file lists them.
- ``deepseek2`` (DeepSeek-V2/V2.5/V3, Kimi-K2 and others converted as it): llama.cpp writes MLA as MQA (one KV head,
  ``key_length`` = kv_lora_rank + rope dim) with the real head sizes in ``key_length_mla`` / ``value_length_mla``, and
  splits ``kv_b_proj`` per head into ``attn_k_b`` (transposed) and ``attn_v_b``; the reader joins them back (files
  written before that form hold ``attn_kv_b`` and MHA head sizes: read as they are). Sigmoid
  gating maps to ``deepseek_v3``, softmax to ``deepseek_v2`` (whose expert groups transformers scores by their best
  expert; llama.cpp by the sum of the best two). Its rope is interleaved (llama.cpp's normal rope, unpermuted).
- ``qwen3next`` (Qwen3-Next): the converter stored every (1 + w) RMSNorm weight as w + 1 (undone: − 1), ``A_log`` as
  −exp(A_log) (undone: log(−A)), and regrouped the Gated DeltaNet input projection ``in_proj_qkvz`` (per key head:
  q, k, v, z) into ``attn_qkv`` (all q, all k, all v) and ``attn_gate`` (z); the reader joins it back. Linear- and
  full-attention layers from ``attention.recurrent_layers`` (else every ``full_attention_interval``-th is full).

Architectures llama.cpp writes that are not mapped here (dense ones, and MoE ones not done yet) are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from freetoken_agent.runtime.gguf.file import GGUFArchitectureError, GGUFFile, GGUFMetadataError
from freetoken_agent.runtime.model.spec import ModelSpec

Config = dict[str, Any]


@dataclass(frozen=True)
class ArchMap:
    """How one llama.cpp architecture maps onto a transformers model type."""

    model_type: str
    config: Callable[[GGUFFile], Config]
    rope_permuted: bool = False
    """llama.cpp permuted ``attn_q`` / ``attn_k`` rows for its interleaved rope (undone on read)."""
    renames: tuple[tuple[str, str], ...] = ()
    """GGUF leaf (after ``blk.N.``) → the leaf ``block_names`` knows it as, for names whose role is per architecture
    (``post_attention_norm`` is the FFN's input norm in GLM-4.5 and GPT-OSS)."""
    norms_plus_one: bool = False
    """The converter added 1 to the RMSNorm weights (transformers' (1 + w) norms, Qwen3-Next); subtracted on read."""
    expert_layout: str = "stacked"
    """``stacked``: per-expert tensors cut out of ``ffn_*_exps``; ``gpt_oss``: served as transformers' fused GPT-OSS
    tensors (gate/up interleaved and transposed, down transposed, with biases)."""


def _int(f: GGUFFile, key: str, default: Any = None) -> int:
    value = f.arch_get(key) if default is None else f.arch_get(key, default)
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise GGUFMetadataError(f"{f.path.name}: {f.architecture}.{key} differs per layer ({value}); "
                                    "per-layer values are not supported")
        value = value[0]
    try:
        return int(value)
    except (TypeError, ValueError):
        raise GGUFMetadataError(f"{f.path.name}: {f.architecture}.{key} must be an integer, got {value!r}") from None


def _float(f: GGUFFile, key: str, default: float) -> float:
    value = f.arch_get(key, default)
    try:  # stored as float32: 7 significant digits give back the decimal the converter wrote (1e-05, not 9.99e-06)
        return float(f"{float(value):.7g}")
    except (TypeError, ValueError):
        raise GGUFMetadataError(f"{f.path.name}: {f.architecture}.{key} must be a number, got {value!r}") from None


def _rope(f: GGUFFile) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": _float(f, "rope.freq_base", 10000.0)}
    kind = str(f.arch_get("rope.scaling.type", "none"))
    factor = f.arch_get("rope.scaling.factor", None)
    if kind == "none" and f.arch_get("rope.scale_linear", None) is not None:  # older files
        kind, factor = "linear", f.arch_get("rope.scale_linear")
    if kind == "linear" and factor is not None and float(factor) != 1.0:
        params.update(rope_type="linear", factor=float(factor))
    elif kind == "yarn":
        params.update(rope_type="yarn", factor=float(factor or 1.0),
                      original_max_position_embeddings=_int(f, "rope.scaling.original_context_length"),
                      beta_fast=_float(f, "rope.scaling.yarn_beta_fast", 32.0),
                      beta_slow=_float(f, "rope.scaling.yarn_beta_slow", 1.0))
    elif kind not in ("none", "linear"):
        raise GGUFMetadataError(f"{f.path.name}: rope scaling {kind!r} ({f.architecture}.rope.scaling.type) is not "
                                "supported; supported: none, linear, yarn")
    if "rope_freqs.weight" in f.tensors:  # llama3-style frequency factors baked into a tensor
        raise GGUFMetadataError(f"{f.path.name}: rope frequency factors (rope_freqs.weight) are not supported")
    return params


def _token_id(f: GGUFFile, key: str) -> int | None:
    value = f.get(f"tokenizer.ggml.{key}", None)
    return int(value) if value is not None else None


def mtp_layers(f: GGUFFile) -> int:
    """How many multi-token-prediction layers follow the decoder's blocks (``blk.{n..n+k-1}``; not run here)."""
    return _int(f, "nextn_predict_layers", 0)


def _common(f: GGUFFile, partial_rotary: bool = False, mla: bool = False) -> Config:
    """The fields every decoder has; ``vocab_size`` from the embedding table (authoritative for the weights).
    ``partial_rotary``: the architecture rotates only ``rope.dimension_count`` channels of each head (NeoX style);
    ``mla``: head sizes and rope dimension are the MLA adapter's to read (``deepseek2``)."""
    if "token_embd.weight" not in f.tensors:
        raise GGUFMetadataError(f"{f.path.name}: no token_embd.weight tensor (not a language model?)")
    heads = _int(f, "attention.head_count")
    hidden = _int(f, "embedding_length")
    blocks, mtp = _int(f, "block_count"), mtp_layers(f)
    if not 0 <= mtp < blocks:
        raise GGUFMetadataError(f"{f.path.name}: {f.architecture}.nextn_predict_layers={mtp} leaves no decoder layer "
                                f"of {blocks} blocks (a multi-token-prediction draft file is not a model to run)")
    cfg: Config = dict(
        vocab_size=f.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        num_hidden_layers=blocks - mtp,
        num_attention_heads=heads,
        num_key_value_heads=_int(f, "attention.head_count_kv", heads),
        max_position_embeddings=_int(f, "context_length", 4096),
        rms_norm_eps=_float(f, "attention.layer_norm_rms_epsilon", 1e-6),
        rope_parameters=_rope(f),
        tie_word_embeddings="output.weight" not in f.tensors,
        hidden_act="silu",
        bos_token_id=_token_id(f, "bos_token_id"),
        eos_token_id=_token_id(f, "eos_token_id"),
    )
    if mla:
        return cfg
    if f.arch_get("attention.key_length", None) is not None:
        cfg["head_dim"] = _int(f, "attention.key_length")
        value = _int(f, "attention.value_length", cfg["head_dim"])
        if value != cfg["head_dim"]:
            raise GGUFMetadataError(f"{f.path.name}: key_length {cfg['head_dim']} != value_length {value} is not "
                                    f"supported for {f.architecture}")
    if mtp:
        cfg["num_nextn_predict_layers"] = mtp
    rot = f.arch_get("rope.dimension_count", None)
    head_dim = cfg.get("head_dim", hidden // heads)
    if partial_rotary and rot is not None and 0 < int(rot) <= head_dim and int(rot) % 2 == 0:
        cfg["rope_parameters"]["partial_rotary_factor"] = int(rot) / head_dim
    elif rot is not None and int(rot) != head_dim:
        raise GGUFMetadataError(f"{f.path.name}: partial rotary ({f.architecture}.rope.dimension_count={int(rot)} of "
                                f"head_dim {head_dim}) is not supported for {f.architecture}")
    return cfg


def _experts(f: GGUFFile) -> tuple[int, int]:
    """(expert_count, expert_used_count); a dense file of an MoE-capable architecture is refused."""
    n = _int(f, "expert_count", 0)
    if n <= 0:
        raise GGUFArchitectureError(f"{f.path.name}: {f.architecture} without experts ({f.architecture}.expert_count "
                                    "missing or 0) is a dense model; this engine runs MoE models")
    return n, _int(f, "expert_used_count")


def _moe_layers(f: GGUFFile, n_layers: int) -> list[int]:
    return [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in f.tensors]


def _expert_ffn(f: GGUFFile) -> int:
    """The routed experts' intermediate size: the metadata, else the stacked tensor's shape."""
    if f.arch_get("expert_feed_forward_length", None) is not None:
        return _int(f, "expert_feed_forward_length")
    for name, t in f.tensors.items():
        if name.endswith(".ffn_up_exps.weight"):
            return t.shape[1]
        if name.endswith(".ffn_gate_up_exps.weight"):
            return t.shape[1] // 2
    return _int(f, "feed_forward_length")


def qwen_moe(f: GGUFFile, qwen3: bool) -> Config:
    cfg = _common(f)
    n, k = _experts(f)
    moe = _moe_layers(f, cfg["num_hidden_layers"])
    expert_ffn = _expert_ffn(f)
    cfg.update(
        model_type="qwen3_moe" if qwen3 else "qwen2_moe",
        num_experts=n, num_experts_per_tok=k, moe_intermediate_size=expert_ffn,
        intermediate_size=_int(f, "feed_forward_length", expert_ffn),
        # llama.cpp renormalizes the top-k weights for qwen3moe and not for qwen2moe
        norm_topk_prob=bool(f.arch_get("expert_weights_norm", qwen3)),
        decoder_sparse_step=1, mlp_only_layers=[i for i in range(cfg["num_hidden_layers"]) if i not in moe],
        use_sliding_window=False,
    )
    bias = "blk.0.attn_q.bias" in f.tensors
    if qwen3:
        cfg["attention_bias"] = bias
    else:
        cfg["qkv_bias"] = bias
        shared = f.arch_get("expert_shared_feed_forward_length", None)
        shexp = next((t for name, t in f.tensors.items() if name.endswith(".ffn_up_shexp.weight")), None)
        cfg["shared_expert_intermediate_size"] = int(shared) if shared is not None else (shexp.shape[0] if shexp
                                                                                         else 0)
    return cfg


def llama_moe(f: GGUFFile) -> Config:
    """llama.cpp's ``llama`` architecture with experts: Mixtral."""
    cfg = _common(f)
    n, k = _experts(f)
    cfg.update(model_type="mixtral", num_local_experts=n, num_experts_per_tok=k, intermediate_size=_expert_ffn(f),
               sliding_window=None)
    return cfg


def olmoe(f: GGUFFile) -> Config:
    cfg = _common(f)
    n, k = _experts(f)
    clamp = f.arch_get("attention.clamp_kqv", None)
    cfg.update(model_type="olmoe", num_experts=n, num_experts_per_tok=k, intermediate_size=_expert_ffn(f),
               clip_qkv=float(clamp) if clamp is not None else None,
               norm_topk_prob=bool(f.arch_get("expert_weights_norm", False)),
               attention_bias="blk.0.attn_q.bias" in f.tensors)
    return cfg


def granitemoe(f: GGUFFile) -> Config:
    cfg = _common(f)
    n, k = _experts(f)
    if any(name.endswith("_shexp.weight") for name in f.tensors):
        raise GGUFArchitectureError(f"{f.path.name}: granitemoe with shared experts (GraniteMoeShared) is not "
                                    "supported from GGUF")
    cfg.update(model_type="granitemoe", num_local_experts=n, num_experts_per_tok=k, intermediate_size=_expert_ffn(f),
               attention_multiplier=_float(f, "attention.scale", 1.0),
               embedding_multiplier=_float(f, "embedding_scale", 1.0),
               residual_multiplier=_float(f, "residual_scale", 1.0),
               logits_scaling=_float(f, "logit_scale", 1.0),
               attention_bias="blk.0.attn_q.bias" in f.tensors)
    return cfg


GATING = {1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrt_softplus"}
"""llama.cpp's ``expert_gating_func`` values."""


def _gating(f: GGUFFile, default: str) -> str:
    value = f.arch_get("expert_gating_func", None)
    if value is None:
        return default
    if int(value) not in GATING:
        raise GGUFMetadataError(f"{f.path.name}: {f.architecture}.expert_gating_func={int(value)} is not a gating "
                                f"function this engine knows ({', '.join(f'{k}={v}' for k, v in GATING.items())})")
    return GATING[int(value)]


def glm4moe(f: GGUFFile) -> Config:
    """GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``): sigmoid router with a correction bias, shared experts, dense
    leading layers, partial NeoX rope."""
    cfg = _common(f, partial_rotary=True)
    n, k = _experts(f)
    gating = _gating(f, "sigmoid")  # llama.cpp's default for glm4moe
    if gating != "sigmoid":
        raise GGUFMetadataError(f"{f.path.name}: glm4moe with {gating} expert gating (expert_gating_func) is not "
                                "GLM-4.5's router (sigmoid); not supported")
    expert_ffn = _expert_ffn(f)
    cfg.update(
        model_type="glm4_moe", n_routed_experts=n, num_experts_per_tok=k, moe_intermediate_size=expert_ffn,
        intermediate_size=_int(f, "feed_forward_length", expert_ffn),
        n_shared_experts=_int(f, "expert_shared_count", 0),
        first_k_dense_replace=_int(f, "leading_dense_block_count", 0),
        n_group=_int(f, "expert_group_count", 1), topk_group=_int(f, "expert_group_used_count", 1),
        # llama.cpp: no key means no renormalization, and a scale of 0 (absent) means 1
        norm_topk_prob=bool(f.arch_get("expert_weights_norm", False)),
        routed_scaling_factor=_float(f, "expert_weights_scale", 1.0) or 1.0,
        attention_bias="blk.0.attn_q.bias" in f.tensors,
        use_qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
    )
    return cfg


def gpt_oss(f: GGUFFile) -> Config:
    """GPT-OSS: softmax over the top-k router logits (with a bias), SwiGLU-OAI experts with biases, attention sinks,
    sliding-window attention on every other layer."""
    cfg = _common(f)
    n, k = _experts(f)
    if "blk.0.ffn_gate_inp.bias" not in f.tensors or "blk.0.attn_sinks.weight" not in f.tensors:
        raise GGUFMetadataError(f"{f.path.name}: gpt-oss file without router biases or attention sinks (blk.0."
                                "ffn_gate_inp.bias / blk.0.attn_sinks.weight)")
    layers = cfg["num_hidden_layers"]
    pattern = f.arch_get("attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        if len(pattern) < layers:
            raise GGUFMetadataError(f"{f.path.name}: gpt-oss.attention.sliding_window_pattern lists {len(pattern)} "
                                    f"layers, the model has {layers}")
        sliding = [bool(v) for v in pattern[:layers]]
    else:  # llama.cpp's set_swa_pattern(n): layer i slides unless it is the last of each group of n
        sliding = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    params = cfg["rope_parameters"]
    if params["rope_type"] == "yarn":
        params["truncate"] = False  # transformers' GPT-OSS yarn (what the checkpoint was trained with)
    cfg.update(
        model_type="gpt_oss", num_local_experts=n, num_experts_per_tok=k, intermediate_size=_expert_ffn(f),
        sliding_window=_int(f, "attention.sliding_window"),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        attention_bias="blk.0.attn_q.bias" in f.tensors,
        # llama.cpp hard-codes GPT-OSS's SwiGLU constants too
        swiglu_alpha=1.702, swiglu_limit=7.0,
    )
    return cfg


def deepseek2(f: GGUFFile) -> Config:
    """DeepSeek-V2/V3 (MLA, shared experts, dense leading layers): ``deepseek_v3`` for sigmoid gating, else
    ``deepseek_v2``."""
    cfg = _common(f, mla=True)
    n, k = _experts(f)
    rope_dim = _int(f, "rope.dimension_count")
    kv_rank = _int(f, "attention.kv_lora_rank")
    if f.arch_get("attention.key_length_mla", None) is not None:  # MLA as MQA, attn_k_b / attn_v_b
        qk, v = _int(f, "attention.key_length_mla"), _int(f, "attention.value_length_mla")
        if _int(f, "attention.key_length") != kv_rank + rope_dim:
            raise GGUFMetadataError(f"{f.path.name}: deepseek2 key_length {_int(f, 'attention.key_length')} is not "
                                    f"kv_lora_rank {kv_rank} + rope dimension {rope_dim} (MLA written as MQA)")
    elif any(name.endswith(".attn_kv_b.weight") for name in f.tensors):  # files from before that form: MHA sizes
        qk, v = _int(f, "attention.key_length"), _int(f, "attention.value_length")
    else:
        raise GGUFMetadataError(f"{f.path.name}: deepseek2 file with neither attention.key_length_mla nor "
                                "attn_kv_b tensors: its MLA head sizes are unknown")
    if not 0 < rope_dim < qk:
        raise GGUFMetadataError(f"{f.path.name}: deepseek2 rope dimension {rope_dim} does not fit its query/key head "
                                f"size {qk}")
    gating = _gating(f, "softmax")  # llama.cpp's default for files without the key (DeepSeek-V2/V2.5)
    if gating not in ("softmax", "sigmoid"):
        raise GGUFMetadataError(f"{f.path.name}: deepseek2 with {gating} expert gating is not supported")
    v3 = gating == "sigmoid"
    has_bias = any(name.endswith(".exp_probs_b.bias") for name in f.tensors)
    if v3 and not has_bias:
        raise GGUFMetadataError(f"{f.path.name}: deepseek2 with sigmoid gating but no exp_probs_b.bias (correction "
                                "bias) is not supported")
    norm = bool(f.arch_get("expert_weights_norm", False))
    if not v3 and norm:
        raise GGUFMetadataError(f"{f.path.name}: deepseek2 with softmax gating and renormalized top-k weights "
                                "(expert_weights_norm) is not a DeepSeek-V2 router; not supported")
    groups = _int(f, "expert_group_count", 1)
    q_rank = f.arch_get("attention.q_lora_rank", None)
    params = cfg["rope_parameters"]
    log_mul = f.arch_get("rope.scaling.yarn_log_multiplier", None)
    if params["rope_type"] == "yarn" and log_mul is not None:  # the converter wrote 0.1 * mscale_all_dim
        params["mscale_all_dim"] = params["mscale"] = float(f"{float(log_mul) / 0.1:.6g}")
    expert_ffn = _expert_ffn(f)
    cfg.update(
        model_type="deepseek_v3" if v3 else "deepseek_v2",
        n_routed_experts=n, num_experts_per_tok=k, moe_intermediate_size=expert_ffn,
        intermediate_size=_int(f, "feed_forward_length", expert_ffn),
        n_shared_experts=_int(f, "expert_shared_count", 0),
        first_k_dense_replace=_int(f, "leading_dense_block_count", 0),
        n_group=groups, topk_group=_int(f, "expert_group_used_count", 1),
        routed_scaling_factor=_float(f, "expert_weights_scale", 1.0) or 1.0,
        num_key_value_heads=cfg["num_attention_heads"],  # MLA runs as MHA after the up-projection
        q_lora_rank=int(q_rank) if q_rank is not None else None, kv_lora_rank=kv_rank,
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk - rope_dim, v_head_dim=v, head_dim=rope_dim,
        rope_interleave=True, attention_bias=False,
    )
    if v3:
        cfg.update(norm_topk_prob=norm, scoring_func="sigmoid", topk_method="noaux_tc")
    else:
        cfg.update(topk_method="group_limited_greedy" if groups > 1 else "greedy", mlp_bias=False)
    return cfg


def qwen3next(f: GGUFFile) -> Config:
    """Qwen3-Next: Gated DeltaNet layers interleaved with gated full attention (partial NeoX rope), MoE with a gated
    shared expert in every layer."""
    cfg = _common(f, partial_rotary=True)
    n, k = _experts(f)
    layers = cfg["num_hidden_layers"]
    recurrent = f.arch_get("attention.recurrent_layers", None)
    if isinstance(recurrent, list):
        if len(recurrent) < layers:
            raise GGUFMetadataError(f"{f.path.name}: qwen3next.attention.recurrent_layers lists {len(recurrent)} "
                                    f"layers, the model has {layers}")
        linear = [bool(v) for v in recurrent[:layers]]
    else:  # llama.cpp's default: every interval-th layer is full attention
        interval = _int(f, "full_attention_interval", 4)
        linear = [(i + 1) % interval != 0 for i in range(layers)]
    v_heads = _int(f, "ssm.time_step_rank")
    inner = _int(f, "ssm.inner_size")
    if inner % v_heads:
        raise GGUFMetadataError(f"{f.path.name}: qwen3next.ssm.inner_size {inner} is not a multiple of its "
                                f"{v_heads} value heads (ssm.time_step_rank)")
    expert_ffn = _expert_ffn(f)
    shared = f.arch_get("expert_shared_feed_forward_length", None)
    cfg.update(
        model_type="qwen3_next", num_experts=n, num_experts_per_tok=k, moe_intermediate_size=expert_ffn,
        intermediate_size=_int(f, "feed_forward_length", expert_ffn),
        shared_expert_intermediate_size=int(shared) if shared is not None else 0,
        norm_topk_prob=True,  # llama.cpp hard-codes the renormalization for qwen3next
        decoder_sparse_step=1, mlp_only_layers=[i for i in range(layers) if i not in _moe_layers(f, layers)],
        layer_types=["linear_attention" if x else "full_attention" for x in linear],
        linear_conv_kernel_dim=_int(f, "ssm.conv_kernel"), linear_key_head_dim=_int(f, "ssm.state_size"),
        linear_num_key_heads=_int(f, "ssm.group_count"), linear_num_value_heads=v_heads,
        linear_value_head_dim=inner // v_heads,
        attention_bias=any(name.endswith(".attn_q.bias") for name in f.tensors),  # (layer 0 is linear attention)
    )
    return cfg


ARCHITECTURES: dict[str, ArchMap] = {
    "qwen3moe": ArchMap("qwen3_moe", lambda f: qwen_moe(f, True)),
    "qwen2moe": ArchMap("qwen2_moe", lambda f: qwen_moe(f, False)),
    "llama": ArchMap("mixtral", llama_moe, rope_permuted=True),
    "olmoe": ArchMap("olmoe", olmoe),
    "granitemoe": ArchMap("granitemoe", granitemoe, rope_permuted=True),
    "glm4moe": ArchMap("glm4_moe", glm4moe, renames=(("post_attention_norm.weight", "ffn_norm.weight"),)),
    "gpt-oss": ArchMap("gpt_oss", gpt_oss, renames=(("post_attention_norm.weight", "ffn_norm.weight"),),
                       expert_layout="gpt_oss"),
    "deepseek2": ArchMap("deepseek_v3", deepseek2),
    "qwen3next": ArchMap("qwen3_next", qwen3next, renames=(("post_attention_norm.weight", "ffn_norm.weight"),),
                         norms_plus_one=True),
}
"""llama.cpp architecture → how it maps (the GGUF loader's supported list)."""

NOT_YET = {
    "qwen35moe": "Qwen3.5 MoE (gated delta-net layers)",
    "deepseek": "DeepSeek-V1 MoE",
    "dots1": "dots.llm1",
    "ernie4_5-moe": "ERNIE 4.5 MoE",
    "bailingmoe": "Ling/Bailing MoE",
    "bailingmoe2": "Ling 2 MoE",
    "phimoe": "Phi-3.5-MoE",
    "dbrx": "DBRX",
    "llama4": "Llama 4",
    "minimax-m2": "MiniMax-M2",
    "hunyuan-moe": "Hunyuan MoE",
    "grovemoe": "GroveMoE",
    "lfm2moe": "LFM2 MoE",
    "afmoe": "AFMoE",
    "smallthinker": "SmallThinker",
    "arctic": "Snowflake Arctic",
    "grok": "Grok",
}
"""MoE architectures llama.cpp writes whose GGUF mapping is not done yet (refused with this name)."""


def arch_map(f: GGUFFile) -> ArchMap:
    arch = f.architecture
    if arch in ARCHITECTURES:
        return ARCHITECTURES[arch]
    supported = ", ".join(sorted(ARCHITECTURES))
    if arch in NOT_YET:
        raise GGUFArchitectureError(f"{f.path.name}: GGUF architecture {arch!r} ({NOT_YET[arch]}) is not supported "
                                    f"from GGUF yet; supported: {supported}")
    raise GGUFArchitectureError(f"{f.path.name}: GGUF architecture {arch!r} is not an MoE architecture this engine "
                                f"runs; supported: {supported}")


def hf_config(f: GGUFFile) -> Config:
    """The transformers ``config.json`` (as a dict) equivalent to the file's metadata."""
    return arch_map(f).config(f)


# ------------------------------------------------------------------------------------------------ tensor names


def block_names(spec: ModelSpec, layer: int) -> dict[str, str]:
    """GGUF leaf (after ``blk.N.``) → Hugging Face name, for the non-expert tensors of one layer."""
    lay = spec.layers[layer]
    n = lay.names or spec.names
    p = lay.prefix or f"{n.layers}.{layer}"
    at = f"{p}.{n.attn}"
    out: dict[str, str] = {}
    if n.attn_in_norm:
        out["attn_norm.weight"] = f"{p}.{n.attn_in_norm}.weight"
    if n.ffn_in_norm:
        out["ffn_norm.weight"] = f"{p}.{n.ffn_in_norm}.weight"
    for theirs, ours in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", n.o_proj)):
        for kind in ("weight", "bias"):
            out[f"{theirs}.{kind}"] = f"{at}.{ours}.{kind}"
    for theirs, ours in (("attn_q_a", "q_a_proj"), ("attn_q_a_norm", "q_a_layernorm"), ("attn_q_b", "q_b_proj"),
                         ("attn_kv_a_mqa", "kv_a_proj_with_mqa"), ("attn_kv_a_norm", "kv_a_layernorm"),
                         ("attn_kv_b", "kv_b_proj")):  # MLA
        out[f"{theirs}.weight"] = f"{at}.{ours}.weight"
    rec = f"{p}.{n.recurrent}"  # Gated DeltaNet (attn_qkv + attn_gate: joined by the reader)
    r = lay.recurrent
    for theirs, ours in (("ssm_ba.weight", "in_proj_ba.weight"), ("ssm_conv1d.weight", "conv1d.weight"),
                         ("ssm_dt.bias", "dt_bias"), ("ssm_a", "A_log"), ("ssm_out.weight", "out_proj.weight"),
                         ("ssm_norm.weight", f"{r.norm if r else 'norm'}.weight")):
        out[theirs] = f"{rec}.{ours}"
    out["attn_q_norm.weight"] = f"{at}.{n.q_norm}.weight"
    out["attn_k_norm.weight"] = f"{at}.{n.k_norm}.weight"
    for leaf in ("gate", "up", "down"):
        out[f"ffn_{leaf}.weight"] = f"{p}.{n.mlp}.{leaf}_proj.weight"
    moe = f"{p}.{n.moe_prefix}"
    out["ffn_gate_inp.weight"] = f"{moe}.{n.router}.weight"
    out["ffn_gate_inp.bias"] = f"{moe}.{n.router}.bias"
    out["exp_probs_b.bias"] = f"{p if n.correction_at_layer else moe}.{n.correction_bias}"
    out["attn_sinks.weight"] = f"{at}.{n.sinks}"
    shared = f"{p if n.shared_at_layer else moe}.{n.shared}"
    for leaf in ("gate", "up", "down"):
        out[f"ffn_{leaf}_shexp.weight"] = f"{shared}.{leaf}_proj.weight"
    out["ffn_gate_inp_shexp.weight"] = f"{moe}.{n.shared_gate}.weight"
    return out


GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
EXPERT_LEAVES = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                 "ffn_down_exps.weight": "down_proj"}


def expert_prefix(spec: ModelSpec, layer: int) -> str:
    """``model.layers.N.{moe_prefix}``: where a layer's experts live in Hugging Face names."""
    lay = spec.layers[layer]
    n = lay.names or spec.names
    return f"{lay.prefix or f'{n.layers}.{layer}'}.{n.moe_prefix}"


def global_name(spec: ModelSpec, gguf_name: str) -> str | None:
    role = GLOBAL_NAMES.get(gguf_name)
    if role is None:
        return None
    n = spec.names
    return {"embed": f"{n.embed}.weight", "final_norm": f"{n.final_norm}.weight" if n.final_norm else None,
            "lm_head": f"{n.lm_head}.weight"}[role]
