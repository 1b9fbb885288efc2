"""DeepSeek sparse attention's lightning indexer: which cached keys each query may attend to.

Legend: T new tokens, S cached + new positions, Hi indexer heads, Di indexer head dim. The indexer keys [S, Di] are
one more part of the layer's KV cache entry.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.model.rope import Rotary
from freetoken_agent.runtime.model.spec import IndexerSpec

Weights = dict[str, torch.Tensor]


def indexer_keys(
    x: torch.Tensor, w: Weights, spec: IndexerSpec, rotary: Rotary | None, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """This step's indexer keys [T, Di]: LayerNorm(wk·x) with the first ``rope_dim`` channels rotated."""
    k = F.layer_norm(F.linear(x, w["indexer.wk.weight"]).float(), (spec.head_dim,), w["indexer.k_norm.weight"].float(),
                     w["indexer.k_norm.bias"].float(), 1e-6).to(x.dtype)
    if rotary is not None:
        k = rotary.apply(k[:, None, :], cos, sin, style=spec.rope_style)[:, 0]
    return k


def topk_keep(
    x: torch.Tensor, q_resid: torch.Tensor, keys: torch.Tensor, w: Weights, spec: IndexerSpec, rotary: Rotary | None,
    cos: torch.Tensor, sin: torch.Tensor, q_pos: torch.Tensor,
) -> torch.Tensor:
    """Boolean [T, S]: key s is among the top-k indexer scores of query t (causally masked)."""
    t, s = x.shape[0], keys.shape[0]
    q = F.linear(q_resid, w["indexer.wq_b.weight"]).view(t, spec.num_heads, spec.head_dim)
    if rotary is not None:
        q = rotary.apply(q, cos, sin, style=spec.rope_style)
    scores = F.relu(torch.matmul(q.float(), keys.float().T[None]) * spec.head_dim**-0.5)  # [T, Hi, S]
    weights = F.linear(x, w["indexer.weights_proj.weight"]).float() * spec.num_heads**-0.5  # [T, Hi]
    index = torch.matmul(weights[:, None, :], scores)[:, 0]  # [T, S]
    future = torch.arange(s, device=x.device)[None, :] > q_pos[:, None]
    index = index.masked_fill(future, float("-inf"))
    top = index.topk(min(spec.topk, s), dim=-1).indices
    return torch.zeros(t, s, dtype=torch.bool, device=x.device).scatter_(1, top, True)
