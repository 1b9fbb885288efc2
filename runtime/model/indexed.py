"""Kolibri 1.1 indexed attention (``AttentionSpec.sparse_index``): no position embeddings, each query attends to a
few keys chosen by score, and keys and values rounded to NVFP4.

Legend: ``T`` queries of this forward, ``S`` keys in the sequence's cache, ``nh`` routing heads, ``c`` compression.

The selection follows transformers' reference (``Kolibri1_1Indexer``) operation for operation, so the same keys are
chosen (ties towards earlier keys): routing queries are the first ``nh`` query heads rounded to NVFP4, scored against
key head 0 (ReLU of each head's logits, summed over the heads in order, times ``Dh^-1/2 / nh``). An indexer layer
picks the pool of candidates — every visible key while a query sees at most ``pool_size``, else the ``pool_size / c``
best blocks of ``c`` keys by their NVFP4-rounded mean key (a query's incomplete last block competes with score 0,
later blocks not at all) — and leaves it in the sequence's per-forward scratch for the indexed layers after it, each of
which then keeps its own ``topk`` best candidates plus the first ``sinks`` and last ``local`` visible keys (a query
that sees no more than that budget sees every key). A query's pool and keys depend only on its own position and the
keys before it, so a decode step selects what the same query selected in a prefill. Only the keys some query kept are
rounded to NVFP4 and read by the attention (a decode step at 32k keys, 48/4 heads x 128: 845 -> 90 ms per indexed
layer on 2 Zen 3 cores, 75 of them the selection's scoring, which reads every key as transformers' reference does).
"""

from __future__ import annotations

import torch

from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.model.layers import linear, rms_norm
from freetoken_agent.runtime.model.spec import AttentionSpec, SparseIndexSpec

POOL_KEY = "kolibri_index_pool"
"""The per-forward scratch entry holding the latest indexer's pool ``[T, S]`` bool."""


def nvfp4_round(x: torch.Tensor) -> torch.Tensor:
    """Round to NVFP4 and back: E2M1 values with one E4M3 scale per 16 consecutive values of the last dimension,
    nearest-even (transformers' ``nvfp4_fake_quantize``)."""
    blocks = x.float().unflatten(-1, (-1, 16))
    scale = (blocks.abs().amax(-1, keepdim=True) / 6).clamp(2**-9, 448).to(torch.float8_e4m3fn).float()
    scaled = blocks / scale
    magnitude = scaled.abs().clamp(max=6)
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))  # E2M1 spacing
    rounded = torch.round(magnitude / step) * step
    return (rounded.copysign(scaled) * scale).flatten(-2).to(x.dtype)


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the ``k`` highest finite scores of each row; ties go to the lowest indices."""
    k = min(k, scores.shape[-1])
    kth = scores.topk(k, dim=-1).values[..., -1:]
    above = scores > kth
    tied = (scores == kth) & (kth > float("-inf"))
    free = k - above.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= free))


def _score(queries: torch.Tensor, keys: torch.Tensor, ix: SparseIndexSpec, head_dim: int) -> torch.Tensor:
    """``queries [T, nh, Dh]`` against ``keys [N, Dh]`` → ``[T, N]``: ReLU logits summed over the heads in order."""
    scores = queries.new_zeros(queries.shape[0], keys.shape[0])
    for h in range(queries.shape[1]):
        scores += (queries[:, h] @ keys.T).relu()
    return scores * (head_dim**-0.5 / ix.num_heads)


def select_keys(q: torch.Tensor, k_all: torch.Tensor, positions: torch.Tensor, spec: AttentionSpec,
                scratch: dict) -> torch.Tensor:
    """``keep [T, S]``: the keys each query of ``q [T, H, Dh]`` (at ``positions``) attends to over ``k_all [S, Hkv,
    Dh]`` (the module docstring); an indexer stores its pool in ``scratch``."""
    ix = spec.sparse_index
    assert ix is not None
    s, dh = k_all.shape[0], spec.head_dim
    lengths = positions.to(torch.int64) + 1  # a query at p sees keys [0, p]
    visible = torch.arange(s, device=q.device)[None, :] < lengths[:, None]  # [T, S]
    keys = k_all[:, 0]  # key head 0, [S, Dh]
    routing = nvfp4_round(q[:, : ix.num_heads]).float()  # [T, nh, Dh]
    if ix.pool_source:
        pool = visible.clone()
        long = lengths > ix.pool_size
        if bool(long.any()):
            c = ix.compression
            nb = s // c
            summaries = nvfp4_round(keys[: nb * c].float().unflatten(0, (nb, c)).sum(1) / c)  # [nb, Dh]
            scores = torch.nn.functional.pad(_score(routing[long], summaries, ix, dh), (0, 1))  # [Tl, nb + 1]
            blocks = torch.arange(nb + 1, device=q.device)
            n = lengths[long][:, None]
            scores = torch.where(blocks < n // c, scores, 0.0)  # the incomplete last block: score 0
            scores = scores.masked_fill(blocks >= (n + c - 1) // c, float("-inf"))  # blocks past the query: out
            chosen = top_k_mask(scores, ix.pool_size // c).repeat_interleave(c, dim=-1)[:, :s]
            pool[long] = chosen & visible[long]
        scratch[POOL_KEY] = pool
    else:
        pool = scratch.get(POOL_KEY)
        if pool is None or pool.shape != visible.shape:
            raise FreeTokenError("an indexed-attention layer ran before its indexer in this forward")
    keep = visible.clone()
    long = lengths > ix.topk + ix.local + ix.sinks
    if bool(long.any()):
        scores = _score(routing[long], nvfp4_round(keys).float(), ix, dh)  # [Tl, S]
        pos = torch.arange(s, device=q.device)[None, :]
        n = lengths[long][:, None]
        sinks = pos < ix.sinks
        local = (pos >= n - ix.local) & (pos < n)
        candidates = pool[long] & ~sinks & (pos < n - ix.local)
        chosen = top_k_mask(scores.masked_fill(~candidates, float("-inf")), ix.topk)
        keep[long] = (chosen | sinks | local) & visible[long]
    return keep


def indexed_attention(x: torch.Tensor, w: dict[str, torch.Tensor], spec: AttentionSpec, layer: int, cache: KVCache,
                      positions: torch.Tensor, eps: float, scratch: dict) -> torch.Tensor:
    """x [T, D] → [T, D] for one sequence: q (and, unless the layer reads ``spec.kv_source``'s cache, k and v) with
    per-head RMSNorm and no rotary; the keys chosen by ``select_keys``; attention over NVFP4-rounded keys and
    values."""
    t = x.shape[0]
    q = rms_norm(linear(x, w, "q_proj").view(t, spec.num_heads, spec.head_dim), w["q_norm.weight"], eps)
    if spec.kv_source is None:
        k = rms_norm(linear(x, w, "k_proj").view(t, spec.num_kv_heads, spec.head_dim), w["k_norm.weight"], eps)
        v = linear(x, w, "v_proj").view(t, spec.num_kv_heads, spec.v_head_dim)
        k_all, v_all = cache.append(layer, k, v)[:2]
    else:
        k_all, v_all = cache.cached(spec.kv_source)[:2]
    k_all, v_all = k_all.to(q.dtype), v_all.to(q.dtype)
    if t > 1 and kops.deterministic():  # each query exactly as its own decode step: over keys 0..p
        return linear(_per_query(q, k_all, v_all, positions, spec, scratch), w, "o_proj")
    keep = select_keys(q, k_all, positions, spec, scratch)
    cols = keep.any(0).nonzero().flatten()  # the keys any query keeps: only they are rounded and read
    out = kept_attention(q, nvfp4_round(k_all[cols]), nvfp4_round(v_all[cols]), keep[:, cols], spec.scale)
    return linear(out, w, "o_proj")


def _per_query(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, positions: torch.Tensor,
               spec: AttentionSpec, scratch: dict) -> torch.Tensor:
    """Deterministic mode: the attention of each query over its own visible keys only, with the shapes of its decode
    step (the selection's products and the gathered attention change their bits with the number of queries and
    keys); an indexer's pools are gathered back into ``scratch`` as [T, S] for the layers after it."""
    t, s = q.shape[0], k_all.shape[0]
    pool_in = None if spec.sparse_index is None or spec.sparse_index.pool_source else scratch.get(POOL_KEY)
    pools, outs = torch.zeros(t, s, dtype=torch.bool, device=q.device), []
    for i, p in enumerate(positions.tolist()):
        own = {} if pool_in is None else {POOL_KEY: pool_in[i : i + 1, : p + 1]}
        keep = select_keys(q[i : i + 1], k_all[: p + 1], positions[i : i + 1], spec, own)
        if POOL_KEY in own:
            pools[i, : p + 1] = own[POOL_KEY][0]
        cols = keep[0].nonzero().flatten()
        outs.append(kept_attention(q[i : i + 1], nvfp4_round(k_all[cols]), nvfp4_round(v_all[cols]), keep[:, cols],
                                   spec.scale))
    if pool_in is None and spec.sparse_index is not None and spec.sparse_index.pool_source:
        scratch[POOL_KEY] = pools
    return torch.cat(outs)


def kept_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of ``q [T, H, Dh]`` over the gathered keys ``k [N, Hkv, Dh]`` / values ``v [N, Hkv, Dv]``,
    query t seeing those with ``keep[t]`` (every query keeps at least its own key) → ``[T, H * Dv]``."""
    t, h, _ = q.shape
    hkv = k.shape[1]
    qg = q.float().view(t, hkv, h // hkv, -1).permute(1, 2, 0, 3)  # [Hkv, G, T, Dh]
    scores = torch.einsum("kgtd,nkd->kgtn", qg, k.float()) * scale  # [Hkv, G, T, N]
    scores = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    out = torch.einsum("kgtn,nkd->tkgd", scores, v.float())  # [T, Hkv, G, Dv]
    return out.reshape(t, -1).to(q.dtype)
