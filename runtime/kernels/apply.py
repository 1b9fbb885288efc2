"""Swap a loaded decoder's routed experts for ``QuantizedExperts`` (the engine's ``quant=`` option).

Dense weights (attention, embeddings, shared experts, router) stay in the compute dtype. Each MoE layer's
``TorchExperts`` is quantized to Q8_0 / Q4_0 and its float tensors are released, so host memory drops to the
quantized size. The decoder reads experts through ``decoder.experts[i]`` (the ``ExpertsBackend`` seam), so nothing
else changes. (Without a budget the engine maps the experts from the expert cache file instead: ``mapped.py``.)

Modes (``set_expert_mode``): ``auto`` picks int8-activation C kernels or dequantize + fp32 per expert by tokens
routed; ``exact`` always dequantizes (matches ``dequantized_reference`` to fp32 rounding); ``int8`` always uses
the kernels (matches ``dequantized_reference(..., activations="int8")``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import FreeTokenError, OptionError
from ..quant.blocks import canonical_format
from .experts import QuantizedExperts

QUANT_CHOICES = ("none", "q8", "q4")
EXPERT_MODES = ("auto", "exact", "int8")


@dataclass(frozen=True)
class QuantReport:
    """What quantization did: format, layers converted, bytes before/after, whether the C kernels run."""

    fmt: str
    layers: int
    float_bytes: int
    quant_bytes: int
    kernels: bool
    cache: Path | None = None
    """The expert cache file the experts are mapped from (``None``: quantized in memory)."""
    written: bool = False
    """Whether this load quantized the experts (``False`` with a ``cache``: mapped, nothing quantized)."""


class _TypedExperts:
    """Wraps ``QuantizedExperts`` so the output has the input's dtype (the decoder may run in bf16)."""

    def __init__(self, inner: QuantizedExperts) -> None:
        self.inner = inner

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        w = topk_weights if topk_weights.dtype is torch.float32 else topk_weights.float()
        out = self.inner.forward(x, topk_ids, w)
        return out if out.dtype == x.dtype else out.to(x.dtype)


TypedExperts = _TypedExperts
"""Public name of the wrapper, for loaders outside this package that install ``QuantizedExperts`` (the GGUF
loader): ``set_expert_mode`` and ``dequantized_reference`` recognize what they install."""


def check_quant(quant: str | None) -> str:
    """Normalize a user's ``--quant`` value (``none``/``q8``/``q4``, ``q8_0``/``q4_0`` accepted)."""
    q = (quant or "none").lower()
    if q in ("none", "fp", "float", ""):
        return "none"
    if q in ("q8", "q8_0", "q4", "q4_0"):
        return canonical_format(q)
    raise OptionError(f"unknown --quant {quant!r}; expected one of {', '.join(QUANT_CHOICES)}")


def quantize_experts(decoder: Any, quant: str) -> QuantReport | None:
    """Replace every MoE layer's experts of ``decoder`` (a ``runtime.model.decoder.Decoder``) in place."""
    fmt = check_quant(quant)
    if fmt == "none":
        return None
    from ..model.moe import TorchExperts

    layers = float_bytes = quant_bytes = 0
    packed = False
    done: dict[int, Any] = {}
    for i, lw in enumerate(decoder.weights.layers):
        if lw.moe is None or not isinstance(lw.moe.experts, TorchExperts):
            continue
        te: TorchExperts = lw.moe.experts
        if id(te) in done:  # a layer visited again (a loop's later pass) shares its experts
            decoder.experts[i] = done[id(te)]
            continue
        if te.gate_up.device.type != "cpu":
            raise FreeTokenError("quantized experts run on the CPU; load with device='cpu' (GPU slots come later)")
        qe = QuantizedExperts.from_float(te.gate_up, te.down, fmt)  # converted to fp32 chunk by chunk
        if te.spec.activation != "silu" or te.spec.glu_clamp:
            qe.activation = te.activation()
        if te.gate_up_bias is not None:
            qe.gate_up_bias = te.gate_up_bias.float()
        if te.down_bias is not None:
            qe.down_bias = te.down_bias.float()
        float_bytes += te.gate_up.nbytes + te.down.nbytes
        quant_bytes += qe.nbytes
        packed = qe.packed
        decoder.experts[i] = done[id(te)] = _TypedExperts(qe)
        # release the float experts: the decoder only reads them through decoder.experts[i]
        te.gate_up = torch.empty(0, dtype=te.gate_up.dtype)
        te.down = torch.empty(0, dtype=te.down.dtype)
        layers += 1
    return QuantReport(fmt, layers, float_bytes, quant_bytes, packed)


def set_expert_mode(decoder: Any, mode: str) -> int:
    """Set how every quantized MoE layer computes (``auto``, ``exact``, ``int8``; see above); returns the count."""
    if mode not in EXPERT_MODES:
        raise FreeTokenError(f"unknown expert mode {mode!r}; expected one of {', '.join(EXPERT_MODES)}")
    layers = [b.inner for b in decoder.experts if isinstance(b, _TypedExperts)]
    if mode == "int8" and any(not qe.packed for qe in layers):
        raise FreeTokenError("int8 expert mode needs the C kernels, which are unavailable here")
    for qe in layers:
        qe.exact = mode == "exact"
        qe.dequant_threshold = 2**62 if mode == "int8" else None  # None: measured (or $FREETOKEN_DEQUANT_THRESHOLD)
    return len(layers)


def dequantized_reference(decoder: Any, activations: str = "fp32") -> None:
    """Replace every quantized layer by a plain-torch reference over its dequantized weights (tests/verification).

    ``activations="fp32"``: plain ``TorchExperts`` (the reference for exact mode and prefill); ``"int8"``:
    ``reference.Int8ActExperts``, which also rounds matmul inputs like the C decode kernels.
    """
    from .reference import Int8ActExperts

    if activations not in ("fp32", "int8"):
        raise FreeTokenError(f"unknown reference activations {activations!r}; expected fp32 or int8")
    for i, lw in enumerate(decoder.weights.layers):
        backend = decoder.experts[i]
        if not isinstance(backend, _TypedExperts):
            continue
        qe, te = backend.inner, lw.moe.experts
        gate_up, down = qe.dequantize()
        if activations == "int8":
            decoder.experts[i] = Int8ActExperts(gate_up, down, te.activation(),
                                                qe.gate_up_bias, qe.down_bias)
            continue
        dtype = te.gate_up.dtype
        te.gate_up, te.down = gate_up.to(dtype), down.to(dtype)
        te.gate_up_bias = None if qe.gate_up_bias is None else qe.gate_up_bias.to(dtype)
        te.down_bias = None if qe.down_bias is None else qe.down_bias.to(dtype)
        decoder.experts[i] = te
