"""The MoE block: router (top-k selection and weights) and the expert computation seam.

Legend: T tokens, D hidden, E experts, K experts per token, I expert intermediate size.
``ExpertsBackend`` is the seam fast paths plug into (quantized CPU kernels, residency-managed experts); ``TorchExperts``
is the plain-torch reference every fast path is tested against. In deterministic mode (``ops.set_deterministic``)
the router's logits, the reference experts' matmuls and the activations are batch invariant
(``kernels/invariant.py``): a token's routing and expert outputs do not depend on the other tokens of the call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.kernels import invariant
from freetoken_agent.runtime.kernels import ops as kops
from freetoken_agent.runtime.model.activations import Params, activation_fn
from freetoken_agent.runtime.model.layers import dense_linear, elementwise
from freetoken_agent.runtime.model.spec import MoESpec, RouterSpec


class ExpertsBackend(Protocol):
    """Computes the routed experts of one MoE layer."""

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, D], topk_ids [T, K] int64, topk_weights [T, K] fp32 → Σ_k w_k · expert_k(x) as [T, D]."""
        ...


def expert_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [n, In] @ weight [Out, In]^T`` for one expert's tokens; batch invariant in deterministic mode."""
    return invariant.linear(x, weight) if kops.deterministic() else x @ weight.T


def silu_kernel_ok(moe: MoESpec, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, biased: bool,
                   act: Params | None = None) -> bool:
    """Whether the kernels' fp32 MoE (``ops.moe_f32``) computes these experts exactly as specified: fp32 SiLU-gated
    experts without biases or learned activation parameters, on the CPU, with the kernels loaded. Every fp32 expert
    path takes it where this holds (``TorchExperts``, managed float experts, dequantized quantized experts), so they
    stay bitwise equal to one another."""
    return silu_kernel_spec(moe) and not biased and not act and kops.moe_f32_takes(x, gate_up, down)


def silu_kernel_spec(moe: MoESpec) -> bool:
    """Whether experts of this spec are the kind ``ops.moe_f32`` computes (SiLU-gated, no clamp, no biases) — what a
    loader checks before keeping a 16-bit checkpoint's experts as stored (``TensorLoader.expert_dtype``)."""
    return moe.gated and moe.activation == "silu" and not moe.glu_clamp and not moe.expert_bias


def activate(gate_up: torch.Tensor, moe: MoESpec, params: Params | None = None) -> torch.Tensor:
    """[N, 2I] (gate columns then up columns) → [N, I]; ungated experts: [N, I] → [N, I]. ``params``: the tensors
    of a learned activation (``TorchExperts.act``)."""
    if not moe.gated:
        return elementwise(activation_fn(moe.activation, params), gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    if moe.glu_clamp:  # DeepSeek-V4
        gate, up = gate.clamp(max=moe.swiglu_limit), up.clamp(-moe.swiglu_limit, moe.swiglu_limit)
    if moe.activation == "swiglu_oai":
        gate = gate.clamp(max=moe.swiglu_limit)
        up = up.clamp(min=-moe.swiglu_limit, max=moe.swiglu_limit)
        return (up + 1) * (gate * elementwise(torch.sigmoid, gate * moe.swiglu_alpha))
    if moe.activation == "silu":
        return elementwise(F.silu, gate) * up
    if moe.activation == "silu_clamp":
        return elementwise(F.silu, gate.clamp(max=moe.swiglu_limit)) * up.clamp(-moe.swiglu_limit, moe.swiglu_limit)
    if moe.activation == "softcap_swiglu":  # Inkling 2: the sigmoid sees the raw gate, the caps bound the factors
        (cg, cu), g, u = moe.softcaps, gate.float(), up.float()
        return (torch.tanh(g / cg) * cg * torch.sigmoid(g) * torch.tanh(u / cu) * cu).to(gate.dtype)
    return elementwise(activation_fn(moe.activation, params), gate) * up


@dataclass
class TorchExperts:
    """Reference experts: all weights as dense tensors, one matmul pair per hit expert (fp32 SiLU experts: one
    kernel call for all, ``kernel_call``)."""

    spec: MoESpec
    gate_up: torch.Tensor  # [E, 2I, D]
    down: torch.Tensor  # [E, D, I]
    gate_up_bias: torch.Tensor | None = None  # [E, 2I]
    down_bias: torch.Tensor | None = None  # [E, D]
    act: dict[str, torch.Tensor] = field(default_factory=dict)
    """The experts' learned activation parameters (``activations.LEARNED``; empty for plain activations): every
    backend built from these experts applies them through ``activation()``."""

    def activation(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """``activate`` bound to this layer's spec and parameters: [N, 2I] → [N, I]."""
        return partial(activate, moe=self.spec, params=self.act)

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights of one expert: (gate_up [2I, D], down [D, I])."""
        return self.gate_up[e], self.down[e]

    def kernel_call(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` runs on the kernels' fp32 MoE (``ops.moe_f32``: one call for every hit expert, batch
        invariant) rather than a torch matmul pair and a dozen small ops per hit expert (``silu_kernel_ok``)."""
        biased = self.gate_up_bias is not None or self.down_bias is not None
        return silu_kernel_ok(self.spec, x, self.gate_up, self.down, biased, self.act)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] and self.kernel_call(x):
            return kops.moe_f32(self.gate_up, self.down, x, topk_ids, topk_weights)
        if x.device.type != "cpu" and 0 < topk_ids.numel() <= GATHER_PAIRS and not kops.deterministic():
            return self.forward_gathered(x, topk_ids, topk_weights)
        out = torch.zeros_like(x)
        flat_ids = topk_ids.reshape(-1)  # [T*K]
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.spec.num_experts).tolist()
        token_of = order // topk_ids.shape[1]  # [T*K] token index of each sorted slot
        weight_of = topk_weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tokens = token_of[start : start + n]
            gate_up, down = self.gate_up[e], self.down[e]
            if gate_up.dtype != x.dtype:  # 16-bit experts kept as stored (weights.TensorLoader): widened exactly
                gate_up, down = gate_up.to(x.dtype), down.to(x.dtype)
            h = expert_linear(x[tokens], gate_up)  # [n, 2I]
            if self.gate_up_bias is not None:
                h = h + self.gate_up_bias[e]
            h = expert_linear(activate(h, self.spec, self.act), down)  # [n, D]
            if self.down_bias is not None:
                h = h + self.down_bias[e]
            out.index_add_(0, tokens, (h * weight_of[start : start + n, None]).to(out.dtype))
            start += n
        return out

    def forward_gathered(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``forward`` as a dozen device ops whatever the routing: each (token, expert) pair's weights gathered by id
        and run as one batched matmul pair. ``forward`` reads the routing back to the host (a device sync per layer)
        and launches about eight ops per hit expert; on an accelerator that is most of a decode step
        (``GATHER_PAIRS``). Equal to ``forward`` up to rounding: the K terms of a token are summed in one op."""
        t, k = topk_ids.shape
        ids = topk_ids.reshape(-1)  # [P = T*K]
        xs = x.repeat_interleave(k, dim=0)[:, None, :]  # [P, 1, D]
        h = torch.bmm(xs, self.gate_up.index_select(0, ids).transpose(1, 2))[:, 0]  # [P, 2I]
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias.index_select(0, ids)
        h = activate(h, self.spec, self.act)
        h = torch.bmm(h[:, None, :], self.down.index_select(0, ids).transpose(1, 2))[:, 0]  # [P, D]
        if self.down_bias is not None:
            h = h + self.down_bias.index_select(0, ids)
        h = (h * topk_weights.reshape(-1, 1)).to(x.dtype)
        return h.view(t, k, -1).sum(dim=1)


GATHER_PAIRS = 16
"""``TorchExperts`` on an accelerator runs up to this many (token, expert) pairs (a decode step of a sequence or two)
through ``forward_gathered``: copying their experts' weights costs less there than a host round trip and ~8 launches
per expert. Measured on an H200 with a 8-layer, 32-expert top-4 model (``evals/perf/RESULTS.md``)."""


def route(
    x: torch.Tensor,
    spec: RouterSpec,
    top_k: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    correction: torch.Tensor | None = None,
    fixed_ids: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] → (topk_ids [T, K] int64, topk_weights [T, K] fp32). ``fixed_ids`` [T, K]: the experts are already
    chosen (hash routing); only their weights are computed. ``logits`` [T, E] fp32: the router's product, already
    computed as below (the fused decode step's, ``model/fused.py``)."""
    linear = invariant.linear if kops.deterministic() else F.linear
    if spec.scoring == "sparsemixer":
        return _sparsemixer(linear(x, weight, bias).float(), spec.jitter_eps, top_k)
    if logits is None:
        # [T, E]. A decode step's router weight is cold (the experts streamed through the cache since): measured
        # 36 us in torch, 20 us through the pool on 2 threads
        logits = dense_linear(_fp32(x), _fp32(weight), None if bias is None else _fp32(bias))
    if (chosen := _kernel_route(logits, spec, top_k, correction, fixed_ids)) is not None:
        return chosen
    if spec.topk_before_scoring:
        top, ids = torch.topk(logits, top_k, dim=-1)
        weights = elementwise(torch.sigmoid, top) if spec.scoring == "sigmoid" else torch.softmax(top, dim=-1)
        if spec.norm_topk and spec.scoring == "sigmoid":
            weights = weights / (weights.sum(dim=-1, keepdim=True) + spec.norm_eps)
        return ids, weights * spec.scaling
    if spec.logit_softcap > 0:
        logits = elementwise(torch.tanh, logits / spec.logit_softcap) * spec.logit_softcap
    if spec.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif spec.scoring == "sqrtsoftplus":  # DeepSeek-V4
        scores = torch.sqrt(elementwise(F.softplus, logits))
    else:
        scores = elementwise(torch.sigmoid, logits)
    if fixed_ids is not None:
        return _weigh(scores, fixed_ids.long(), spec)
    base = logits if spec.correction_on_logits else scores
    choice = base + correction.float().reshape(-1) if correction is not None else base
    if spec.n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, spec.n_group, e // spec.n_group)  # [T, G, E/G]
        if spec.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep_groups = torch.topk(group_scores, spec.topk_group, dim=-1).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(t, e)
        choice = choice.masked_fill(~expert_mask, spec.group_masked_value)
    return _weigh(scores, torch.topk(choice, top_k, dim=-1).indices, spec)


def kernel_route_mode(spec: RouterSpec, correction: torch.Tensor | None = None,
                      fixed_ids: torch.Tensor | None = None) -> int | None:
    """``ft_route``'s mode for this router (0: softmax, then top-k; 1: top-k, then softmax over it), or None where
    ``route`` computes the choice in torch (other scorings, a correction bias, groups, hash routing, caps, p-norms)."""
    if spec.topk_before_scoring:  # the scores of the chosen logits: a softmax over them ("none" or "softmax")
        return 1 if spec.scoring in ("none", "softmax") and fixed_ids is None else None
    if (spec.scoring != "softmax" or spec.logit_softcap > 0 or correction is not None or fixed_ids is not None
            or spec.n_group > 1 or spec.norm_p != 1.0 or spec.norm_min is not None):
        return None
    return 0


def _kernel_route(logits: torch.Tensor, spec: RouterSpec, top_k: int, correction: torch.Tensor | None,
                  fixed_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The choice through the kernels' ``ft_route`` (one call instead of ~6 torch ops; the fused decode step makes
    the same call, so a token routes alike in a prefill and in a decode step), or None where it does not apply."""
    mode = kernel_route_mode(spec, correction, fixed_ids)
    if mode is None or logits.dtype is not torch.float32 or not logits.is_cpu or logits.dim() != 2:
        return None
    return kops.route(logits, top_k, mode, spec.norm_topk and mode == 0, spec.norm_eps, spec.scaling)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """``t.float()`` without the call when it already is (a decode step routes once per layer: µs per call)."""
    return t if t.dtype is torch.float32 else t.float()


def _weigh(scores: torch.Tensor, ids: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen experts' scores [T, K], normalized and scaled as the router spec says."""
    weights = scores.gather(1, ids)
    if spec.norm_topk:
        total = weights.sum(dim=-1, keepdim=True) if spec.norm_p == 1.0 else weights.norm(spec.norm_p, -1, True)
        denom = total + spec.norm_eps if spec.norm_eps else total
        if spec.norm_min is not None:
            denom = denom.clamp(min=spec.norm_min)
        weights = weights / denom
    return ids, weights * spec.scaling if spec.scaling != 1.0 else weights  # no op for nothing: decode pays per op


def _sparsemixer(scores: torch.Tensor, eps: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's inference-time SparseMixer: top-2, each weight a softmax over the logits near its maximum."""
    if top_k != 2:
        raise ValueError("sparsemixer routing is defined for top-2 only")
    ids, weights, masked = [], [], scores
    for _ in range(2):
        top, idx = masked.max(dim=-1, keepdim=True)
        factor = scores.abs().clamp(min=top)
        gates = masked.masked_fill((top - scores) / factor > 2 * eps, float("-inf"))
        weights.append(torch.softmax(gates, dim=-1).gather(-1, idx))
        ids.append(idx)
        masked = torch.scatter(scores, -1, idx, float("-inf"))
    return torch.cat(ids, dim=-1), torch.cat(weights, dim=-1)
