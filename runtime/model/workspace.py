"""The working memory of one engine step, bounded from the model's shapes.

A forward pass allocates and frees tensors beyond the weights and the KV pool: the residual stream and the
activations of the layer it is in, one block of attention scores, the keys and values of one layer gathered from
the paged pool (widened to fp32 where the pool is 16-bit), one pass of the fused MoE kernel's work buffers, the
router's scores, and the logits of the rows that are sampled. Under a memory budget this is set aside before the
expert pool is sized (the ``step`` reservation, ``runtime/experts/setup.py``), so the process stays inside the budget
plus ``runtime.memory.PROCESS_FLOOR_MB`` during prefill and decode, not only at rest.

``step_bytes`` is an upper bound built from the code's own sizes (``CAUSAL_BLOCK_BYTES``, the kernels' MoE pass
bytes); ``tests/runtime/test_workspace.py`` measures a step's peak resident growth against it.
"""

from __future__ import annotations

from .spec import ModelSpec

F32 = 4

PREFILL_CHUNK = 512
"""Tokens per scheduler step (decode tokens of running sequences + prefill chunks): bounds the attention score
matrix, a step's working memory (``step_bytes``) and how long one step keeps other sessions waiting."""

LIVE_ACTIVATIONS = 8
"""[T, hidden] fp32 tensors alive at once in a layer (measured: ~8 in a GQA layer of a hidden-2048 model during a
512-token chunk: residual, normed input, q, attention output, projections, norms), besides its widest projection
output (q|k|v, or a dense MLP's gate|up)."""

MAX_CONTEXT = 32768
"""Positions whose gathered keys and values are set aside (a longer context's prefill gathers more than this)."""

SCORE_BLOCKS = 2
"""Attention score blocks of ``CAUSAL_BLOCK_BYTES`` alive at once (the scores and their softmax)."""

MOE_PASS_BYTES = 12 << 20
"""The fused MoE kernel's work buffers for one pass (``ft_moe.h``: ``FT_MOE_PASS_BYTES``)."""

SAMPLED_ROWS = 64
"""Rows of logits one step may sample (decode rows of a batch plus draft rows); each takes the logits and one
working copy (temperature, softmax)."""


def _layer_widths(spec: ModelSpec) -> tuple[int, int, int, int, int, int]:
    """Over the model's layers: (widest projection output per token, widest per-position K+V of one layer in fp32
    after expansion, most query heads, most experts, widest expert intermediate, largest top-k)."""
    width = kv = heads = experts = inter = top_k = 0
    for layer in spec.layers:
        a = layer.attention
        if a is not None:
            if a.kind == "mla":  # the latent expanded into per-head keys and values for a prefill chunk
                per_pos = a.num_heads * (a.qk_nope_dim + a.qk_rope_dim + a.v_head_dim)
                q = a.num_heads * (a.qk_nope_dim + a.qk_rope_dim)
            else:
                per_pos = a.num_kv_heads * (a.head_dim + a.v_head_dim)
                q = a.num_heads * a.head_dim
            width, kv, heads = max(width, q + per_pos), max(kv, per_pos), max(heads, a.num_heads)
        for mlp in (layer.mlp, layer.moe.shared if layer.moe is not None else None):
            if mlp is not None:
                width = max(width, 2 * mlp.intermediate)
        if layer.moe is not None:
            m = layer.moe
            experts, inter, top_k = max(experts, m.num_experts), max(inter, m.intermediate), max(top_k, m.top_k)
    return width, kv, heads, experts, inter, top_k


def step_bytes(spec: ModelSpec, tokens: int = PREFILL_CHUNK, context: int | None = None) -> int:
    """Upper bound on the bytes one step allocates beyond weights and KV pool: ``tokens`` rows in the step (the
    prefill chunk), attending over up to ``context`` positions (default: the model's context, up to
    ``MAX_CONTEXT``)."""
    from freetoken_agent.runtime.model.layers import CAUSAL_BLOCK_BYTES

    context = min(spec.max_position if context is None else context, MAX_CONTEXT)
    width, kv, heads, experts, inter, top_k = _layer_widths(spec)
    d = spec.hidden_size
    activations = (LIVE_ACTIVATIONS * d + width) * tokens * F32
    # score blocks: as many queries as fit CAUSAL_BLOCK_BYTES (at least one row of every head)
    row = heads * context * F32
    scores = max(row, min(CAUSAL_BLOCK_BYTES, tokens * row))
    # keys + values of one layer gathered from the pool: an fp32 copy, or a 16-bit copy and its fp32 widening
    attention = SCORE_BLOCKS * scores + 3 * context * kv * F32 // 2
    # one pass of the fused MoE kernel (whole experts: at least one expert's tokens) + its int8 input, its output and
    # the routed copy of x; router logits, scores and top-k
    per_slot = F32 * (2 * inter + d) + inter + 8 * (inter // 32 + 1)
    moe_pass = max(tokens * per_slot, min(MOE_PASS_BYTES, tokens * top_k * per_slot))
    moe = moe_pass + tokens * d * (1 + 2 * F32) + 3 * tokens * experts * F32
    logits = 2 * min(tokens, SAMPLED_ROWS) * spec.vocab_size * F32
    return activations + max(attention, moe) + logits
