"""Dense building blocks of the generic decoder: RMSNorm, gated MLP, GQA and MLA attention.

Legend: T new tokens, S cached + new positions, D hidden, H query heads, Hkv key/value heads, G = H / Hkv,
Dh query/key head dim, Dv value head dim. Weights are plain dicts of tensors named after the checkpoint's leaves.

With ``ops.set_deterministic(True)`` every op here that mixes rows or keys goes through ``kernels/invariant.py``
(a row's bits then never depend on the batch or the chunking; that module lists what is invariant anyway).
"""

from __future__ import annotations

from collections.abc import Callable

from typing import NamedTuple

import torch
import torch.nn.functional as F
from freetoken_agent.runtime.kernels import invariant
from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.model.indexer import (
    block_index_qk,
    block_keep,
    indexer_keys,
    topk_keep,
)
from freetoken_agent.runtime.model.activations import activation_fn, params_in
from freetoken_agent.runtime.model.linear import dense_linear, on_kernels
from freetoken_agent.runtime.model.rope import Rotary
from freetoken_agent.runtime.model.spec import AttentionSpec, MLPSpec

Weights = dict[str, torch.Tensor]
F32 = torch.float32



def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in fp32, cast back, scale (HF order). fp32 goes through the C kernel where the kernels are loaded,
    for every size: one fused op instead of six (a decode step runs ~4 per layer, and at one token each op is
    mostly dispatch overhead: six ops 41 us, ``F.rms_norm`` 11-15 us, the C kernel 5 us), 2-3x faster than
    ``F.rms_norm`` on a 512-token prefill too (rows on the pool), and each row reduced in one fixed order (batch
    invariant by default). Deterministic mode: the C kernel for every dtype and layout too."""
    if x.dtype is F32 and weight.dtype is F32 and weight.shape == x.shape[-1:]:
        if x.is_contiguous() and x.is_cpu and kops.fast() is not None:
            return kops.rms_norm(x, weight, eps)
        if not kops.deterministic():
            return F.rms_norm(x, weight.shape, weight, eps)
    if kops.deterministic():
        return invariant.rms_norm(x, weight, eps)
    return weight * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Mean-centred LayerNorm, computed in fp32 (Cohere without bias, PhiMoE with)."""
    if kops.deterministic():
        return invariant.layer_norm(x, weight, eps, bias)
    h = x.float()
    h = h - h.mean(-1, keepdim=True)
    h = weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))
    return (h if bias is None else h + bias.float()).to(x.dtype)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    if kops.deterministic():
        return invariant.rms_norm(x, None, eps)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def mixer_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A recurrent mixer's product: ``F.linear`` (the recurrences amplify a change of summation order past the
    oracle's 1e-4 on published configs), ``dense_linear`` in deterministic mode, where a row must not depend on
    the batch it came in."""
    return dense_linear(x, weight, bias) if kops.deterministic() else F.linear(x, weight, bias)


def projections(x: torch.Tensor, w: Weights, names: tuple[str, ...]) -> list[torch.Tensor]:
    """``[linear(x, w, name) for name in names]``; when every one of them would run on the kernels' fp32 linear,
    they run as one call (``ops.linear_f32_parts``: one hand-out to the pool instead of one per weight, the same
    bits), and so do quantized weights laid out back to back (``FusedRows``)."""
    weights = [w[f"{name}.weight"] for name in names]
    biases = [w.get(f"{name}.bias") for name in names]
    fused = getattr(weights[0], "fused", None)  # quantized weights back to back (runtime/kernels/dense.py)
    if (fused is not None and len(fused.parts) == len(weights) and all(a is b for a, b in zip(fused.parts, weights))
            and all(b is None for b in biases) and all(q.exact is None for q in fused.parts)):
        return fused(x)
    if len(names) <= 4 and all(
        isinstance(wt, torch.Tensor) and (b is None or isinstance(b, torch.Tensor)) and on_kernels(x, wt, b)
        for wt, b in zip(weights, biases)
    ):
        return kops.linear_f32_parts(tuple(weights), x, tuple(biases))
    return [linear(x, w, name) for name in names]


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an activation or gate; in deterministic mode with no value on torch's scalar tail."""
    return invariant.pointwise(fn, x) if kops.deterministic() else fn(x)


def linear(x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
    weight = w[f"{name}.weight"]
    if isinstance(weight, torch.Tensor):
        return dense_linear(x, weight, w.get(f"{name}.bias"))
    return weight(x, w.get(f"{name}.bias"))  # a quantized dense weight (runtime/kernels/dense.py)


def mlp(x: torch.Tensor, w: Weights, spec: MLPSpec) -> torch.Tensor:
    """Gated MLP: down(act(gate(x)) * up(x)) (times a learned scalar with ``out_scale``)."""
    if spec.out_scale:
        return _mlp(x, w, spec) * w["global_scale"]
    return _mlp(x, w, spec)


def _mlp(x: torch.Tensor, w: Weights, spec: MLPSpec) -> torch.Tensor:
    act = activation_fn(spec.activation, params_in(w))
    if not spec.gated:
        return linear(elementwise(act, linear(x, w, "up_proj")), w, "down_proj")
    if spec.fused:
        gate, up = linear(x, w, "input_linear").chunk(2, dim=-1)
        if spec.activation == "swiglu_oai":
            gate, up = gate.clamp(max=spec.swiglu_limit), up.clamp(-spec.swiglu_limit, spec.swiglu_limit)
            glu = gate * elementwise(torch.sigmoid, gate * spec.swiglu_alpha)
            return linear((up + 1.0) * glu, w, "output_linear")
        return linear(elementwise(act, gate) * up, w, "output_linear")
    gate, up = projections(x, w, ("gate_proj", "up_proj"))
    if spec.glu_clamp:  # DeepSeek-V4's shared expert: gate clamped from above, up on both sides
        gate, up = gate.clamp(max=spec.swiglu_limit), up.clamp(-spec.swiglu_limit, spec.swiglu_limit)
    return linear(elementwise(act, gate) * up, w, "down_proj")


EAGER_ATTENTION_TOKENS = 16
"""Up to this many query tokens (decode steps, short chunks), attention is two batched matmuls and a softmax:
torch's CPU ``scaled_dot_product_attention`` costs 15-40x more for one query (measured: 0.36 vs 15.8 ms over 512
cached keys with GQA, 0.9 vs 16-75 ms over 2048; ``evals/perf/RESULTS.md``), while for long prompts it is on par
and never materializes the [H, T, S] scores."""


def attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    spec: AttentionSpec,
    sinks: torch.Tensor | None,
    keep: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, H, Dh] over k [S, Hkv, Dh], v [S, Hkv, Dv] → [T, H*Dv]; ``keep`` [T, S] (or
    [Hkv, T, S]) further restricts which keys each query sees (sparse attention), ``key_bias`` [S, Hkv] (Doge).

    k and v may be a 16-bit KV cache (fp16/bf16) under fp32 queries: decode steps and short chunks read it as is
    (the C kernels; without them, ``_one_query_attention`` widens one block of keys at a time), other shapes widen
    it to q's dtype first (a prefill's attention costs far more than that copy)."""
    if kops.deterministic():
        return _invariant_attention(q, k, v, q_pos, spec, sinks, keep, key_bias)
    if k.dtype != q.dtype:
        if q.dtype == torch.float32:
            return _attention_16(q, k, v, q_pos, spec, sinks, keep, key_bias)
        k, v = k.to(q.dtype), v.to(q.dtype)  # e.g. an fp16 cache under a bf16 model
    return _attention(q, k, v, q_pos, spec, sinks, keep, key_bias)


def _key_ranges(q_pos: torch.Tensor, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """[lo, hi) of the keys each query sees (causal, sliding window, chunked attention), int64 [T] each."""
    hi = q_pos.to(torch.int64) + 1  # query at p sees keys < p + 1
    lo = torch.zeros_like(hi)
    if spec.sliding_window is not None:
        lo = (hi - spec.sliding_window).clamp(min=0)
    if spec.chunk_size is not None:
        lo = torch.maximum(lo, q_pos.to(torch.int64) // spec.chunk_size * spec.chunk_size)
    return lo, hi


def _kernel_layout(k: torch.Tensor, v: torch.Tensor) -> bool:
    """k [S, Hkv, Dh] / v [S, Hkv, Dv] as the C attention kernels take them: CPU, one of their dtypes, contiguous
    heads (any stride between positions)."""
    return (
        k.device.type == "cpu" and k.dtype == v.dtype and k.dtype in kops.KV_TYPE_CODE
        and k.stride()[1:] == (k.shape[2], 1) and v.stride()[1:] == (v.shape[2], 1)
    )  # fmt: skip


def _attention_16(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    spec: AttentionSpec,
    sinks: torch.Tensor | None,
    keep: torch.Tensor | None,
    key_bias: torch.Tensor | None,
) -> torch.Tensor:
    """``_attention`` over a 16-bit cache under fp32 queries (same arguments). Up to ``EAGER_ATTENTION_TOKENS``
    queries with a key range each (causal, window, chunk, sinks) go through the C kernel reading the cache as is;
    a decode step without the kernels widens it block by block; anything else widens it once."""
    t, s = q.shape[0], v.shape[0]
    plain = keep is None and key_bias is None and spec.sliding_window is None and spec.chunk_size is None
    if plain and t == 1 and (q.device.type != "cpu" or int(q_pos[0]) >= s - 1):
        return _one_query_attention(q, k, v, spec.scale, sinks, _unread(q, q_pos))
    # a bf16 cache on AMX tiles (opt-in): every chunk in the one C call, faster than widening the cache for torch's
    # fused attention (512-query chunks over 2-8k keys: 29-131 vs 71-167 ms) and each query's bits its own
    amx = kops.fast() is not None and kops.attn_uses_amx(k.dtype, k.shape[2], v.shape[2])
    short = _short_row_attention(q, k, v, q_pos, spec, sinks, keep, key_bias, t if amx else EAGER_ATTENTION_TOKENS)
    if short is not None:
        return short
    return _attention(q, k.to(q.dtype), v.to(q.dtype), q_pos, spec, sinks, keep, key_bias)


def _short_row_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    spec: AttentionSpec,
    sinks: torch.Tensor | None,
    keep: torch.Tensor | None,
    key_bias: torch.Tensor | None,
    limit: int,
) -> torch.Tensor | None:
    """Up to ``limit`` fp32 queries with a key range each (causal, window, chunk, sinks) in one C call over the
    cache as it is stored (fp32 or 16-bit): flash decoding split over the pool, each key and value read once for
    the kv head's query heads and the row's queries, no score matrix, no mask. None where the kernels cannot (no
    library, another mask, another layout or dtype)."""
    t = q.shape[0]
    if (keep is not None or key_bias is not None or t > limit or q.dtype != torch.float32
            or q.device.type != "cpu" or not _kernel_layout(k, v) or kops.fast() is None):
        return None
    lo, hi = _key_ranges(q_pos, spec)
    return kops.attn_queries(q.contiguous(), k, v, lo, hi, spec.scale, sinks).view(t, q.shape[1] * v.shape[2])


def _invariant_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    spec: AttentionSpec,
    sinks: torch.Tensor | None,
    keep: torch.Tensor | None,
    key_bias: torch.Tensor | None,
) -> torch.Tensor:
    """``attention_scores`` with each query computed exactly as if it were decoded alone over its visible keys.

    A key range per query (causal, sliding window, chunked attention; fp32 on the CPU) runs in one C call that
    treats every query as a decode step (``ops.attn_queries``); other masks and dtypes run one torch call per query
    over keys ``0..p`` — the shapes a decode step at position p has.
    """
    t, h, dh = q.shape
    dv = v.shape[2]
    if keep is None and key_bias is None and q.dtype == k.dtype == v.dtype == torch.float32 and q.device.type == "cpu":
        hi = q_pos.to(torch.int64) + 1  # [T]: query at p sees keys < p + 1
        lo = torch.zeros_like(hi)
        if spec.sliding_window is not None:
            lo = (hi - spec.sliding_window).clamp(min=0)
        if spec.chunk_size is not None:
            lo = torch.maximum(lo, q_pos.to(torch.int64) // spec.chunk_size * spec.chunk_size)
        k = k if k.stride()[1:] == (dh, 1) else k.contiguous()
        v = v if v.stride()[1:] == (dv, 1) else v.contiguous()  # MLA: values are a slice of each head's row
        return kops.attn_queries(q.contiguous(), k, v, lo, hi, spec.scale, sinks).view(t, h * dv)
    k, v = k.to(q.dtype), v.to(q.dtype)  # a 16-bit cache under other queries: widened
    outs = []
    for i, p in enumerate(q_pos.tolist()):
        seen = p + 1
        keep_i = None if keep is None else keep[..., i : i + 1, :seen]
        bias_i = None if key_bias is None else key_bias[:seen]
        outs.append(_attention(q[i : i + 1], k[:seen], v[:seen], q_pos[i : i + 1], spec, sinks, keep_i, bias_i))
    return torch.cat(outs)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    spec: AttentionSpec,
    sinks: torch.Tensor | None,
    keep: torch.Tensor | None,
    key_bias: torch.Tensor | None,
) -> torch.Tensor:
    """``attention_scores``' fast paths (its arguments); not batch invariant."""
    t, h, dh = q.shape
    s, hkv, dv = v.shape
    g = h // hkv
    plain = keep is None and key_bias is None and spec.sliding_window is None and spec.chunk_size is None
    if plain and t == 1 and (q.device.type != "cpu" or int(q_pos[0]) >= s - 1):  # a decode step: no mask to
        # build where it sees every cached key (on an accelerator, keys past it masked without reading it back)
        return _one_query_attention(q, k, v, spec.scale, sinks, _unread(q, q_pos))
    short = _short_row_attention(q, k, v, q_pos, spec, sinks, keep, key_bias, SHORT_ROW_TOKENS)
    if short is not None:
        return short
    if plain and sinks is None:
        return _causal_attention(q, k, v, q_pos, spec.scale)
    k_pos = torch.arange(s, device=q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]  # [T, S]
    if spec.sliding_window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - spec.sliding_window
    if spec.chunk_size is not None:
        allowed &= (k_pos[None, :] // spec.chunk_size) == (q_pos[:, None] // spec.chunk_size)
    if keep is not None:
        if keep.dim() == 3:  # per KV head [Hkv, T, S] → per query head
            allowed = allowed & keep.repeat_interleave(h // keep.shape[0], dim=0)
        else:
            allowed &= keep
    mask: torch.Tensor = allowed
    if key_bias is not None:  # Doge: per-key bias [S, Hkv] for every query head of the group
        bias = key_bias.T.repeat_interleave(g, dim=0)[:, None, :].to(q.dtype).expand(h, t, s)  # [H, T, S]
        allowed = allowed.expand(h, t, s)
        if s > spec.keep_window:
            ranked = bias.masked_fill(~allowed, torch.finfo(bias.dtype).min)
            top = ranked.topk(spec.keep_window, dim=-1).indices
            allowed = allowed & torch.zeros_like(allowed).scatter_(-1, top, True)
        mask = bias.masked_fill(~allowed, float("-inf"))
    if sinks is None and t > EAGER_ATTENTION_TOKENS:
        # fused kernel: no [H, T, S] score tensor is materialized twice
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=spec.scale,
            enable_gqa=g > 1,
        )  # [H, T, Dv]
        return out.transpose(0, 1).reshape(t, h * dv)
    qg = q.reshape(t, hkv, g, dh).permute(1, 2, 0, 3).reshape(hkv, g * t, dh)  # [Hkv, G*T, Dh]
    scores = torch.matmul(qg, k.permute(1, 2, 0)).view(h, t, s) * spec.scale  # [H, T, S]
    if key_bias is not None:
        scores = scores + mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    else:
        sink = sinks.to(scores.dtype).view(h, 1, 1).expand(h, t, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1].to(v.dtype)
    out = torch.matmul(probs.view(hkv, g * t, s), v.permute(1, 0, 2))  # [Hkv, G*T, Dv]
    return out.view(hkv, g, t, dv).permute(2, 0, 1, 3).reshape(t, h * dv)


SHORT_ROW_TOKENS = 8
"""Up to this many queries over an fp32 cache (a verify row of speculative decoding: the last token and up to 7
drafts; a short chunk), attention is the C kernel's one call rather than torch's matmuls, mask and softmax.
Measured on the AMX Xeon, 2 threads, kernel vs ``_causal_attention`` (``evals/perf/RESULTS.md``): 1.1-2.0x faster
at 2 queries, 1.0-1.6x at 4, 0.8-1.2x at 8, 0.5-0.9x at 16 over 512-4096 keys with 32/4, 16/16 and 4/2 heads."""

CAUSAL_BLOCK_BYTES = 8 << 20
"""Scores per query block of ``_causal_attention`` (fp32): small enough to stay in cache between the two matmuls."""


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention q [T, H, Dh] over k [S, Hkv, Dh], v [S, Hkv, Dv] → [T, H*Dv], in query blocks.

    Two batched matmuls and a softmax per block of queries whose [H, Tb, S] scores fit ``CAUSAL_BLOCK_BYTES``; the
    scale is folded into q, and when the queries are the last T positions (a prompt, or a suffix after a cached
    prefix) only the [Tb, T] tail of each block is masked. Measured against torch's CPU SDPA (1 thread, 16/4
    heads of 128): equal on a 512-token prompt, 1.7-2.1x faster for 256-717 new tokens after 2-5k cached ones.
    """
    t, h, dh = q.shape
    s, hkv, dv = v.shape
    g = h // hkv
    kt, vh = k.permute(1, 2, 0), v.permute(1, 0, 2)  # [Hkv, Dh, S], [Hkv, S, Dv]
    first = int(q_pos[0])
    suffix = first == s - t and int(q_pos[-1]) == s - 1
    block = max(1, min(t, CAUSAL_BLOCK_BYTES // (h * s * 4)))
    out = torch.empty(t, h, dv, dtype=v.dtype, device=q.device)
    for a in range(0, t, block):
        b = min(t, a + block)
        tb = b - a
        qb = (q[a:b] * scale).reshape(tb, hkv, g, dh).permute(1, 2, 0, 3).reshape(hkv, g * tb, dh)
        scores = torch.matmul(qb, kt).view(hkv, g, tb, s)
        if suffix:  # query a + i sits at key position first + a + i: it must not see keys after that
            lo = first + a + 1
            if lo < s:
                tail = torch.ones(tb, s - lo, dtype=torch.bool, device=q.device).triu_()
                scores[..., lo:].masked_fill_(tail, float("-inf"))
        else:
            seen = torch.arange(s, device=q.device)[None, :] <= q_pos[a:b, None]
            scores.masked_fill_(~seen, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        del scores  # a block's scores and probabilities are the step's biggest tensors: never two blocks' at once
        o = torch.matmul(probs.view(hkv, g * tb, s), vh)  # [Hkv, G*Tb, Dv]
        del probs
        out[a:b] = o.view(hkv, g, tb, dv).permute(2, 0, 1, 3).reshape(tb, h, dv)
    return out.reshape(t, h * dv)


def _unread(q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor | None:
    """A lone query's position, for ``_one_query_attention`` to mask later keys with, where it was not read back to
    the host: on an accelerator reading it waits for every op queued before (a sync per layer of a decode step)."""
    return None if q.device.type == "cpu" else q_pos


def _one_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sinks: torch.Tensor | None,
    q_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [1, H, Dh] over every key of k [S, Hkv, Dh], v [S, Hkv, Dv] → [1, H*Dv]; with ``q_pos`` ([1], on q's
    device) over the keys up to it (the rest masked). Where the kernels are loaded an fp32 cache, or a 16-bit one
    under fp32 queries, goes through their split-over-keys kernel on the pool (``ft_attn.h``): torch runs both matmuls
    on one thread through a permuted copy of K. Without them a 16-bit cache is widened one block of keys at a time
    (``_blocked_one_query``)."""
    h, dh = q.shape[1:]
    s, hkv, dv = v.shape
    if q_pos is None and q.dtype == torch.float32 and _kernel_layout(k, v) and kops.fast() is not None:
        return kops.attn_decode(q.reshape(h, dh).contiguous(), k, v, scale, sinks).view(1, h * dv)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return _blocked_one_query(q, k, v, scale, sinks, q_pos)
    scores = torch.matmul(q.view(hkv, h // hkv, dh), k.permute(1, 2, 0)).view(h, s) * scale  # [H, S]
    if q_pos is not None:
        scores = scores.masked_fill(torch.arange(s, device=q.device) > q_pos, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    else:
        probs = torch.softmax(torch.cat([scores, sinks.to(scores.dtype).view(h, 1)], dim=-1).float(), dim=-1)
        probs = probs[:, :-1].to(v.dtype)
    out = torch.matmul(probs.view(hkv, h // hkv, s), v.permute(1, 0, 2))  # [Hkv, G, Dv]
    return out.reshape(1, h * dv)


WIDEN_BLOCK = 1024
"""Keys a 16-bit cache is widened by at a time when no kernel reads it (the torch fallback of a decode step)."""


def _blocked_one_query(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sinks: torch.Tensor | None,
    q_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """``_one_query_attention`` over a cache in another dtype than q (a 16-bit KV pool without the C kernels): each
    block of ``WIDEN_BLOCK`` keys and values is widened to fp32 and folded into a running max, exp-sum and
    weighted value sum (the flash-decoding merge), so no fp32 copy of the whole cache is made."""
    h, dh = q.shape[1:]
    s, hkv, dv = v.shape
    g = h // hkv
    qg = q.reshape(hkv, g, dh).float()
    m = torch.full((hkv, g, 1), float("-inf"), device=q.device)
    den = torch.zeros(hkv, g, 1, device=q.device)
    acc = torch.zeros(hkv, g, dv, device=q.device)
    for a in range(0, s, WIDEN_BLOCK):
        kb, vb = k[a : a + WIDEN_BLOCK].float(), v[a : a + WIDEN_BLOCK].float()
        scores = torch.matmul(qg, kb.permute(1, 2, 0)) * scale  # [Hkv, G, b]
        if q_pos is not None:  # keys past the query masked (block 0 holds key 0: the running max stays finite)
            scores = scores.masked_fill(torch.arange(a, a + kb.shape[0], device=q.device) > q_pos, float("-inf"))
        top = torch.maximum(m, scores.amax(-1, keepdim=True))
        fade, p = torch.exp(m - top), torch.exp(scores - top)
        den = den * fade + p.sum(-1, keepdim=True)
        acc = acc * fade + torch.matmul(p, vb.permute(1, 0, 2))  # [Hkv, G, Dv]
        m = top
    if sinks is not None:  # one more logit per head, carrying no value
        sink = sinks.float().view(hkv, g, 1)
        top = torch.maximum(m, sink)
        fade = torch.exp(m - top)
        den, acc = den * fade + torch.exp(sink - top), acc * fade
    return (acc / den).to(q.dtype).reshape(1, h * dv)


def position_scaled(q: torch.Tensor, positions: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """Llama-4-style long-context query scaling (identity when ``q_scale_beta`` is 0)."""
    if spec.q_scale_power > 0 and spec.q_scale_beta <= 0:
        growth = elementwise(torch.log1p, (positions.float() + spec.q_scale_offset) / spec.q_scale_period)
        scale = elementwise(torch.exp, spec.q_scale_power * growth)
        return q * scale.to(q.dtype)[:, None, None]
    if spec.q_scale_beta <= 0:
        return q
    steps = torch.floor((positions.float() + spec.q_scale_offset) / spec.q_scale_period)
    scale = 1 + spec.q_scale_beta * elementwise(torch.log1p, steps)
    return q * scale.to(q.dtype)[:, None, None]


class Span(NamedTuple):
    """One sequence's rows ``[start, end)`` of a batched mixer call, its cache and positions [end - start]."""

    start: int
    end: int
    cache: KVCache
    positions: torch.Tensor
    decode: bool = False
    """The rows are a decode token and its speculative drafts (``Decoder.forward_batch``'s ``decode_rows``)."""


def gqa_attention(
    x: torch.Tensor, w: Weights, spec: AttentionSpec, rotary: Rotary | None, layer: int, cache: KVCache | None,
    positions: torch.Tensor, eps: float, spans: list[Span] | None = None,
) -> torch.Tensor:
    """x [T, D] → [T, D]. With ``spans`` (a batch of sequences, rows in span order, ``positions`` every row's), the
    projections, norms and RoPE run once over all T rows — each weight read once per step — and only the cache append
    and the attention itself run per sequence; without, the rows are one sequence in ``cache``."""
    t = x.shape[0]
    if spec.k_eq_v:  # Gemma 4 full layers: the raw keys are the values
        q, k = projections(x, w, ("q_proj", "k_proj"))
        v = k
    else:
        q, k, v = projections(x, w, ("q_proj", "k_proj", "v_proj"))
    gate = None
    if spec.q_gate:  # per head [query | gate]
        q, gate = q.view(t, spec.num_heads, 2 * spec.head_dim).chunk(2, dim=-1)
        q, gate = q.reshape(t, -1), gate.reshape(t, -1)
    if spec.qk_norm == "full":
        q, k = rms_norm(q, w["q_norm.weight"], eps), rms_norm(k, w["k_norm.weight"], eps)
    if spec.clip_qkv is not None:
        q, k, v = (z.clamp(-spec.clip_qkv, spec.clip_qkv) for z in (q, k, v))
    q = q.view(t, spec.num_heads, spec.head_dim)
    k = k.view(t, spec.num_kv_heads, spec.head_dim)
    v = v.view(t, spec.num_kv_heads, spec.v_head_dim)
    if spec.v_norm:
        v = unit_rms_norm(v, eps)
    if spec.v_scale != 1.0:
        v = v * spec.v_scale
    if spec.qk_norm == "head" and not spec.qk_norm_after_rope:
        q, k = rms_norm(q, w["q_norm.weight"], eps), rms_norm(k, w["k_norm.weight"], eps)
    if rotary is not None:
        cos, sin = rotary.cos_sin(positions, None if spans is None else [sp.end - sp.start for sp in spans])
        q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
    if spec.qk_norm == "head" and spec.qk_norm_after_rope:
        q, k = rms_norm(q, w["q_norm.weight"], eps), rms_norm(k, w["k_norm.weight"], eps)
    if spec.qk_norm == "head_unit":
        q, k = unit_rms_norm(q, eps), unit_rms_norm(k, eps)
    q = position_scaled(q, positions, spec)
    dt = iq = ik = None
    if spec.dynamic_mask:
        dt = torch.exp(w["A"] * elementwise(F.softplus, linear(v.reshape(t, -1), w, "dt_proj")))  # [T, Hkv]
    elif spec.block_indexer is not None:
        iq, ik = block_index_qk(x, w, spec.block_indexer, rotary, positions, eps)
    outs = []
    for sp in spans if spans is not None else [Span(0, t, cache, positions)]:  # type: ignore[list-item]
        a, b = sp.start, sp.end
        whole = a == 0 and b == t  # one sequence: its rows are all of them (no slicing: a view costs µs per op)
        qs, ks, vs = (q, k, v) if whole else (q[a:b], k[a:b], v[a:b])
        key_bias = keep = None
        if dt is not None:
            k_all, v_all, key_bias = sp.cache.append(layer, ks, vs, dt[a:b])
        elif iq is not None:
            k_all, v_all, ik_all = sp.cache.append(layer, ks, vs, ik[a:b])
            keep = block_keep(iq[a:b], ik_all, spec.block_indexer, sp.positions)
        else:  # a 16-bit KV pool's pages as they are: attention_scores reads them (decode: the C kernel)
            k_all, v_all = sp.cache.append(layer, ks, vs, stored=True)
        outs.append(attention_scores(qs, k_all, v_all, sp.positions, spec, w.get("sinks"), keep=keep,
                                     key_bias=key_bias))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if gate is not None:
        out = out * elementwise(torch.sigmoid, gate)
    if spec.output_gate != "none":
        out = output_gate(out, x, w, spec)
    return linear(out, w, "o_proj")


def output_gate(out: torch.Tensor, x: torch.Tensor, w: Weights, spec: AttentionSpec) -> torch.Tensor:
    """Gate the attention output [T, H*Dv] by act(gate(x)), per channel or per head."""
    t, h = out.shape[0], spec.num_heads
    g = linear(x, w, "gate")
    if spec.output_gate_bias:
        g = g.view(t, h, -1) + w["gate_bias"][None, :, None]
    if spec.output_gate == "softplus":
        g = elementwise(F.softplus, g.float()).to(out.dtype)
    else:
        g = elementwise(torch.sigmoid, g)
    if spec.output_gate_per_head:
        return (out.view(t, h, -1) * g.view(t, h, 1)).reshape(t, -1)
    return out * g.reshape(t, -1)


def mla_attention(
    x: torch.Tensor, w: Weights, spec: AttentionSpec, rotary: Rotary | None, layer: int, cache: KVCache | None,
    positions: torch.Tensor, eps: float, scratch: dict | None = None, spans: list[Span] | None = None,
    decode_row: bool = False,
) -> torch.Tensor:
    """DeepSeek multi-head latent attention; the cache holds the normalized latent and the shared rotary key (and,
    with sparse attention, the indexer keys). ``scratch`` carries the indexer's choice to ``shared`` layers.
    ``spans``: a batch of sequences as in ``gqa_attention`` (without a sparse-attention indexer, whose choice is
    per sequence: the caller runs those one sequence at a time). ``decode_row``: x is a decode token and its drafts
    (the indexer then chooses each token's keys as its decode step would: ``indexer.topk_keep``)."""
    t, h = x.shape[0], spec.num_heads
    nope, rope_dim, dv = spec.qk_nope_dim, spec.qk_rope_dim, spec.v_head_dim
    if spec.q_lora_rank is None:
        q = q_resid = linear(x, w, "q_proj")
    else:
        q_latent = linear(x, w, "q_a_proj")
        q_resid = rms_norm(q_latent, w["q_a_layernorm.weight"], spec.lora_norm_eps)
        if spec.mla_q_latent_scale != 1.0:
            q_resid = q_resid * spec.mla_q_latent_scale
        q = linear(torch.cat([q_resid, q_latent], dim=-1) if spec.mla_q_gate else q_resid, w, "q_b_proj")
    gate = None
    if spec.mla_q_gate:
        q, gate = q.view(t, h, nope + rope_dim + dv).split([nope + rope_dim, dv], dim=-1)
        gate = gate.reshape(t, h * dv)
    q = q.reshape(t, h, nope + rope_dim)
    if spec.mla_q_scale != 1.0:
        q = q * spec.mla_q_scale
    compressed = linear(x, w, "kv_a_proj_with_mqa")  # [T, rank + R]
    latent = rms_norm(compressed[:, : spec.kv_lora_rank], w["kv_a_layernorm.weight"], spec.lora_norm_eps)  # [T, rank]
    if spec.mla_kv_scale != 1.0:
        latent = latent * spec.mla_kv_scale
    k_rot = compressed[:, spec.kv_lora_rank :].reshape(t, 1, rope_dim)  # [T, 1, R]
    if spec.k_rope_norm:
        k_rot = rms_norm(k_rot, w["k_rope_norm.weight"], spec.lora_norm_eps)
    q_nope, q_rot = q[..., :nope], q[..., nope:]
    cos = sin = torch.empty(0)
    if rotary is not None:
        cos, sin = rotary.cos_sin(positions, None if spans is None else [sp.end - sp.start for sp in spans])
        q_rot, k_rot = rotary.apply(q_rot, cos, sin), rotary.apply(k_rot, cos, sin)
    ix, keep = spec.indexer, None
    if spans is not None:
        if ix is not None:
            raise ValueError("sparse-attention MLA runs one sequence per call")
        outs = []
        for sp in spans:
            a, b = sp.start, sp.end
            latent_all, k_rot_all = sp.cache.append(layer, latent[a:b], k_rot[a:b].reshape(b - a, rope_dim))
            outs.append(_mla_scores(q_nope[a:b], q_rot[a:b], latent_all, k_rot_all, sp.positions, w, spec, None))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return _mla_out(out, gate, x, w, spec)
    assert cache is not None
    if ix is not None and not ix.shared:
        latent_all, k_rot_all, index_keys = cache.append(layer, latent, k_rot.reshape(t, rope_dim),
                                                         indexer_keys(x, w, ix, rotary, cos, sin))
        keep = topk_keep(x, q_resid, index_keys, w, ix, rotary, cos, sin, positions, per_query=decode_row)
        if scratch is not None:
            scratch["index_keep"] = keep
    else:
        latent_all, k_rot_all = cache.append(layer, latent, k_rot.reshape(t, rope_dim))
        if ix is not None:
            keep = (scratch or {}).get("index_keep")
            if keep is None:
                raise ValueError(f"layer {layer} shares sparse-attention indices but no earlier layer computed them")
    out = _mla_scores(q_nope, q_rot, latent_all, k_rot_all, positions, w, spec, keep)
    return _mla_out(out, gate, x, w, spec)


def _mla_scores(
    q_nope: torch.Tensor, q_rot: torch.Tensor, latent_all: torch.Tensor, k_rot_all: torch.Tensor,
    positions: torch.Tensor, w: Weights, spec: AttentionSpec, keep: torch.Tensor | None,
) -> torch.Tensor:
    """One sequence's MLA attention: queries [T, H, nope] / [T, H, R] over its cached latent [S, rank] and rotary
    keys [S, R] → [T, H*Dv]."""
    h, nope, rope_dim, dv = spec.num_heads, spec.qk_nope_dim, spec.qk_rope_dim, spec.v_head_dim
    s = latent_all.shape[0]
    kv = linear(latent_all, w, "kv_b_proj").view(s, h, nope + dv)  # [S, H, nope + Dv]
    k_full = torch.cat([kv[..., :nope], k_rot_all[:, None, :].expand(s, h, rope_dim)], dim=-1)  # [S, H, Dh]
    q_full = position_scaled(torch.cat([q_nope, q_rot], dim=-1), positions, spec)  # [T, H, Dh]
    return attention_scores(q_full, k_full, kv[..., nope:], positions, spec, w.get("sinks"), keep)


def _mla_out(out: torch.Tensor, gate: torch.Tensor | None, x: torch.Tensor, w: Weights,
             spec: AttentionSpec) -> torch.Tensor:
    if gate is not None:
        out = out * elementwise(torch.sigmoid, gate.float()).to(out.dtype)
    if spec.output_gate != "none":
        out = output_gate(out, x, w, spec)
    return linear(out, w, "o_proj")
