"""Causal depthwise 1-D convolution with a carried state (the short convolution in front of recurrent mixers).

Legend: T new tokens, C channels, K kernel width. The state holds the last K-1 inputs of the previous forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.kernels import invariant
from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.model.activations import Params, activation_fn


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor | None,
    activation: str | None = "silu", params: Params | None = None, dilation: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C], weight [C, K] (or [C, 1, K]), state [(K-1)·dilation, C] or None → (y [T, C], new state of that
    shape); ``activation`` (an activation name, None: none; ``params``: a learned one's tensors) is applied to y;
    ``dilation``: taps that many positions apart (Qwen4-Exp's n-gram conv)."""
    w = weight.reshape(weight.shape[0], -1)
    k = w.shape[1]
    lookback = (k - 1) * dilation
    if state is None:
        state = x.new_zeros((lookback, x.shape[1]))
    full = torch.cat([state.to(x.dtype), x], dim=0)  # [lookback + T, C]
    if kops.deterministic():  # one fixed order per output (conv1d's vector body and tail sum in different orders,
        t = x.shape[0]        # so a position's bits would depend on how the sequence was chunked)
        y = full[0:t] * w[:, 0]
        for j in range(1, k):
            y = y + full[j * dilation : j * dilation + t] * w[:, j]
        if bias is not None:
            y = y + bias
    else:
        y = F.conv1d(full.T[None], w[:, None, :], bias, groups=w.shape[0], dilation=dilation)[0].T  # [T, C]
    if activation:
        fn = activation_fn(activation, params)
        y = invariant.pointwise(fn, y) if kops.deterministic() else fn(y)
    return y, full[full.shape[0] - lookback :].clone()
