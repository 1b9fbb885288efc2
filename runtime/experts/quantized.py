"""The one recipe for quantized expert backends, and the three sources of their bytes.

Legend: ``L`` MoE layers, ``E`` experts, ``D`` hidden, ``I`` expert intermediate size, ``nb`` blocks per row,
``P`` bytes per block.

``quantized_experts`` is the only place a layer's ``QuantizedExperts`` is made for a decoder: its activation (SiLU
unless the MoE spec says otherwise), biases and placement are constructor arguments, and its output comes back in
the input's dtype, so nothing wraps or patches it afterwards. The sources:

- ``from_weights``: float experts already loaded (``TorchExperts``) quantized in memory, their floats released;
- ``from_blobs``: the expert cache file's blobs (``mapped.py``), viewed in place;
- ``from_gguf``: a GGUF file's expert blocks, as stored or converted (``runtime/gguf/model.py``), gate/up and down
  each in its own format (a Q4_K_M file: Q4_K and Q6_K).

Each returns the backends by MoE layer and a ``QuantReport``; ``core.build_experts`` picks the source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.kernels.experts import QuantizedExperts
from freetoken_agent.runtime.model.moe import TorchExperts, activate
from freetoken_agent.runtime.model.spec import MoESpec


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


def activation_for(moe: MoESpec, params: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The experts' activation ``[N, 2I] → [N, I]`` (ungated: ``[N, I] → [N, I]``) for the kernels' non-fused path;
    ``None``: plain SiLU(gate)*up, which the fused C call computes itself."""
    if moe.activation == "silu" and not moe.glu_clamp and moe.gated:
        return None
    return partial(activate, moe=moe, params=params)


def quantized_experts(
    fmt: str, w13: torch.Tensor, w2: torch.Tensor, hidden: int, moe: MoESpec, params: dict[str, torch.Tensor],
    packed: bool, biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None), placement: str = "resident",
    down_fmt: str | None = None,
) -> QuantizedExperts:  # fmt: skip
    """One MoE layer's backend over stored expert bytes ``w13 [E, b13]`` (``fmt``) / ``w2 [E, b2]`` (``down_fmt``,
    default ``fmt``; see the module docstring); ``params``: the experts' learned activation parameters
    (``TorchExperts.act``)."""
    return QuantizedExperts(fmt, w13, w2, hidden, moe.intermediate, packed, activation=activation_for(moe, params),
                            gate_up_bias=biases[0], down_bias=biases[1], placement=placement, down_fmt=down_fmt,
                            gated=moe.gated)


def from_weights(weights: Any, fmt: str, kernels: bool) -> tuple[dict[int, Any], QuantReport]:
    """Quantize every MoE layer's loaded float experts (``TorchExperts``) in memory, into the kernels' tiles when
    ``kernels``; their float tensors are released, so host memory drops to the quantized size. A layer visited again
    (a loop's later pass) shares its experts' backend."""
    backends: dict[int, Any] = {}
    layers = float_bytes = quant_bytes = 0
    done: dict[int, QuantizedExperts] = {}
    for i, lw in enumerate(weights.layers):
        if lw.moe is None or not isinstance(lw.moe.experts, TorchExperts):
            continue
        te: TorchExperts = lw.moe.experts
        if id(te) in done:
            backends[i] = done[id(te)]
            continue
        if te.gate_up.device.type != "cpu":
            raise FreeTokenError("quantized experts run on the CPU; load with device='cpu' (GPU slots come later)")
        stored = QuantizedExperts.stored(*QuantizedExperts.quantize(te.gate_up, te.down, fmt), fmt, kernels)
        biases = (None if te.gate_up_bias is None else te.gate_up_bias.float(),
                  None if te.down_bias is None else te.down_bias.float())
        qe = quantized_experts(fmt, *stored, te.gate_up.shape[2], te.spec, te.act, kernels, biases)
        float_bytes += te.gate_up.nbytes + te.down.nbytes
        quant_bytes += qe.nbytes
        backends[i] = done[id(te)] = qe
        # release the float experts: the decoder only reads them through its backends
        te.gate_up = torch.empty(0, dtype=te.gate_up.dtype)
        te.down = torch.empty(0, dtype=te.down.dtype)
        layers += 1
    return backends, QuantReport(fmt, layers, float_bytes, quant_bytes, kernels)


def from_blobs(spec: Any, weights: Any, mapped: Any) -> tuple[dict[int, Any], QuantReport]:
    """One ``QuantizedExperts`` per MoE layer over the mapped blobs ``[L, E, S]`` of ``mapped``
    (``mapped.MappedExperts``): strided views, no copy."""
    lay = mapped.layout
    placement = "resident" if mapped.cache is None else "mapped"  # no cache file could be written: in memory
    backends: dict[int, Any] = {}
    quant_bytes = 0
    for j, layer in enumerate(mapped.layers):
        moe = spec.layers[layer].moe
        assert moe is not None
        views = lay.views(mapped.blobs[j])
        assert views.w13 is not None and views.w2 is not None
        act = weights.layers[layer].moe.experts.act  # the loader's empty experts carry the activation's parameters
        qe = quantized_experts(lay.fmt, views.w13, views.w2, lay.hidden, moe, act, lay.packed,
                               (views.gate_up_bias, views.down_bias), placement)
        backends[layer] = qe
        quant_bytes += qe.nbytes
    return backends, QuantReport(lay.fmt, len(mapped.layers), mapped.float_bytes, quant_bytes, lay.packed,
                                 mapped.cache, mapped.written)


def from_gguf(spec: Any, weights: Any, load: Any, kernels: bool) -> tuple[dict[int, Any], QuantReport]:
    """One ``QuantizedExperts`` per quantized MoE layer of a GGUF file (``gguf.model.GGUFExpertLoad``): blocks as
    stored where the kernels run them, else converted (the load records each conversion)."""
    backends: dict[int, Any] = {}
    float_bytes = quant_bytes = 0
    formats: set[str] = set()
    for layer in load.layers():
        moe = spec.layers[layer.index].moe
        assert moe is not None
        act = weights.layers[layer.index].moe.experts.act
        w13, w2 = QuantizedExperts.stored(layer.w13, layer.w2, layer.fmt, kernels, spec.hidden_size,
                                          moe.intermediate, layer.down_fmt)
        qe = quantized_experts(layer.fmt, w13, w2, spec.hidden_size, moe, act, kernels,
                               (layer.gate_up_bias, layer.down_bias), down_fmt=layer.down_fmt)
        backends[layer.index] = qe
        float_bytes += layer.float_bytes
        quant_bytes += qe.nbytes
        formats.update((layer.fmt, layer.down_fmt))
    return backends, QuantReport("+".join(sorted(formats)) or "none", len(backends), float_bytes, quant_bytes,
                                 kernels)
