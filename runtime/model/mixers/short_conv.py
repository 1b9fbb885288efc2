"""LFM2's gated short convolution: y = out(C · conv(B · x)), with B, C, x from one input projection.

The cache holds the last K-1 gated inputs (B · x) per layer.
"""

from __future__ import annotations

import torch

from freetoken_agent.runtime.kv.cache import KVCache
from freetoken_agent.runtime.model.mixers.conv import causal_conv
from freetoken_agent.runtime.model.spec import RecurrentSpec
from freetoken_agent.runtime.model.layers import mixer_linear


def short_conv(
    x: torch.Tensor, w: dict[str, torch.Tensor], spec: RecurrentSpec, layer: int, cache: KVCache, eps: float
) -> torch.Tensor:
    b, c, h = mixer_linear(x, w["in_proj.weight"], w.get("in_proj.bias")).chunk(3, dim=-1)
    state = cache.get_state(layer)
    y, conv_state = causal_conv(b * h, w["conv.weight"], w.get("conv.bias"), None if state is None else state[0],
                                activation=None)
    cache.set_state(layer, conv_state)
    return mixer_linear(c * y, w["out_proj.weight"], w.get("out_proj.bias"))
