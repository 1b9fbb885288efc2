"""ZAYA's router (``RouterSpec.mlp_hidden > 0``): a small MLP over a down-projected state that is carried from each
MoE layer's router to the next (per token, within one forward), choosing among the experts plus a skip expert.

Legend: T tokens, D hidden, R router width, E experts (E + 1 classes: the last is the skip expert), K experts per
token.

  s = down(x) [+ s_prev · scale, every layer but the first];  next layer's s_prev = s
  p = softmax(out(gelu(fc2(gelu(fc1(rms(s)))))))            [T, E + 1]
  ids = top-k of p + balancing biases;  weights = p[ids] (not renormalized); a skip choice weighs 0
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.model.compressed import Loader
from freetoken_agent.runtime.model.layers import linear, rms_norm

Weights = dict[str, torch.Tensor]


def mlp_route(
    x: torch.Tensor, w: Weights, top_k: int, num_experts: int, state: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, D], the previous router's state [T, R] or None → (ids [T, K], weights [T, K] fp32, state [T, R])."""
    s = linear(x, w, "down_proj")
    if state is not None and "router_states_scale" in w:
        s = s + state * w["router_states_scale"]
    h = rms_norm(s, w["router_mlp.norm.weight"], eps)
    h = F.gelu(linear(h, w, "router_mlp.fc1"))
    h = F.gelu(linear(h, w, "router_mlp.fc2"))
    probs = torch.softmax(linear(h, w, "router_mlp.out_proj"), dim=-1)  # [T, E + 1]
    ids = torch.topk(probs.float() + w["balancing_biases"].float(), top_k, dim=-1).indices
    weights = probs.gather(-1, ids).float()
    skip = ids == num_experts
    return ids.masked_fill(skip, 0), weights.masked_fill(skip, 0.0), s


def mlp_router_weights(ld: Loader, prefix: str, d: int, hidden: int, classes: int, first: bool) -> Weights:
    """Load a ZAYA router under ``prefix`` (``{moe}.gate``); the first MoE layer has no state scale."""
    w: Weights = {}
    ld.linear(w, prefix, "down_proj", hidden, d, True)
    if not first:
        w["router_states_scale"] = ld.take(f"{prefix}.router_states_scale", (hidden,))
    w["router_mlp.norm.weight"] = ld.take(f"{prefix}.router_mlp.norm.weight", (hidden,))
    for leaf in ("fc1", "fc2"):
        ld.linear(w, f"{prefix}.router_mlp", leaf, hidden, hidden, True, key=f"router_mlp.{leaf}")
    ld.linear(w, f"{prefix}.router_mlp", "out_proj", classes, hidden, False, key="router_mlp.out_proj")
    w["balancing_biases"] = ld.take(f"{prefix}.balancing_biases", (classes,), torch.float32)
    return w
