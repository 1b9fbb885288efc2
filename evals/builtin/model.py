"""The architecture of the built-in model: a small ``qwen3_moe`` (every layer MoE, top-2 routing)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSize:
    """The knobs of the built-in architecture; everything else is fixed Qwen3-MoE behaviour."""

    hidden: int = 256
    """Residual width."""
    layers: int = 6
    """Decoder layers, all of them MoE."""
    heads: int = 4
    """Query heads (head_dim = 64)."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    experts: int = 16
    """Routed experts per layer."""
    top_k: int = 2
    """Experts chosen per token."""
    expert_hidden: int = 112
    """Intermediate width of one expert (SwiGLU)."""
    vocab: int = 8192
    """Tokenizer vocabulary size."""
    max_positions: int = 4096
    """``max_position_embeddings`` written to the config (RoPE, no learned positions)."""


def qwen3_moe_config(size: ModelSize, aux_loss_coef: float = 0.01) -> dict[str, Any]:
    """The ``config.json`` fields of a ``Qwen3MoeForCausalLM`` of this size (token ids fixed by the tokenizer)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": size.vocab,
        "hidden_size": size.hidden,
        "intermediate_size": 4 * size.hidden,  # unused: every layer is MoE (no mlp_only_layers)
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "head_dim": size.hidden // size.heads,
        "hidden_act": "silu",
        "max_position_embeddings": size.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": size.experts,
        "num_experts_per_tok": size.top_k,
        "moe_intermediate_size": size.expert_hidden,
        "norm_topk_prob": True,
        "router_aux_loss_coef": aux_loss_coef,
        "output_router_logits": False,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": 2,   # <|im_end|>
        "pad_token_id": 0,   # <|endoftext|>
        "initializer_range": 0.02,
    }


def build_model(size: ModelSize, seed: int, aux_loss_coef: float = 0.01):  # -> Qwen3MoeForCausalLM
    """A freshly initialized fp32 model (deterministic for a given seed)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**qwen3_moe_config(size, aux_loss_coef))).float()


def describe(size: ModelSize) -> dict[str, Any]:
    """The size as a plain dict (logged with every checkpoint)."""
    return asdict(size)


def load_model(folder, aux_loss_coef: float = 0.01):  # -> tuple[Qwen3MoeForCausalLM, ModelSize]
    """A shipped (or any exported) folder's model in fp32, to continue training it, and its :class:`ModelSize`."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).float()
    model.config.router_aux_loss_coef = aux_loss_coef
    c = model.config
    size = ModelSize(hidden=c.hidden_size, layers=c.num_hidden_layers, heads=c.num_attention_heads,
                     kv_heads=c.num_key_value_heads, experts=c.num_experts, top_k=c.num_experts_per_tok,
                     expert_hidden=c.moe_intermediate_size, vocab=c.vocab_size, max_positions=c.max_position_embeddings)
    return model, size
