"""Inkling's MoE routing with a shared-expert sink (``RouterSpec.shared_sink``).

Legend: T tokens, D hidden, E routed experts, n shared experts, K experts per token, I expert intermediate size.
The router has E + n rows: sigmoid scores (plus the correction bias) pick the top-k routed experts; the chosen
routed logits and the n shared logits are then normalized together — softmax over their logsigmoids — so the
shared experts absorb part of the mass. The shared experts are stored stacked ([n, I, D]) and each is weighted by
its own share γ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.model.activations import activation_fn, params_in
from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.model.layers import dense_linear, elementwise
from freetoken_agent.runtime.model.spec import MLPSpec, MoESpec


def sink_route(
    x: torch.Tensor, moe: MoESpec, weight: torch.Tensor, correction: torch.Tensor | None,
    global_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, D] → (topk_ids [T, K], topk_weights [T, K], shared weights γ [T, n]), weights in fp32."""
    n, k = moe.router.shared_sink, moe.top_k
    logits = dense_linear(x.float(), weight.float(), None)  # [T, E + n]
    routed, shared = logits[:, :-n], logits[:, -n:]
    choice = elementwise(torch.sigmoid, routed)
    if correction is not None:
        choice = choice + correction.float().reshape(-1)
    ids = torch.topk(choice, k, dim=-1).indices
    log_probs = elementwise(F.logsigmoid, torch.cat([routed.gather(-1, ids), shared], dim=-1))  # [T, K + n]
    weights = elementwise(torch.exp, log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True)) * moe.router.scaling
    if global_scale is not None:
        weights = weights * global_scale.float()
    return ids, weights[:, :k], weights[:, k:]


def stacked_shared(x: torch.Tensor, w: dict[str, torch.Tensor], gammas: torch.Tensor, spec: MLPSpec) -> torch.Tensor:
    """Σ_n γ_n · down_n(act(gate_n(x)) · up_n(x)) for x [T, D], gate/up [n, I, D], down [n, D, I], γ [T, n]."""
    act = activation_fn(spec.activation, params_in(w))
    if kops.deterministic():  # one fixed-order product per shared expert: a row's bits whatever T
        out = None
        for i in range(gammas.shape[1]):
            h = elementwise(act, dense_linear(x, w["gate_proj"][i])) * dense_linear(x, w["up_proj"][i])
            y = dense_linear(h * gammas[:, i : i + 1].to(x.dtype), w["down_proj"][i]).float()
            out = y if out is None else out + y
        return out.to(x.dtype)
    gate = torch.einsum("td,nid->nti", x, w["gate_proj"])  # [n, T, I]
    up = torch.einsum("td,nid->nti", x, w["up_proj"])
    h = elementwise(act, gate) * up * gammas.T.to(x.dtype)[:, :, None]
    return torch.einsum("nti,ndi->ntd", h, w["down_proj"]).float().sum(0).to(x.dtype)  # [T, D]
