"""Plain-torch references for quantized experts, written from the format rules (not from the C code).

Legend: ``T`` tokens, ``K`` experts per token, ``E`` experts, ``D`` hidden, ``I`` expert intermediate, ``N`` rows.

Two references, one per way ``QuantizedExperts`` computes:

- exact mode / prefill (dequantize + fp32 matmul): plain ``TorchExperts`` over the dequantized weights
  (``dequantized_reference(decoder)``);
- the C decode kernels: they also round each matmul's input activations to int8, per block of 32 values along
  ``K``, with ``d = amax / 127`` (fp32, not rounded to fp16) and codes ``round_half_even(x * (127 / amax))``
  clamped to ±127, zero-padded to whole blocks. ``Int8ActExperts`` is ``TorchExperts`` over the dequantized
  weights whose two matmul inputs (``x`` and the activation output) go through that rounding first. The integer
  dot products of the kernels equal ``fake_quant_int8(x) @ W^T`` up to fp32 summation order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import FreeTokenError
from ..experts.capabilities import capabilities_of

BLOCK = 32


def _scaled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, K]`` → (``x * 127/amax`` per 32-block ``[N, nb, 32]``, ``amax [N, nb, 1]``), zero-padded along K."""
    n, k = x.shape
    xb = torch.nn.functional.pad(x.float(), (0, -k % BLOCK)).view(n, -1, BLOCK)  # [N, nb, 32]
    amax = xb.abs().amax(dim=-1, keepdim=True)  # [N, nb, 1]
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return xb * inv, amax


def fake_quant_int8(x: torch.Tensor) -> torch.Tensor:
    """``x [N, K]`` fp32 → the values the int8 kernels see: per 32-block ``round(x * 127/amax) * amax/127``."""
    n, k = x.shape
    v, amax = _scaled(x)
    q = torch.round(v).clamp_(-127, 127)  # torch.round: half to even, like lrintf / cvtps2dq
    return (q * (amax / 127.0)).view(n, -1)[:, :k]


def near_ties(x: torch.Tensor, tau: float) -> torch.Tensor:
    """``[N, K]``: the int8 step ``amax/127`` of each value lying within ``tau`` (in steps) of a rounding tie, else 0.

    Another fp32 summation order (the kernels') moves such a value across the tie now and then, and its code by
    one step: an honest reference cannot say which way it rounds.
    """
    n, k = x.shape
    v, amax = _scaled(x)
    tie = ((v - torch.floor(v)) - 0.5).abs() < tau
    return torch.where(tie, amax / 127.0, torch.zeros_like(v)).view(n, -1)[:, :k]


@dataclass
class Int8ActExperts:
    """Reference for the int8-activation decode kernels: dequantized fp32 weights, int8-rounded matmul inputs."""

    gate_up: torch.Tensor  # [E, 2I, D] fp32 (dequantized)
    down: torch.Tensor  # [E, D, I] fp32 (dequantized)
    activation: Callable[[torch.Tensor], torch.Tensor]  # [n, 2I] -> [n, I]
    gate_up_bias: torch.Tensor | None = None  # [E, 2I]
    down_bias: torch.Tensor | None = None  # [E, D]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``x [T, D]``, ``topk_ids [T, K]``, ``topk_weights [T, K]`` → ``[T, D]`` in ``x``'s dtype."""
        out = torch.zeros(x.shape[0], self.down.shape[1], dtype=torch.float32)
        for e in topk_ids.unique().tolist():
            tok, slot = (topk_ids == e).nonzero(as_tuple=True)  # tokens routed to e, and which of their K slots
            h = fake_quant_int8(x[tok].float()) @ self.gate_up[e].T  # [n, 2I]
            if self.gate_up_bias is not None:
                h = h + self.gate_up_bias[e]
            y = fake_quant_int8(self.activation(h)) @ self.down[e].T  # [n, D]
            if self.down_bias is not None:
                y = y + self.down_bias[e]
            out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
        return out.to(x.dtype)

    def tie_slack(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, tau: float = 1e-3
    ) -> torch.Tensor:
        """``[T, D]``: how far ``forward`` may honestly be from a kernel that rounds near-tie values the other way.

        Counts the down projection's input (the activation output) only: for the same ``x`` the first rounding is
        bitwise the kernels' (same formula on the same fp32 values). Each near-tie value ``j`` of expert ``e``
        contributes ``step_j * |W_down[e][:, j]| * |w|``.
        """
        slack = torch.zeros(x.shape[0], self.down.shape[1], dtype=torch.float32)
        for e in topk_ids.unique().tolist():
            tok, slot = (topk_ids == e).nonzero(as_tuple=True)
            h = fake_quant_int8(x[tok].float()) @ self.gate_up[e].T
            if self.gate_up_bias is not None:
                h = h + self.gate_up_bias[e]
            steps = near_ties(self.activation(h), tau)  # [n, I]
            slack.index_add_(0, tok, (steps @ self.down[e].abs().T) * topk_weights[tok, slot, None].float().abs())
        return slack

    __call__ = forward


@dataclass
class Int8ActLinear:
    """Reference for a dense weight on the int8 kernels (``QuantLinear``): the dequantized fp32 weight, the input
    rounded like the kernels round it."""

    weight: torch.Tensor  # [N, K] fp32 (dequantized)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = fake_quant_int8(x.reshape(-1, x.shape[-1]).float()) @ self.weight.T
        if bias is not None:
            y = y + bias.float()
        return y.view(*x.shape[:-1], -1).to(x.dtype)


def _dense_references(weights: Any, activations: str) -> None:
    """Every ``QuantLinear`` of ``weights`` → its dequantized fp32 weight (``fp32``) or ``Int8ActLinear``."""
    from .dense import QuantLinear

    def ref(w: Any) -> Any:
        if not isinstance(w, QuantLinear):
            return w
        return w.dequantize() if activations == "fp32" else Int8ActLinear(w.dequantize())

    for lw in weights.layers:
        for table in (lw.attn, lw.mlp, lw.moe.shared if lw.moe is not None else None):
            if table:
                table.update({k: ref(v) for k, v in table.items()})
    weights.lm_head = ref(weights.lm_head)


def dequantized_reference(decoder: Any, activations: str = "fp32", dense: bool = True) -> None:
    """Replace every MoE layer's backend that can dequantize (``capabilities.dequantize``) by a plain-torch
    reference over the fp32 experts its bytes stand for (tests and verification), and with ``dense`` every
    quantized dense weight (``QuantLinear``: ``dense_quant``, or a GGUF file's blocks kept as stored) too.

    ``activations="fp32"``: plain ``TorchExperts`` and fp32 dense weights (the reference for exact mode and
    prefill); ``"int8"``: ``Int8ActExperts`` and ``Int8ActLinear``, which also round matmul inputs like the C
    decode kernels.
    """
    if activations not in ("fp32", "int8"):
        raise FreeTokenError(f"unknown reference activations {activations!r}; expected fp32 or int8")
    if dense:
        _dense_references(decoder.weights, activations)
    for i, lw in enumerate(decoder.weights.layers):
        backend = decoder.experts[i]
        if not capabilities_of(backend).dequantize:
            continue
        te = lw.moe.experts  # the weights' float experts, emptied when the backend was built
        gate_up, down = backend.dequantize()
        if activations == "int8":
            decoder.experts[i] = Int8ActExperts(gate_up, down, te.activation(), backend.gate_up_bias,
                                                backend.down_bias)
            continue
        dtype = te.gate_up.dtype
        te.gate_up, te.down = gate_up.to(dtype), down.to(dtype)
        te.gate_up_bias = None if backend.gate_up_bias is None else backend.gate_up_bias.to(dtype)
        te.down_bias = None if backend.down_bias is None else backend.down_bias.to(dtype)
        decoder.experts[i] = te
