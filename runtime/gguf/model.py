"""A GGUF model ready to load: config, spec, reader, tokenizer, and the routed experts in the kernels' block formats.

Legend: ``E`` experts per layer, ``I`` expert intermediate size, ``D`` hidden size, ``nb`` 32-value blocks per row,
``P`` bytes per block (Q8_0: 34, Q4_0: 18).

Routed experts (what the engine's ``quant`` option is about):

- stored as **Q8_0 / Q4_0**: the file's blocks are the kernels' blocks byte for byte (``runtime/quant/blocks.py``),
  so they go to ``QuantizedExperts.from_blocks`` as stored — nothing is dequantized or requantized;
- stored in another **block type** (K-quants, IQ4_XS, MXFP4, Q4_1, Q5_x): dequantized with the ``gguf`` package and
  requantized at load to the nearest format the kernels run (``RUN_FORMAT``: 4-bit types → Q4_0, 5/6-bit → Q8_0),
  one expert at a time; the relative RMS error of that conversion is measured per tensor and reported
  (``ExpertConversion``, ``freetoken inspect``);
- stored as **F32 / F16 / BF16**: float, as a safetensors folder (``quant="q8"/"q4"`` quantizes them at load).

``quant`` (``none``/``q8_0``/``q4_0``): ``none`` keeps each layer in the file's own format (a layer whose gate/up and
down differ runs in the wider one: a Q4_K_M layer with Q6_K ``down`` runs as Q8_0); ``q8_0`` / ``q4_0`` converts every
expert to that format (a Q4_K file loaded with ``q8_0`` keeps far more of its precision than with ``q4_0``).
Dense weights (attention, embeddings, norms, router, shared experts) are dequantized to the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.runtime.gguf.arch import ArchMap, arch_map
from freetoken_agent.runtime.gguf.file import GGUFFile
from freetoken_agent.runtime.gguf.reader import FLOAT_TYPES, ExpertTensorsGGUF, GGUFCheckpointReader, dequantize
from freetoken_agent.runtime.gguf.tokenizer import chat_template_from_metadata, stop_token_ids, tokenizer_from_metadata
from freetoken_agent.runtime.model.moe import TorchExperts
from freetoken_agent.runtime.model.spec import ModelSpec, MoESpec, WeightNames
from freetoken_agent.runtime.model.weights import TensorLoader

RUN_FORMAT = {
    "Q8_0": "q8_0", "Q4_0": "q4_0",
    "Q4_1": "q4_0", "Q4_K": "q4_0", "Q3_K": "q4_0", "Q2_K": "q4_0", "IQ4_XS": "q4_0", "IQ4_NL": "q4_0",
    "MXFP4": "q4_0", "IQ3_S": "q4_0", "IQ3_XXS": "q4_0", "IQ2_XXS": "q4_0", "IQ2_XS": "q4_0", "IQ2_S": "q4_0",
    "IQ1_S": "q4_0", "IQ1_M": "q4_0", "TQ1_0": "q4_0", "TQ2_0": "q4_0",
    "Q5_0": "q8_0", "Q5_1": "q8_0", "Q5_K": "q8_0", "Q6_K": "q8_0",
}
"""Stored ggml block type → the block format our kernels run it in (the nearest one at least as wide)."""
NATIVE = {"Q8_0": "q8_0", "Q4_0": "q4_0"}
"""Stored types the kernels run as they are."""


def layer_format(group: ExpertTensorsGGUF, quant: str) -> str | None:
    """The block format one MoE layer's experts run in (None: float experts, loaded like a safetensors folder)."""
    if quant != "none":
        return quant
    formats = {RUN_FORMAT.get(t.type_name) for _, t in group.parts()}
    if formats == {None}:
        return None
    return "q8_0" if "q8_0" in formats or None in formats else "q4_0"


@dataclass(frozen=True)
class ExpertConversion:
    """How one stored expert tensor reaches the kernels."""

    layer: int
    part: str  # gate, up, gate_up, down
    stored: str  # ggml type
    runs_as: str  # q8_0 / q4_0
    rel_rms_error: float | None
    """||dequant(stored) − dequant(converted)|| / ||dequant(stored)|| over the measured experts (None: as stored)."""
    experts_measured: int = 0


class GGUFModel:
    """An opened GGUF model (nothing but the header read yet)."""

    def __init__(self, path: str | Path) -> None:
        from freetoken_agent.runtime.model.adapters import spec_from_config

        self.file = GGUFFile(path)
        self.path = self.file.path
        self.arch: ArchMap = arch_map(self.file)
        self.config: dict[str, Any] = self.arch.config(self.file)
        self.spec: ModelSpec = spec_from_config(self.config)
        self.reader = GGUFCheckpointReader(self.file, self.spec, self.arch)

    @property
    def architecture(self) -> str:
        return self.file.architecture

    def tokenizer(self) -> Any:
        return tokenizer_from_metadata(self.file.metadata)

    def chat_template(self, tokenizer: Any = None) -> Any:
        return chat_template_from_metadata(self.file.metadata, tokenizer)

    def generation_config(self) -> dict[str, Any]:
        ids = stop_token_ids(self.file.metadata)
        return {"eos_token_id": ids} if ids else {}

    def quantized_experts(self, quant: str, device: str) -> bool:
        """Whether the routed experts load straight into block formats (CPU, and some layer runs quantized)."""
        if torch.device(device).type != "cpu" or not self.reader.experts:
            return False
        return any(layer_format(g, quant) is not None for g in self.reader.experts.values())

    def expert_plan(self, quant: str = "none") -> list[tuple[int, str | None]]:
        """(MoE layer, block format it runs in or None for float), per layer."""
        return [(i, layer_format(g, quant)) for i, g in sorted(self.reader.experts.items())]

    def measure_conversion(self, quant: str = "none", max_experts: int = 4) -> list[ExpertConversion]:
        """The conversion of each stored expert tensor type, measured on the first ``max_experts`` experts of the
        first MoE layer holding it (``freetoken inspect``; the load converts every expert the same way)."""
        out: list[ExpertConversion] = []
        seen: set[tuple[str, str, str]] = set()
        for layer, group in sorted(self.reader.experts.items()):
            fmt = layer_format(group, quant)
            if fmt is None:
                continue
            for part, t in group.parts():
                key = (part, t.type_name, fmt)
                if key in seen:
                    continue
                seen.add(key)
                if NATIVE.get(t.type_name) == fmt:
                    out.append(ExpertConversion(layer, part, t.type_name, fmt, None))
                    continue
                n = min(max_experts, t.shape[0])
                err = sum_sq = 0.0
                for e in range(n):
                    w = dequantize(t, e)
                    _, back = _requantize(w, fmt)
                    err += float((w - back).pow(2).sum())
                    sum_sq += float(w.pow(2).sum())
                out.append(ExpertConversion(layer, part, t.type_name, fmt, (err / sum_sq) ** 0.5 if sum_sq else 0.0, n))
        return out

    def load_quantized(self, dtype: torch.dtype, device: str, quant: str) -> GGUFExpertLoad:
        """Dense weights in ``dtype`` (experts not read) and every MoE layer's experts as blocks; ``install``."""
        import re

        from freetoken_agent.runtime.errors import UnexpectedTensorError
        from freetoken_agent.runtime.model import weights as weights_mod

        loader = _DenseOnly(self.reader, dtype, device)
        weights = weights_mod.walk_weights(self.spec, loader, None)
        ignored = [re.compile(p) for p in self.spec.ignored_tensors]
        unexpected = [n for n in self.reader.unused() if not any(p.search(n) for p in ignored)]
        if unexpected:
            raise UnexpectedTensorError(f"GGUF tensor {self.reader.gguf_names.get(unexpected[0], unexpected[0])} is "
                                        f"not used by the {self.spec.model_type} architecture")
        return GGUFExpertLoad(self, weights, quant)


class _DenseOnly(TensorLoader):
    """The strict loader, except that routed experts are only marked used (``install`` puts them in place)."""

    def experts(self, prefix: str, m: MoESpec, names: WeightNames, d: int) -> TorchExperts:  # noqa: ARG002
        self.reader.used.update(n for n in self.reader.infos if n.startswith(f"{prefix}.experts."))
        empty = torch.empty(0, dtype=self.dtype)
        return TorchExperts(m, empty, empty)


def _requantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` fp32 → (blocks ``[N, nb, P]``, their dequantized values)."""
    from freetoken_agent.runtime.kernels.ops import quantize_blocks
    from freetoken_agent.runtime.quant.blocks import dequantize as dequantize_blocks

    q = quantize_blocks(w, fmt)
    return q.blocks, dequantize_blocks(q)


def _blocks(t: Any, fmt: str, errors: list[float]) -> torch.Tensor:
    """All experts of stored tensor ``t`` ``[E, R, C]`` as ``fmt`` blocks ``[E, R, nb, P]``: the stored bytes when
    they already are ``fmt``, else dequantized and requantized expert by expert (``errors`` gets ||Δ||², ||w||²)."""
    import numpy as np

    from freetoken_agent.runtime.quant.blocks import BLOCK, BLOCK_BYTES

    e, r, c = t.shape
    p = BLOCK_BYTES[fmt]
    if NATIVE.get(t.type_name) == fmt:
        raw = torch.from_numpy(np.array(t.data))  # [E, R, nb·P] uint8, copied out of the read-only mapping
        return raw.view(e, r, -1, p)
    out = torch.empty(e, r, -(-c // BLOCK), p, dtype=torch.uint8)
    for k in range(e):
        w = dequantize(t, k)
        blocks, back = _requantize(w, fmt)
        out[k] = blocks
        errors[0] += float((w - back).pow(2).sum())
        errors[1] += float(w.pow(2).sum())
    return out


@dataclass
class GGUFExpertLoad:
    """Dense weights plus the routed experts as blocks; ``install(decoder)`` puts ``QuantizedExperts`` in place
    (the same seam and report as the engine's other quantized-expert loads)."""

    model: GGUFModel
    weights: Any
    quant: str
    conversions: list[ExpertConversion] = field(default_factory=list)

    def install(self, decoder: Any) -> Any:
        from freetoken_agent.runtime.kernels import build
        from freetoken_agent.runtime.kernels.apply import QuantReport, TypedExperts
        from freetoken_agent.runtime.kernels.experts import QuantizedExperts

        spec, reader = self.model.spec, self.model.reader
        layers = float_bytes = quant_bytes = 0
        formats: set[str] = set()
        for i, group in sorted(reader.experts.items()):
            moe = spec.layers[i].moe
            assert moe is not None
            fmt = layer_format(group, self.quant)
            te = self.weights.layers[i].moe.experts
            if fmt is None:  # float experts in a file whose other layers are quantized: read as a folder's are
                full = TensorLoader(reader, te.gate_up.dtype, decoder.device).experts(
                    _prefix(spec, i), moe, spec.layers[i].names or spec.names, spec.hidden_size)
                te.gate_up, te.down = full.gate_up, full.down
                continue
            parts: dict[str, torch.Tensor] = {}
            for part, t in group.parts():
                errors = [0.0, 0.0]
                parts[part] = _blocks(t, fmt, errors)
                native = NATIVE.get(t.type_name) == fmt
                self.conversions.append(ExpertConversion(i, part, t.type_name, fmt, None if native else
                                                         (errors[0] / errors[1]) ** 0.5 if errors[1] else 0.0,
                                                         0 if native else t.shape[0]))
                float_bytes += t.shape[0] * t.shape[1] * t.shape[2] * 4
            w13 = parts["gate_up"] if "gate_up" in parts else torch.cat([parts["gate"], parts["up"]], dim=1)
            qe = QuantizedExperts.from_blocks(w13, parts["down"], fmt, spec.hidden_size, moe.intermediate)
            if moe.activation != "silu" or moe.glu_clamp:
                qe.activation = te.activation()
            if group.down_bias is not None:  # GPT-OSS: gate/up biases in the kernels' row order (gate, then up)
                assert group.gate_bias is not None and group.up_bias is not None
                qe.gate_up_bias = torch.cat([dequantize(group.gate_bias), dequantize(group.up_bias)], dim=1)
                qe.down_bias = dequantize(group.down_bias)
            decoder.experts[i] = TypedExperts(qe)
            quant_bytes += qe.nbytes
            formats.add(fmt)
            layers += 1
        fmt_name = "+".join(sorted(formats)) or "none"
        return QuantReport(fmt_name, layers, float_bytes, quant_bytes, build.load() is not None)


def _prefix(spec: ModelSpec, layer: int) -> str:
    from freetoken_agent.runtime.gguf.arch import expert_prefix

    return expert_prefix(spec, layer)


def is_float_type(type_name: str) -> bool:
    return type_name in FLOAT_TYPES
