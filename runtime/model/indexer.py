"""DeepSeek sparse attention's lightning indexer: which cached keys each query may attend to.

Legend: T new tokens, S cached + new positions, Hi indexer heads, Di indexer head dim. The indexer keys [S, Di] are
one more part of the layer's KV cache entry.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.kernels import invariant
from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.model.linear import dense_linear
from freetoken_agent.runtime.model.rope import Rotary
from freetoken_agent.runtime.model.spec import BlockIndexerSpec, IndexerSpec

Weights = dict[str, torch.Tensor]


def indexer_keys(
    x: torch.Tensor, w: Weights, spec: IndexerSpec, rotary: Rotary | None, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """This step's indexer keys [T, Di]: LayerNorm(wk·x) with the first ``rope_dim`` channels rotated."""
    k = dense_linear(x, w["indexer.wk.weight"]).float()
    weight, bias = w["indexer.k_norm.weight"].float(), w["indexer.k_norm.bias"].float()
    if kops.deterministic():
        k = invariant.layer_norm(k, weight, spec.k_norm_eps, bias).to(x.dtype)
    else:
        k = F.layer_norm(k, (spec.head_dim,), weight, bias, spec.k_norm_eps).to(x.dtype)
    if rotary is not None:
        k = _rotate(k[:, None, :], spec, rotary, cos, sin)[:, 0]
    return k


def _rotate(x: torch.Tensor, spec: IndexerSpec, rotary: Rotary, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if not spec.rope_last:
        return rotary.apply(x, cos, sin, style=spec.rope_style)
    keep = x.shape[-1] - spec.rope_dim
    return torch.cat([x[..., :keep], rotary.apply(x[..., keep:], cos, sin, style=spec.rope_style)], dim=-1)


def topk_keep(
    x: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor, w: Weights, spec: IndexerSpec, rotary: Rotary | None,
    cos: torch.Tensor, sin: torch.Tensor, q_pos: torch.Tensor, per_query: bool = False,
) -> torch.Tensor:
    """Boolean [T, S]: key s is among the top-k indexer scores of query t (causally masked).

    ``per_query`` (always for one query and in deterministic mode): each query is scored and chosen over exactly its
    visible keys 0..p — the shapes of its own decode step, so a decode row (a token and its speculative drafts)
    keeps for each token the keys its decode step would, bit for bit. That matters beyond rounding: the ReLU scores
    many keys exactly 0, and which of those tied keys torch's top-k keeps depends on the length of the row it is
    given. Otherwise the chunk is scored in one product with later keys masked, as transformers' prefill does."""
    t, s = x.shape[0], keys.shape[0]
    q = dense_linear(q_resid, w["indexer.wq_b.weight"]).view(t, spec.num_heads, spec.head_dim)
    if rotary is not None:
        q = _rotate(q, spec, rotary, cos, sin)
    weights = dense_linear(x, w["indexer.weights_proj.weight"]).float() * spec.num_heads**-0.5  # [T, Hi]
    if spec.scale_after_relu:
        weights = weights * spec.head_dim**-0.5
    q, keys = q.float(), keys.float()
    if t == 1 or per_query or kops.deterministic():
        keep = torch.zeros(t, s, dtype=torch.bool, device=x.device)
        for i, p in enumerate(q_pos.tolist()):
            index = _index_scores(q[i : i + 1], keys[: p + 1], weights[i : i + 1], spec)[0]  # [p + 1]
            keep[i, : p + 1].scatter_(0, index.topk(min(spec.topk, p + 1)).indices, True)
        return keep
    index = _index_scores(q, keys, weights, spec)  # [T, S]
    future = torch.arange(s, device=x.device)[None, :] > q_pos[:, None]
    index = index.masked_fill(future, float("-inf"))
    top = index.topk(min(spec.topk, s), dim=-1).indices
    return torch.zeros(t, s, dtype=torch.bool, device=x.device).scatter_(1, top, True)


def _index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, spec: IndexerSpec) -> torch.Tensor:
    """fp32 queries [T, Hi, Di] over keys [S, Di] with head weights [T, Hi] → index scores [T, S]."""
    scores = torch.matmul(q, keys.T[None])  # [T, Hi, S]
    scores = F.relu(scores) if spec.scale_after_relu else F.relu(scores * spec.head_dim**-0.5)
    return torch.matmul(weights[:, None, :], scores)[:, 0]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def block_index_qk(
    x: torch.Tensor, w: Weights, spec: BlockIndexerSpec, rotary: Rotary | None, positions: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax-M3 indexer queries [T, Hi, Di] and this step's keys [T, Di] (normed, rotated like the attention)."""
    t = x.shape[0]
    q = _rms(F.linear(x, w["indexer.q_proj.weight"]).view(t, spec.num_heads, spec.head_dim), w["indexer.q_norm.weight"], eps)
    k = _rms(F.linear(x, w["indexer.k_proj.weight"]).view(t, 1, spec.head_dim), w["indexer.k_norm.weight"], eps)
    if rotary is not None:
        cos, sin = rotary.cos_sin(positions)
        q, k = rotary.apply(q, cos, sin, style="half"), rotary.apply(k, cos, sin, style="half")
    return q, k[:, 0]


def block_keep(q: torch.Tensor, keys: torch.Tensor, spec: BlockIndexerSpec, q_pos: torch.Tensor) -> torch.Tensor:
    """Boolean [Hi, T, S]: key s lies in one of query t's selected blocks for indexer head h."""
    t, s, bs = q.shape[0], keys.shape[0], spec.block_size
    scores = torch.matmul(q.float().transpose(0, 1), keys.float().T)  # [Hi, T, S]
    future = torch.arange(s, device=q.device)[None, :] > q_pos[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    blocks = -(-s // bs)
    scores = F.pad(scores, (0, blocks * bs - s), value=float("-inf")).view(spec.num_heads, t, blocks, bs)
    block_scores = scores.amax(dim=-1)  # [Hi, T, NB]
    if spec.local_blocks > 0:
        local = (q_pos[:, None] // bs - torch.arange(spec.local_blocks, device=q.device)[None, :]).clamp(min=0)
        block_scores.scatter_(-1, local[None].expand(spec.num_heads, -1, -1), float("inf"))
    top_scores, top = block_scores.topk(min(spec.topk_blocks, blocks), dim=-1)
    chosen = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, top, top_scores > float("-inf"))
    return chosen.repeat_interleave(bs, dim=-1)[..., :s]
