"""Quantized dense weights (the engine's ``dense_quant=`` option): attention projections, dense MLPs, lm_head.

On a CPU a decode step reads every dense weight once per token. With fp32 dense weights that dominates a small-active
MoE (the 1.28B model of ``evals/perf/bench_gguf_decode.py`` reads 235 MB of fp32 dense weights per token against
~85 MB of Q4_0 experts), so llama.cpp's habit — everything in GGUF blocks — is available here too, but only when asked:
dense weights stay in the compute dtype by default.

``QuantLinear`` holds one ``[N, K]`` weight in the C kernels' packed Q8_0 / Q4_0 tiles and is called like
``F.linear`` (``layers.linear`` and ``Decoder.logits`` dispatch on it). Only weights consumed solely through those two
call sites are converted: the projections of GQA and MLA attention, dense and shared-expert MLPs, and the lm_head.
Recurrent mixers, routers, norms and the embedding stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import FreeTokenError
from ..model.spec import ModelSpec
from ..model.weights import ModelWeights
from ..quant.blocks import canonical_format
from . import hugepages, ops
from .layout import TILE_ROWS

# leaves read only through ``layers.linear`` (see gqa_attention / mla_attention / output_gate / mlp)
ATTENTION_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                    "kv_b_proj", "gate")  # fmt: skip
MLP_LEAVES = ("gate_proj", "up_proj", "down_proj", "input_linear", "output_linear")


class QuantLinear:
    """A dense ``[N, K]`` weight in packed Q8_0 / Q4_0 tiles; ``ql(x, bias)`` equals ``F.linear(x, W, bias)`` up to
    quantization (weights) and per-block int8 rounding (activations), in ``x``'s dtype."""

    def __init__(self, weight: torch.Tensor, fmt: str) -> None:
        if weight.dim() != 2:
            raise FreeTokenError(f"dense quantization expects a 2-D weight, got shape {tuple(weight.shape)}")
        self.fmt = canonical_format(fmt)
        self.shape = tuple(weight.shape)
        self.packed = ops.PackedWeight.from_blocks(ops.quantize(weight.float(), self.fmt))

    @classmethod
    def from_packed(cls, packed: ops.PackedWeight) -> QuantLinear:
        """A weight already in the kernels' tiles (any kernel format: a GGUF file's Q4_K / Q6_K / ... blocks as
        stored, repacked)."""
        ql = cls.__new__(cls)
        ql.fmt, ql.shape, ql.packed = packed.fmt, (packed.n, packed.k), packed
        return ql

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    fused: FusedRows | None = None
    """Set when this weight's tiles lie right after or before others of the same input (``FusedRows``)."""
    exact: torch.Tensor | None = None
    """Set by ``set_dense_mode(..., "exact")``: the dequantized weight, multiplied in fp32 instead of the int8 kernel
    (the reference the oracle tests compare with)."""

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        if self.exact is not None:
            return F.linear(x, self.exact.to(x.dtype), bias)
        y = ops.linear(self.packed, x.reshape(-1, k))
        if bias is not None:
            y += bias.float()
        y = y.view(*x.shape[:-1], n)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The fp32 values the kernel multiplies with (tests and reference engines)."""
        return ops.dequantize(self.packed)


def dense_weights(weights: ModelWeights) -> list[QuantLinear]:
    """Every ``QuantLinear`` in loaded weights (attention, MLPs, shared experts, lm_head)."""
    tables = [t for lw in weights.layers for t in (lw.attn, lw.mlp, lw.moe.shared if lw.moe else None) if t]
    found = [w for t in tables for w in t.values() if isinstance(w, QuantLinear)]
    return found + ([weights.lm_head] if isinstance(weights.lm_head, QuantLinear) else [])


def set_dense_mode(weights: ModelWeights, mode: str) -> int:
    """``exact``: the quantized dense weights multiply dequantized in fp32 (values exactly as stored, activations not
    rounded); ``int8`` / ``auto``: the kernels (default). Returns how many weights it set."""
    if mode not in ("auto", "exact", "int8"):
        raise FreeTokenError(f"unknown dense mode {mode!r}; expected auto, exact or int8")
    found = dense_weights(weights)
    for ql in found:
        ql.exact = ql.dequantize() if mode == "exact" else None
    return len(found)


@dataclass(frozen=True)
class DenseQuantReport:
    """What ``quantize_dense`` converted: format, weight count, bytes before and after."""

    fmt: str
    weights: int
    float_bytes: int
    quant_bytes: int


STORED = "as stored"
"""``DenseQuantReport.fmt`` when every converted weight kept the block type it was stored in (a GGUF file's)."""


def quantize_dense(
    spec: ModelSpec, weights: ModelWeights, fmt: str,
    stored: Callable[[torch.Tensor], ops.PackedWeight | None] | None = None,
) -> DenseQuantReport | None:  # fmt: skip
    """Convert the dense weights of loaded ``ModelWeights`` in place (``fmt`` ``none``/``q8``/``q4``).

    ``stored``: for a weight read from blocks a kernel computes in (a GGUF file's Q8_0 / Q4_0 / K-quant / MXFP4
    tensors), those blocks in the kernels' tiles — the weight then runs as stored, not requantized and not in
    float; ``None`` for a weight that has none (it is quantized to ``fmt``, or stays float with ``none``)."""
    from ..quant.formats import check_quant
    from . import build

    fmt = check_quant(fmt)
    if fmt == "none" and stored is None:
        return None
    if build.load() is None:
        if fmt == "none":
            return None  # the stored blocks were dequantized: float weights, as without kernels anywhere
        raise FreeTokenError(f"dense quantization needs the CPU kernels ({build.status().reason}); use dense_quant=none")
    if weights.embed.device.type != "cpu":
        if fmt == "none":
            return None
        raise FreeTokenError("quantized dense weights run on the CPU kernels; load with device='cpu'")
    count = before = after = 0
    made: list[QuantLinear] = []
    formats: set[str] = set()

    def quant(w: torch.Tensor) -> QuantLinear | None:
        packed = stored(w) if stored is not None else None
        if packed is not None:
            formats.add(STORED)
            return QuantLinear.from_packed(packed)
        if fmt == "none":
            return None
        formats.add(fmt)
        return QuantLinear(w, fmt)

    def convert(table: dict[str, Any], leaves: tuple[str, ...]) -> None:
        nonlocal count, before, after
        for leaf in leaves:
            w = table.get(f"{leaf}.weight")
            if isinstance(w, torch.Tensor) and w.dim() == 2:
                ql = quant(w)
                if ql is None:
                    continue
                table[f"{leaf}.weight"] = ql
                made.append(ql)
                count, before, after = count + 1, before + w.nbytes, after + ql.nbytes

    for layer, lw in zip(spec.layers, weights.layers):
        if layer.recurrent is None and layer.attention is not None and layer.attention.kind in ("gqa", "mla"):
            convert(lw.attn, ATTENTION_LEAVES)
        if lw.mlp is not None:
            convert(lw.mlp, MLP_LEAVES)
        if lw.moe is not None and lw.moe.shared:
            convert(lw.moe.shared, MLP_LEAVES)
    head = weights.lm_head
    if isinstance(head, torch.Tensor):
        ql = quant(head)
        if ql is not None:
            weights.lm_head = ql  # type: ignore[assignment]
            made.append(ql)
            count, before, after = count + 1, before + head.nbytes * (head is not weights.embed), after + ql.nbytes
    if not made:
        return None
    # every packed weight in one allocation of 2 MiB pages (hugepages.py): a decode step streams them all
    if hugepages.enabled() and hugepages.fits(after):
        for ql, data in zip(made, hugepages.arena([ql.packed.data for ql in made])):
            ql.packed = ops.PackedWeight(ql.packed.fmt, ql.packed.n, ql.packed.k, data)
    for lw in weights.layers:  # q|k|v (and gate|up) that lie back to back: one kernel call for all of them
        for table, leaves in ((lw.attn, ("q_proj", "k_proj", "v_proj")), (lw.mlp, ("gate_proj", "up_proj")),
                              (lw.moe.shared if lw.moe is not None else None, ("gate_proj", "up_proj"))):
            if table:
                FusedRows.join([table.get(f"{leaf}.weight") for leaf in leaves])
    return DenseQuantReport("+".join(sorted(formats)), count, before, after)


@dataclass(frozen=True)
class FusedRows:
    """Quantized weights of one input whose tiles lie back to back in memory (``parts``, in order): one
    ``ops.linear`` over all their rows, split into each one's output — the same values as one call each (every
    row's dot product is the same), one hand-out to the kernels' pool instead of one per weight."""

    packed: ops.PackedWeight
    parts: tuple[QuantLinear, ...]

    @classmethod
    def join(cls, weights: list[Any]) -> FusedRows | None:
        """Fuse ``weights`` when they are ``QuantLinear`` of one format and width, each a whole number of tiles,
        each starting where the one before ends (the hugepage arena lays them out so); sets their ``fused``."""
        if len(weights) < 2 or not all(isinstance(w, QuantLinear) for w in weights):
            return None
        first = weights[0].packed
        datas = [w.packed.data for w in weights]
        if any(w.packed.fmt != first.fmt or w.packed.k != first.k or w.packed.n % TILE_ROWS for w in weights):
            return None
        if any(a.data_ptr() + a.numel() != b.data_ptr() for a, b in zip(datas, datas[1:])):
            return None
        if any(d.untyped_storage().data_ptr() != datas[0].untyped_storage().data_ptr() for d in datas):
            return None
        span = torch.empty(0, dtype=torch.uint8).set_(datas[0].untyped_storage(), datas[0].storage_offset(),
                                                      (sum(d.numel() for d in datas),))
        fused = cls(ops.PackedWeight(first.fmt, sum(w.packed.n for w in weights), first.k, span), tuple(weights))
        for w in weights:
            w.fused = fused
        return fused

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        k = self.packed.k
        y = ops.linear(self.packed, x.reshape(-1, k))
        outs, at = [], 0
        for w in self.parts:
            n = w.packed.n
            part = y[:, at : at + n].contiguous().view(*x.shape[:-1], n)
            outs.append(part if part.dtype == x.dtype else part.to(x.dtype))
            at += n
        return outs
