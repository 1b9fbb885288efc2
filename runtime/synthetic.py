"""Synthetic checkpoints with RANDOM weights, written as ordinary Hugging Face folders.

They let the engine run end to end on a fresh machine with no download (``--model synthetic:qwen3_moe``) and give
benchmarks real shapes. The text they generate is gibberish by construction; the CLI says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.model.adapters import spec_from_config
from freetoken_agent.runtime.model.weights import expected_tensors

VERSION = 1
_BASE: dict[str, Any] = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, hidden_act="silu",
)
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=16,
                      num_experts_per_tok=2, moe_intermediate_size=128, head_dim=64, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=8,
                    num_experts_per_tok=2),
    "deepseek_v3": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], n_routed_experts=16,
                        num_experts_per_tok=2, moe_intermediate_size=128, kv_lora_rank=64, q_lora_rank=96,
                        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, num_key_value_heads=4,
                        n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True),
}
_CORPUS = """def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

class Stack:
    def __init__(self):
        self.items = []
    def push(self, item):
        self.items.append(item)
    def pop(self):
        return self.items.pop()

The agent reads the file, edits the function, and runs the tests until they pass.
import os, sys, json
for i in range(10):
    print(i, os.path.join("src", str(i)))
"""
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def cache_dir() -> Path:
    return Path(os.environ.get("FREETOKEN_CACHE", Path.home() / ".cache" / "freetoken"))


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer trained on a small built-in text, plus a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "add_bos_token": False, "chat_template": CHATML_TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_synthetic(arch: str, folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight checkpoint of a preset architecture into ``folder``."""
    if arch not in PRESETS:
        raise FreeTokenError(f"no synthetic preset {arch!r}; available: {', '.join(sorted(PRESETS))}")
    config = {**_BASE, **PRESETS[arch], **overrides}
    spec = spec_from_config(config)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_tensors(spec).items():
        if name.endswith(("norm.weight", "layernorm.weight")):
            tensors[name] = torch.ones(shape)
        elif name.endswith(("e_score_correction_bias", "sinks", ".bias")):
            tensors[name] = torch.zeros(shape)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            tensors[name] = torch.randn(shape, generator=gen) * (2.0 / fan_in) ** 0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, "synthetic": "random weights"}, indent=2))
    write_tokenizer(folder, int(config["vocab_size"]))
    return folder


def synthetic_model_dir(arch: str) -> Path:
    """The cached synthetic checkpoint of ``arch``, written on first use."""
    folder = cache_dir() / "synthetic" / f"{arch}-v{VERSION}"
    if not (folder / "model.safetensors").is_file():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        write_synthetic(arch, tmp)
        tmp.replace(folder) if not folder.exists() else None
    return folder
