"""``freetoken plan --validate``: build a random-weight checkpoint of the planned shape, time it, compare.

A model too big for a quick run here is scaled down first (fewer layers, fewer experts, then narrower), and the
report says how; the prediction compared is the one for the scaled shape, with the same rates. The run keeps
every weight in host memory (this machine's plan for small shapes); decode and prefill are timed with the
engine's own counters, in the same alternating rounds as a fresh calibration (``measure_with_calibration``), so
prediction and measurement see the same machine load; each model keeps its best round.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.execution import capacity


def write_random_checkpoint(config: dict[str, Any], folder: Path, seed: int = 0) -> Path:
    """A float32 safetensors folder with random weights of ``config``'s shape (no tokenizer)."""
    import torch
    from freetoken_agent.runtime.model.adapters import spec_from_config
    from freetoken_agent.runtime.model.weights import expected_tensors
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_tensors(spec_from_config(config)).items():
        if name.endswith(("norm.weight", "layernorm.weight")):
            tensors[name] = torch.ones(shape)
        elif len(shape) == 1:
            tensors[name] = torch.zeros(shape)
        else:
            tensors[name] = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


_UNWRITABLE = ("gpt_oss",)
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_WIDTH_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


def scale_down(config: dict[str, Any], max_params: int) -> tuple[dict[str, Any], list[str]]:
    """A config of at most ``max_params`` parameters with the same kind of layers, and what changed."""
    c, changes = dict(config), []

    def params() -> int:
        return capacity.model_size(c, "none").params

    if params() <= max_params:
        return c, changes
    if c.get("vocab_size", 0) > 8192:
        changes.append(f"vocab {c['vocab_size']} -> 8192")
        c["vocab_size"] = 8192
    dense_first = int(c.get("first_k_dense_replace") or 0)
    layers = min(int(c["num_hidden_layers"]), 4 + min(dense_first, 1))
    if layers < c["num_hidden_layers"]:
        changes.append(f"layers {c['num_hidden_layers']} -> {layers}")
        c["num_hidden_layers"] = layers
        if dense_first:
            c["first_k_dense_replace"] = 1
        if c.get("layer_types"):
            c["layer_types"] = c["layer_types"][:layers]
    for key in _EXPERT_KEYS:
        if c.get(key) and params() > max_params and c[key] > 16:
            changes.append(f"experts {c[key]} -> 16")
            c[key] = 16
            if c.get("n_group", 1) > 1:
                c["n_group"], c["topk_group"] = 1, 1
    hidden = c["hidden_size"]
    while params() > max_params and c["hidden_size"] > 128:
        for key in _WIDTH_KEYS:
            if c.get(key):
                c[key] = max(32, c[key] // 2)
        heads = int(c["num_attention_heads"])
        if c.get("head_dim") is None and c["hidden_size"] // heads < 16:
            c["num_attention_heads"] = heads = max(1, heads // 2)
            kv = c.get("num_key_value_heads")
            if isinstance(kv, int) and kv > 0 and heads % kv:  # each KV head keeps a whole group of query heads
                c["num_key_value_heads"] = math.gcd(heads, kv)
    if c["hidden_size"] != hidden:
        changes.append(f"widths / {hidden // c['hidden_size']} (hidden {hidden} -> {c['hidden_size']})")
    return c, changes


def validate(config: dict[str, Any], quant: str = "q4", threads: int = 1, prompt_len: int = 64, tokens: int = 16,
             max_params: int = 150_000_000, rounds: int = 5) -> dict[str, Any]:
    """Predicted vs measured decode and prefill tok/s for ``config`` (scaled to ``max_params``).

    The rates are calibrated afresh in the same alternating rounds as the measurement (so both see the same load).
    """
    return validate_many({"model": config}, quant, threads, prompt_len, tokens, max_params, rounds)["model"]


def validate_many(configs: dict[str, dict[str, Any]], quant: str = "q4", threads: int = 1, prompt_len: int = 64,
                  tokens: int = 16, max_params: int = 150_000_000, rounds: int = 5) -> dict[str, dict[str, Any]]:
    """``validate`` for several configs, measured together with one calibration."""
    from freetoken_agent.runtime.execution.capacity_calibrate import (
        measure_with_calibration,
    )

    for name, cfg in configs.items():
        if cfg.get("model_type") in _UNWRITABLE:
            raise FreeTokenError(f"--validate cannot build a random {cfg['model_type']} checkpoint yet (fused expert "
                                 f"layout); the plan itself does not need one")
    scaled = {name: scale_down(cfg, max_params) for name, cfg in configs.items()}
    extra = {n: c for n, (c, _) in scaled.items()}
    rates, timings = measure_with_calibration(extra, threads, quant, rounds, tokens)
    out = {}
    for name, (cfg, changes) in scaled.items():
        size = capacity.model_size(cfg, quant)
        dec = capacity.plan(size, rates, None, None, prompt_len + tokens, quant=quant)
        pre = capacity.plan(size, rates, None, None, prompt_len, quant=quant, prefill_chunk=prompt_len)
        dec_s, pre_s = timings[name]
        measured = {"decode_tok_s": 1 / dec_s, "prefill_tok_s": 1 / pre_s}
        pred = {"decode_tok_s": dec.decode_tok_s, "prefill_tok_s": pre.prefill_tok_s}
        out[name] = {
            "scaled": changes, "params": size.params, "quant": quant, "threads": threads,
            "predicted": {k: round(v, 2) for k, v in pred.items()},
            "measured": {k: round(v, 2) for k, v in measured.items()},
            "error": {k: round(pred[k] / measured[k] - 1, 3) for k in pred},
            "decode_bound": dec.decode_bound, "prefill_bound": pre.prefill_bound,
        }  # fmt: skip
    return out


def format_validation(v: dict[str, Any]) -> str:
    lines = [f"validate: {v['params'] / 1e6:.1f}M params, {v['quant']}, {v['threads']} thread(s)"
             + (f" (scaled down: {', '.join(v['scaled'])})" if v["scaled"] else "")
]
    for k, label in (("decode_tok_s", "decode "), ("prefill_tok_s", "prefill")):
        lines.append(f"  {label} predicted {v['predicted'][k]:9.2f} tok/s, measured {v['measured'][k]:9.2f} tok/s, "
                     f"error {v['error'][k]:+.0%}")
    return "\n".join(lines)
