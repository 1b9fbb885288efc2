"""Qwen4-Exp per-layer embeddings (PLE): hashed n-gram embeddings injected into the hyper-connection streams.

Legend: T new tokens (one sequence), N streams, D hidden, P = ``NGramSpec.dim`` (all heads' embeddings), n the largest
n-gram, c = n - 1 tokens of context, h heads per n-gram order, K conv kernel, r = (K - 1)·n conv lookback (dilation n).

Token ids are hashed per n-gram order g = 2..n (xor of the last g tokens times fixed odd multipliers, restarting after
each EOS) into ``h`` prime-sized vocabularies per order, whose rows live in one table (stored in shards). The
embedding keys one gate per stream against the normed streams; the gated value, normed, passes a dilated causal conv:
  out = gated + silu(conv(norm(gated)))  added to every stream.
Per sequence the layer keeps the last c token ids (EOS before the first) and the last r conv inputs.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.model.compressed import Loader
from freetoken_agent.runtime.model.layers import elementwise, mixer_linear
from freetoken_agent.runtime.model.mixers.conv import causal_conv
from freetoken_agent.runtime.model.spec import NGramSpec

Weights = dict[str, torch.Tensor]

_MASK64 = (1 << 64) - 1
_GAMMA, _M1, _M2, _PRIME_1 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % k for k in range(3, math.isqrt(value) + 1, 2))


@lru_cache(maxsize=64)
def hashing(spec: NGramSpec) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
    """(multipliers [n], head vocab sizes [(n-1)·h], head offsets, padded table rows) of this PLE layer: each head
    a distinct prime after ``vocab_base`` (numbered across PLE layers), the table padded to ``divisor``."""
    heads = (spec.ngram_size - 1) * spec.heads_per_ngram
    bound = max(1, ((1 << 63) - 1) // max(spec.vocab, 1) // 2)
    seed = spec.seed + _PRIME_1 * spec.index
    mults = tuple(2 * (_splitmix64((seed + _GAMMA * (i + 1)) & _MASK64) % bound) + 1 for i in range(spec.ngram_size))
    sizes, prime = [], spec.vocab_base - 1
    for k in range(spec.index * heads + heads):
        prime += 1
        while not _is_prime(prime):
            prime += 1
        if k >= spec.index * heads:
            sizes.append(prime)
    offsets = tuple(sum(sizes[:k]) for k in range(heads))
    rows = math.ceil(sum(sizes) / spec.divisor) * spec.divisor
    return mults, tuple(sizes), offsets, rows


def shard_rows(spec: NGramSpec) -> list[int]:
    """Rows of each stored shard of the table (``torch.chunk`` into ``shards`` parts, as checkpoints are written)."""
    rows = hashing(spec)[3]
    return [t.shape[0] for t in torch.empty(rows, 0).chunk(spec.shards)]


def _shift(history: torch.Tensor, shift: int, eos: int) -> torch.Tensor:
    """history [L] → the token ``shift`` places earlier within the same EOS-delimited segment, else EOS."""
    if shift == 0:
        return history
    pos = torch.arange(history.shape[0], device=history.device)
    eos_at = torch.where(history == eos, pos, -1)
    before = torch.cat([eos_at.new_full((1,), -1), torch.cummax(eos_at, dim=0).values[:-1]])
    valid = (pos - (before + 1) >= shift) & (pos - shift >= 0)
    return torch.where(valid, history[(pos - shift).clamp_min(0)], history.new_full((), eos))


def ngram_rows(ids: torch.Tensor, context: torch.Tensor, spec: NGramSpec) -> torch.Tensor:
    """ids [T], the previous c token ids [c] → table rows [T, (n-1)·h] (int64 products wrap as in the reference)."""
    mults, sizes, offsets, _ = hashing(spec)
    history = torch.cat([context, ids])
    shifted = [_shift(history, s, spec.eos) for s in range(spec.ngram_size)]
    sizes_t, offsets_t = torch.tensor(sizes, device=ids.device), torch.tensor(offsets, device=ids.device)
    blocks, h = [], spec.heads_per_ngram
    for g in range(2, spec.ngram_size + 1):
        mixed = shifted[0] * mults[0]
        for p in range(1, g):
            mixed = torch.bitwise_xor(mixed, shifted[p] * mults[p])
        k = (g - 2) * h
        blocks.append(torch.remainder(mixed[:, None], sizes_t[k : k + h]) + offsets_t[k : k + h])
    return torch.cat(blocks, dim=-1)[-ids.shape[0] :]


def lookup(rows: torch.Tensor, shards: list[torch.Tensor]) -> torch.Tensor:
    """Gather table rows [T, H] across the stored shards (kept as loaded: no concatenated copy) → [T, H, P/H]."""
    if len(shards) == 1:
        return F.embedding(rows, shards[0])
    starts = torch.tensor([0] + [s.shape[0] for s in shards], device=rows.device).cumsum(0)
    which = torch.bucketize(rows, starts[1:], right=True)  # [T, H] shard index
    out = torch.empty(*rows.shape, shards[0].shape[1], dtype=shards[0].dtype, device=rows.device)
    for k, shard in enumerate(shards):
        hit = which == k
        if hit.any():
            out[hit] = shard[rows[hit] - starts[k]]
    return out


def group_norm(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """Qwen4-Exp RMSNorm over each ``group`` channels of x [T, G·group] with weights (1 + w), in fp32."""
    h = x.float().unflatten(-1, (-1, group))
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (h * (1.0 + weight.float())).to(x.dtype)


def ple(h: torch.Tensor, ids: torch.Tensor, w: Weights, spec: NGramSpec, d: int, eps: float,
        state: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One sequence: streams h [T, N·D], token ids [T], state (context [c], conv inputs [r, N·D]) → (the PLE output
    [T, N·D] to add to the streams, the new state)."""
    n, c = h.shape[1] // d, spec.ngram_size - 1
    context = ids.new_full((c,), spec.eos) if state is None else state[0]
    emb = lookup(ngram_rows(ids, context, spec), [w[f"ngram.{k}"] for k in range(spec.shards)]).flatten(-2)  # [T, P]
    key = group_norm(mixer_linear(emb, w["key_proj.weight"]), w["norm_key.weight"], d, eps).unflatten(-1, (n, d))
    value = mixer_linear(emb, w["value_proj.weight"])  # [T, D]
    query = group_norm(h, w["norm_query.weight"], d, eps).unflatten(-1, (n, d))
    gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(d)  # [T, N, 1]
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = (elementwise(torch.sigmoid, gate) * value[:, None, :]).flatten(-2)  # [T, N·D]
    normed = group_norm(gated, w["norm_conv.weight"], d, eps)
    conv, conv_state = causal_conv(normed, w["conv1d.weight"], None, None if state is None else state[1], None,
                                   dilation=spec.ngram_size)  # [T, N·D], the last (K-1)·n inputs
    history = torch.cat([context, ids])
    return gated + elementwise(F.silu, conv), (history[history.shape[0] - c :].clone(), conv_state)


def ple_weights(ld: Loader, prefix: str, spec: NGramSpec, d: int, streams: int) -> Weights:
    """Load one PLE layer (``{layer}.ple``): projections, norms, conv and the n-gram table shards (each kept as
    loaded: a real table is ~100 GB, read lazily from the mapped file)."""
    w: Weights = {}
    nd, p = streams * d, spec.dim
    for leaf, shape in (("key_proj.weight", (nd, p)), ("value_proj.weight", (d, p)), ("norm_key.weight", (nd,)),
                        ("norm_query.weight", (nd,)), ("norm_conv.weight", (nd,)),
                        ("conv1d.weight", (nd, 1, spec.conv_kernel))):
        w[leaf] = ld.take(f"{prefix}.{leaf}", shape)
    heads = (spec.ngram_size - 1) * spec.heads_per_ngram
    table = f"{prefix}.ple_embedding.ngram_embedding"
    for k, rows in enumerate(shard_rows(spec)):
        w[f"ngram.{k}"] = ld.take(f"{table}.shard_{k}.weight", (rows, p // heads))
    return w
