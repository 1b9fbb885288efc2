"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): N residual streams, collapsed into each sub-layer's
input, expanded from its output, and mixed among themselves by a near doubly-stochastic matrix.

Legend: T tokens, N streams, D hidden. Per sub-layer: ``fn`` [(2+N)·N, N·D], ``base`` [(2+N)·N], ``scale`` [3]
(pre, post and comb logits). The plain hyper-connections of HY-V4 (no stream mixing) are in ``hyper.py``; both share
its final collapse ``hc_head``.
"""

from __future__ import annotations

import torch

from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.model.layers import elementwise, mixer_linear


def mhc_pre(
    streams: torch.Tensor, w: dict[str, torch.Tensor], iters: int, magnitude: float, hc_eps: float, norm_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, D] → (post weights [T, N], comb [T, N, N], sub-layer input [T, D])."""
    t, n, _ = streams.shape
    flat = streams.flatten(1).float()  # [T, N·D]
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre_l, post_l, comb_l = mixer_linear(flat, w["fn"].float().contiguous()).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = w["base"].float().split([n, n, n * n])
    pre_s, post_s, comb_s = w["scale"].float().unbind(0)
    pre = elementwise(torch.sigmoid, pre_l * pre_s + pre_b) + hc_eps
    post = magnitude * elementwise(torch.sigmoid, post_l * post_s + post_b)
    comb = torch.softmax(comb_l.view(t, n, n) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
    # Sinkhorn-Knopp towards doubly stochastic: columns first, then (rows, columns) iters - 1 times
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return post, comb, (pre[..., None] * streams).sum(dim=1).to(streams.dtype)


def mhc_post(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """New streams [T, N, D]: stream k = post_k · out + Σ_j comb[j, k] · stream j."""
    dtype = streams.dtype
    mix = comb.to(dtype).transpose(-1, -2)  # [T, N (to), N (from)]
    if kops.deterministic():  # the sum over source streams in one fixed order, whatever T
        mixed = mix[:, :, 0, None] * streams[:, None, 0]
        for j in range(1, streams.shape[1]):
            mixed = mixed + mix[:, :, j, None] * streams[:, None, j]
    else:
        mixed = torch.matmul(mix, streams)
    return post.to(dtype)[..., None] * out[:, None, :] + mixed
