"""Write a Hugging Face MoE folder as GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` does (for tests).

Tensor names come from the ``gguf`` package's own ``TensorNameMap`` (llama.cpp's table, not ours); experts are
stacked into ``blk.N.ffn_{gate,up,down}_exps`` ``[E, I, D]`` / ``[E, D, I]``; ``llama`` / ``granitemoe`` Q and K rows
are permuted for llama.cpp's interleaved rope (its ``LlamaModel.permute``); metadata keys as its ``TextModel`` and
the per-architecture classes write them.

- ``glm4_moe`` (``Glm4MoeModel``): multi-token-prediction layers become extra blocks (``block_count`` = layers +
  ``num_nextn_predict_layers``); the correction bias becomes ``exp_probs_b.bias``;
- ``gpt_oss`` (``GptOssModel``, float source): ``gate_up_proj`` [E, D, 2I] transposed and split into gate (even
  columns) and up (odd columns), ``down_proj`` transposed, their biases split the same way; ``sinks`` →
  ``attn_sinks.weight``;
- ``deepseek_v2`` / ``deepseek_v3`` (``DeepseekV2Model``): MLA written as MQA (one KV head, ``key_length`` =
  kv_lora_rank + rope dim, the real sizes in ``key_length_mla`` / ``value_length_mla``), ``kv_b_proj`` split per head
  into ``attn_k_b`` (transposed to [H, R, nope]) and ``attn_v_b`` [H, v, R]; layers after ``num_hidden_layers``
  (multi-token prediction) dropped;
- ``qwen3_next`` (``Qwen3NextModel``; no multi-token-prediction tensors, as ``--no-mtp`` writes it): RMSNorm weights
  stored + 1 (not the DeltaNet's output norm), ``A_log`` as −exp(A_log), ``dt_bias`` → ``ssm_dt.bias``, the conv
  squeezed to [C, K], ``in_proj_qkvz`` regrouped into ``attn_qkv`` (all q, all k, all v) and ``attn_gate`` (z).

Block types: F32/F16/BF16, and Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / MXFP4 via
``gguf.quants.quantize``; Q4_K / Q5_K / Q6_K via our own ggml quantizers (``runtime/quant/q4k.py``, ``q5k.py``,
``q6k.py``; the ``gguf`` package cannot write K-quants).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe",
        "granitemoe": "granitemoe", "glm4_moe": "glm4moe", "gpt_oss": "gpt-oss", "deepseek_v2": "deepseek2",
        "deepseek_v3": "deepseek2", "qwen3_next": "qwen3next"}
PERMUTED = {"llama", "granitemoe"}


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: per head, rows ``(i, i + d/2)`` → ``(2i, 2i + 1)``."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(w: torch.Tensor, kind: str) -> tuple[np.ndarray, Any]:
    """(array, raw_dtype) for ``GGUFWriter.add_tensor``."""
    import gguf

    T = gguf.GGMLQuantizationType
    x = w.float().contiguous().numpy()
    if kind not in ("F32", "F16") and w.shape[-1] % gguf.GGML_QUANT_SIZES[T[kind]][0]:
        kind = "F16"  # rows that are no whole number of blocks: llama.cpp's quantizer falls back too
    if kind == "F32":
        return x, None
    if kind == "F16":
        return x.astype(np.float16), None
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        from freetoken_agent.runtime.quant.formats import block_format

        rows = w.reshape(-1, w.shape[-1]).float()
        blocks = block_format(kind).quantize_rows(rows)  # [N, K/256, 144 | 176 | 210]
        return blocks.reshape(*w.shape[:-1], -1).numpy(), T[kind]
    qt = T[kind]
    return gguf.quants.quantize(x, qt), qt


def _load_groups(folder: Path) -> Iterator[dict[str, torch.Tensor]]:
    """The checkpoint's tensors as fp32, one group at a time: everything outside ``model.layers``, then each layer
    (so a 7B checkpoint never sits in memory whole)."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            where.update({k: file for k in f.keys()})
    groups: dict[int, list[str]] = {}
    for k in where:
        m = re.match(r"model\.layers\.(\d+)\.", k)
        groups.setdefault(int(m.group(1)) if m else -1, []).append(k)
    for _, keys in sorted(groups.items()):
        out: dict[str, torch.Tensor] = {}
        for file in sorted({where[k] for k in keys}):
            with safe_open(str(file), "pt") as f:
                out.update({k: f.get_tensor(k).float() for k in keys if where[k] == file})
        yield out


def _stack_experts(sd: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Per-expert (``experts.{e}.{gate_proj,w1}``) and Granite's fused tensors → stacked merged names."""
    out = dict(sd)
    for i in range(n_layers):
        for prefix in (f"model.layers.{i}.mlp", f"model.layers.{i}.block_sparse_moe"):
            for style in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
                pattern = rf"{re.escape(prefix)}\.experts\.\d+\.{style[0]}\.weight"
                keys = [k for k in sd if re.fullmatch(pattern, k)]
                if not keys:
                    continue
                for leaf in style:
                    parts = [out.pop(f"{prefix}.experts.{e}.{leaf}.weight") for e in range(len(keys))]
                    out[f"{prefix}.experts.{leaf}.weight"] = torch.stack(parts)
            fused = f"{prefix}.input_linear.weight"
            if fused in out:  # Granite: [E, 2I, D] → gate, up (convert's GraniteMoeModel splits it)
                gate, up = out.pop(fused).chunk(2, dim=1)
                out[f"{prefix}.experts.w1.weight"], out[f"{prefix}.experts.w3.weight"] = gate, up
                out[f"{prefix}.output_linear.weight"] = out.pop(f"{prefix}.output_linear.weight")
    return out


def _modify(arch: str, name: str, t: torch.Tensor, cfg: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The converter's per-architecture ``filter_tensors`` / ``modify_tensors``: Hugging Face (name, tensor) →
    the (name, tensor) pairs it maps to GGUF names."""
    if name.endswith("e_score_correction_bias"):  # ModelBase.filter_tensors
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    if arch == "deepseek2":  # DeepseekV2Model.modify_tensors
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m[1]) >= cfg["num_hidden_layers"]:  # multi-token prediction: skipped
            return []
        if name.endswith("kv_b_proj.weight"):
            heads, v, nope = cfg["num_key_value_heads"], cfg["v_head_dim"], cfg["qk_nope_head_dim"]
            kv_b = t.view(heads, v + nope, t.shape[-1])
            k_b, v_b = torch.split(kv_b, [nope, v], dim=1)
            return [(name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)),
                    (name.replace("kv_b_proj", "v_b_proj"), v_b)]
    if arch == "qwen3next":  # Qwen3NextModel.modify_tensors
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if "in_proj_qkvz.weight" in name:
            dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
            hk, hv, d = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["hidden_size"]
            split = [dk, dk, hv // hk * dv, hv // hk * dv]
            q, k, v, z = torch.split(t.permute(1, 0).contiguous().view(-1, hk, sum(split)), split, dim=-1)
            q, k, v, z = (x.contiguous().view(d, -1) for x in (q, k, v, z))
            bid = int(name.split(".")[2])
            return [(f"gguf:blk.{bid}.attn_qkv.weight", torch.cat([q, k, v], dim=-1).permute(1, 0).contiguous()),
                    (f"gguf:blk.{bid}.attn_gate.weight", z.permute(1, 0).contiguous())]
        return [(name, t)]
    if arch != "gpt-oss":
        return [(name, t)]
    if "sinks" in name:  # GptOssModel.filter_tensors
        return [(name + ".weight", t)]
    if "down_proj" in name and ".experts." in name:  # GptOssModel.modify_tensors, float (not MXFP4) source
        if name.endswith("_bias"):
            return [(name.replace("down_proj_bias", "down_proj.bias"), t)]
        return [(name.replace("down_proj", "down_proj.weight"), t.transpose(-1, -2))]
    if "gate_up_proj" in name:
        if name.endswith("_bias"):
            return [(name.replace("gate_up_proj_bias", "gate_proj.bias"), t[..., ::2]),
                    (name.replace("gate_up_proj_bias", "up_proj.bias"), t[..., 1::2])]
        t = t.transpose(-1, -2)
        return [(name.replace("gate_up_proj", "gate_proj.weight"), t[:, ::2, :]),
                (name.replace("gate_up_proj", "up_proj.weight"), t[:, 1::2, :])]
    return [(name, t)]


def _arch_metadata(w: Any, arch: str, cfg: dict[str, Any], heads: int) -> None:
    """What the converter's per-architecture ``set_gguf_parameters`` adds to ``TextModel``'s keys."""
    import gguf

    if arch == "llama":
        w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        w.add_vocab_size(cfg["vocab_size"])
    if arch == "olmoe" and cfg.get("clip_qkv") is not None:
        w.add_clamp_kqv(cfg["clip_qkv"])
    if arch == "granitemoe":
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if arch == "glm4moe":  # Glm4MoeModel
        rope = cfg.get("rope_parameters") or {}
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        if cfg.get("num_nextn_predict_layers") is not None:
            w.add_nextn_predict_layers(cfg["num_nextn_predict_layers"])
    if arch == "gpt-oss":  # GptOssModel
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
    if arch == "qwen3next":  # Qwen3NextModel (Qwen2MoeModel's expert lengths are written for every arch above)
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        if cfg.get("layer_types") is not None:  # GGUFWriter.add_recurrent_layers (newer gguf than installed)
            w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
        w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
        rope = cfg.get("rope_parameters") or {}
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    if arch == "deepseek2":  # DeepseekV2Model (key/value lengths: see write_gguf)
        w.add_leading_dense_block_count(cfg.get("first_k_dense_replace") or 0)
        w.add_vocab_size(cfg["vocab_size"])
        if cfg.get("q_lora_rank") is not None:
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_kv_lora_rank(cfg["kv_lora_rank"])
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
        w.add_value_length_mla(cfg["v_head_dim"])
        w.add_expert_shared_count(cfg.get("n_shared_experts", 0))
        if cfg.get("routed_scaling_factor") is not None:
            w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        if cfg.get("norm_topk_prob"):
            w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
        rope = cfg.get("rope_parameters") or {}
        if rope.get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _rope_scaling(w: Any, cfg: dict[str, Any]) -> None:
    """``TextModel.set_gguf_parameters``' rope scaling keys (linear, yarn)."""
    import gguf

    rope = cfg.get("rope_parameters") or {}
    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def write_gguf(folder: Path, out: Path, experts: str = "F32", dense: str = "F32", split_max_tensors: int = 0,
               tokenizer: Path | None = None, down: str | None = None, no_vocab: bool = False) -> Path:
    """Write ``folder`` (config.json + safetensors) as GGUF at ``out``; ``experts`` / ``dense`` are ggml type
    names for the routed experts and the 2-D dense weights (norms and the router stay F32, as llama.cpp keeps
    them); ``down`` overrides the type of ``ffn_down_exps`` (a Q4_K_M-style mix). ``tokenizer``: a folder whose
    ``tokenizer.json`` (byte-level BPE) and chat template go into the metadata; ``no_vocab``: tokenizer model
    ``none`` with ``vocab_size`` instead (what llama.cpp loads a vocabulary-less model with, for comparisons on token
    ids)."""
    import gguf

    cfg = json.loads((folder / "config.json").read_text())
    arch = ARCH[cfg["model_type"]]
    n_layers = cfg["num_hidden_layers"]
    mla = arch == "deepseek2"
    if arch == "glm4moe":  # Glm4MoeModel exports the multi-token-prediction layers as extra blocks
        n_layers += cfg.get("num_nextn_predict_layers") or 0
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    # one tensor in memory at a time: the data goes to a temporary file as it is added (not with splits, whose
    # parts the writer cannot fill from one temporary file)
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors, use_temp_file=not split_max_tensors)
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1 if mla else kv_heads)  # DeepseekV2Model: MLA as MQA
    rope = cfg.get("rope_parameters") or {}
    _rope_scaling(w, cfg)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    n_exp = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    w.add_expert_count(n_exp)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("n_group") is not None:
        w.add_expert_group_count(cfg["n_group"])
    if cfg.get("topk_group") is not None:
        w.add_expert_group_used_count(cfg["topk_group"])
    score = cfg.get("scoring_func")
    if score is not None:
        w.add_expert_gating_func({"sigmoid": gguf.ExpertGatingFuncType.SIGMOID,
                                  "softmax": gguf.ExpertGatingFuncType.SOFTMAX}[score])
    if mla:  # DeepseekV2Model's values (they replace TextModel's head_dim ones)
        w.add_key_length(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
        w.add_value_length(cfg["kv_lora_rank"])
    elif cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    _arch_metadata(w, arch, cfg, heads)
    if tokenizer is not None:
        add_tokenizer(w, tokenizer)
    elif no_vocab:
        w.add_tokenizer_model("none")
        if arch not in ("llama", "deepseek2"):  # (their converters write it already)
            w.add_vocab_size(cfg["vocab_size"])
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    tmap = gguf.get_tensor_name_map(arch_id, n_layers)
    for sd in _load_groups(folder):
        if mla and cfg.get("tie_word_embeddings"):
            sd.pop("lm_head.weight", None)
        _add_tensors(w, _stack_experts(sd, n_layers), arch, cfg, tmap, heads, kv_heads, experts, dense, down)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tensors(w: Any, sd: dict[str, torch.Tensor], arch: str, cfg: dict[str, Any], tmap: Any, heads: int,
                 kv_heads: int, experts: str, dense: str, down: str | None) -> None:
    for name, t in ((n2, t2) for n, t in sd.items() for n2, t2 in _modify(arch, n, t, cfg)):
        new = name.removeprefix("gguf:") if name.startswith("gguf:") else tmap.get_name(name, try_suffixes=(".weight",
                                                                                                             ".bias"))
        if new is None:
            raise ValueError(f"no GGUF name for {name}")
        if arch in PERMUTED and ".self_attn.q_proj." in name:
            t = _permute(t, heads)
        elif arch in PERMUTED and ".self_attn.k_proj." in name:
            t = _permute(t, kv_heads)
        if new.endswith("_exps.weight"):
            kind = down if (down and "ffn_down_exps" in new) else experts
        elif t.dim() >= 2 and new.endswith(".weight") and "gate_inp" not in new:  # routers, biases stay F32
            kind = dense
        else:
            kind = "F32"
        arr, raw = _encode(t, kind)
        w.add_tensor(new, arr, raw_dtype=raw)


def add_tokenizer(w: Any, folder: Path) -> None:
    """A byte-level BPE ``tokenizer.json`` as llama.cpp's ``_set_vocab_gpt2`` writes it (pre type ``gpt-2``: the
    plain GPT-2 split)."""
    tj = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tj["model"]["vocab"])
    added = {t["content"]: t for t in tj.get("added_tokens", [])}
    for t in added.values():
        vocab[t["content"]] = t["id"]
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [4] * size  # holes: user-defined padding, as the converter writes them
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = (3 if added[tok].get("special") else 4) if tok in added else 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    for key, setter in (("eos_token", w.add_eos_token_id), ("pad_token", w.add_pad_token_id),
                        ("bos_token", w.add_bos_token_id)):
        if cfg.get(key):
            setter(vocab[cfg[key]])
    w.add_add_bos_token(bool(cfg.get("add_bos_token", False)))
    if cfg.get("chat_template"):
        w.add_chat_template(cfg["chat_template"])
