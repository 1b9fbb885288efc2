"""Hyper-connections (Hunyuan HY-V4): N residual streams mixed into each sub-layer's input and updated by its output.

Legend: T tokens, N streams, D hidden. Per sub-layer: weights ``fn`` [2N, N·D], ``base`` [2N], ``scale`` [2]; the
final head has ``fn`` [N, N·D], ``base`` [N], ``scale`` [1].
"""

from __future__ import annotations

import torch

from freetoken_agent.runtime.model.layers import dense_linear, elementwise


def _mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    flat = streams.flatten(1).float()  # [T, N·D]
    return dense_linear(flat, fn.float().contiguous()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def hc_pre(
    streams: torch.Tensor, w: dict[str, torch.Tensor], magnitude: float, hc_eps: float, norm_eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """streams [T, N, D] → (post weights [T, N], sub-layer input [T, D])."""
    n = streams.shape[1]
    pre_logits, post_logits = _mixes(streams, w["fn"], norm_eps).split(n, dim=-1)
    pre_b, post_b = w["base"].float().split(n)
    pre_s, post_s = w["scale"].float().unbind(0)
    pre = elementwise(torch.sigmoid, pre_logits * pre_s + pre_b) + hc_eps
    post = magnitude * elementwise(torch.sigmoid, post_logits * post_s + post_b) + hc_eps
    return post, (pre[..., None] * streams).sum(dim=1).to(streams.dtype)


def hc_post(streams: torch.Tensor, post: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Every stream gets post_n · out added: [T, N, D]."""
    return (post.float()[..., None] * out.float()[:, None, :] + streams.float()).to(streams.dtype)


def hc_head(streams: torch.Tensor, w: dict[str, torch.Tensor], hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Collapse the streams into one hidden state [T, D] before the final norm."""
    pre = elementwise(torch.sigmoid, _mixes(streams, w["fn"], norm_eps) * w["scale"].float() + w["base"].float()) + hc_eps
    return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
