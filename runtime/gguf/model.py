"""A GGUF model ready to load: config, spec, reader, tokenizer, and the routed experts in the kernels' block formats.

Legend: ``E`` experts per layer, ``I`` expert intermediate size, ``D`` hidden size, ``nb`` blocks per row, ``P``
bytes per block (Q8_0: 34, Q4_0: 18, Q4_K: 144, Q5_K: 176, Q6_K: 210, MXFP4: 17).

Routed experts (what the engine's ``quant`` option is about):

- stored as **Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K / MXFP4** (``quant.formats.GGUF_NATIVE``): the file's blocks are the
  kernels' blocks byte for byte (``runtime/quant/``), so the expert core (``runtime/experts/core.py``) runs them as
  stored — nothing is dequantized or requantized;
- stored in another **block type** (Q2_K/Q3_K, IQ4_XS, Q4_1, Q5_0/Q5_1): dequantized with the ``gguf``
  package and requantized at load to the nearest format the kernels run (``quant.formats.GGUF_TYPES``: 4-bit types
  → Q4_0, 5-bit → Q8_0), one expert at a time; the relative RMS error of that conversion is measured per tensor and
  reported (``ExpertConversion``, ``freetoken inspect``);
- stored as **F32 / F16 / BF16**: float, as a safetensors folder (``quant="q8"/"q4"`` quantizes them at load).

``quant`` (``none``/``q8_0``/``q4_0``): ``none`` keeps each layer's gate/up and its down in the file's own formats
(``layer_formats``: a Q4_K_M layer runs Q4_K gate/up and Q6_K down as stored; gate and up, which the kernels hold as
one matrix, share one format, the wider one where they differ); ``q8_0`` / ``q4_0`` converts every expert to that
format (a Q5_K file loaded with ``q8_0`` keeps far more of its precision than with ``q4_0``, and as stored all of it).
Dense weights: the 2-D projections the kernels can carry (attention, dense and shared-expert MLPs, the lm_head:
``runtime.kernels.dense``) run as stored where their block type is a kernel format (``quantize_dense``'s ``stored``:
a Q4_K_M file's Q4_K / Q6_K attention and output), the rest (embeddings, norms, routers, other block types) are
dequantized to the compute dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.runtime.gguf.arch import ArchMap, arch_map, expert_prefix
from freetoken_agent.runtime.gguf.file import GGUFFile
from freetoken_agent.runtime.gguf.reader import (
    FLOAT_TYPES,
    ExpertTensorsGGUF,
    GGUFCheckpointReader,
    StoredWeights,
    dequantize,
)
from freetoken_agent.runtime.gguf.tokenizer import chat_template_from_metadata, stop_token_ids, tokenizer_from_metadata
from freetoken_agent.runtime.model.moe import TorchExperts
from freetoken_agent.runtime.model.spec import ModelSpec, MoESpec, WeightNames
from freetoken_agent.runtime.model.weights import TensorLoader
from freetoken_agent.runtime.quant.formats import GGUF_NATIVE, GGUF_TYPES, block_format

def layer_formats(group: ExpertTensorsGGUF, quant: str) -> tuple[str, str] | None:
    """The block formats one MoE layer's experts run in, (gate/up, down) (None: float experts, loaded like a
    safetensors folder)."""
    if quant != "none":
        return quant, quant
    parts = group.parts()
    if all(GGUF_TYPES.get(t.type_name) is None for _, t in parts):
        return None
    return (_shared_format([t for part, t in parts if part != "down"]),
            _shared_format([t for part, t in parts if part == "down"]))


def _shared_format(tensors: list[Any]) -> str:
    """The format stored tensors that the kernels hold as one matrix run in: their own where they are all of one
    natively run type, else the nearest kernel format at least as wide as each (a float one: Q8_0)."""
    types = {t.type_name for t in tensors}
    native = GGUF_NATIVE.get(next(iter(types))) if len(types) == 1 else None
    if native is not None:
        return native
    runs = {GGUF_TYPES.get(t) for t in types}
    return "q4_0" if runs <= {"q4_0", "q4_k", "mxfp4"} else "q8_0"


def part_format(formats: tuple[str, str], part: str) -> str:
    """The format of one stored part (gate, up, gate_up, down) of a layer running in ``formats`` (gate/up, down)."""
    return formats[1] if part == "down" else formats[0]


def plan_name(formats: tuple[str, str] | None) -> str | None:
    """How a layer's formats are shown: ``q4_k+q6_k``, or one name when gate/up and down share it."""
    if formats is None:
        return None
    return formats[0] if formats[0] == formats[1] else "+".join(formats)


@dataclass(frozen=True)
class ExpertConversion:
    """How one stored expert tensor reaches the kernels."""

    layer: int
    part: str  # gate, up, gate_up, down
    stored: str  # ggml type
    runs_as: str  # a kernel format: q8_0 / q4_0 / q4_k / q5_k / q6_k / mxfp4
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
        return any(layer_formats(g, quant) is not None for g in self.reader.experts.values())

    def expert_plan(self, quant: str = "none") -> list[tuple[int, str | None]]:
        """(MoE layer, block formats it runs in (``plan_name``) or None for float), per layer."""
        return [(i, plan_name(layer_formats(g, quant))) for i, g in sorted(self.reader.experts.items())]

    def measure_conversion(self, quant: str = "none", max_experts: int = 4) -> list[ExpertConversion]:
        """The conversion of each stored expert tensor type, measured on the first ``max_experts`` experts of the
        first MoE layer holding it (``freetoken inspect``; the load converts every expert the same way)."""
        out: list[ExpertConversion] = []
        seen: set[tuple[str, str, str]] = set()
        for layer, group in sorted(self.reader.experts.items()):
            formats = layer_formats(group, quant)
            if formats is None:
                continue
            for part, t in group.parts():
                fmt = part_format(formats, part)
                key = (part, t.type_name, fmt)
                if key in seen:
                    continue
                seen.add(key)
                if GGUF_NATIVE.get(t.type_name) == fmt:
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
        """Dense weights in ``dtype`` with the float experts of layers that run float (read as a folder's are), and
        the quantized layers' experts left in the file: ``GGUFExpertLoad.layers()`` reads them as blocks."""
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
        spec = self.spec
        for i, group in sorted(self.reader.experts.items()):
            moe = spec.layers[i].moe
            assert moe is not None
            if layer_formats(group, quant) is None:  # float experts in a file whose other layers are quantized
                te = weights.layers[i].moe.experts
                full = TensorLoader(self.reader, dtype, device).experts(
                    expert_prefix(spec, i), moe, spec.layers[i].names or spec.names, spec.hidden_size)
                te.gate_up, te.down = full.gate_up, full.down
        return GGUFExpertLoad(self, weights, quant, loader.stored)


class _DenseOnly(TensorLoader):
    """The strict loader, except that routed experts are only marked used (``load_quantized`` reads them), and 2-D
    weights stored in a kernel format are remembered (``stored``: they run as stored)."""

    def __init__(self, reader: GGUFCheckpointReader, dtype: torch.dtype, device: Any) -> None:
        super().__init__(reader, dtype, device)
        self.stored = StoredWeights(reader)

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        t = super().take(name, shape, dtype)
        self.stored.note(name, t)
        return t

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

    e, r, c = t.shape
    block = block_format(fmt)
    if GGUF_NATIVE.get(t.type_name) == fmt:
        raw = torch.from_numpy(np.array(t.data))  # [E, R, nb·P] uint8, copied out of the read-only mapping
        return raw.view(e, r, -1, block.block_bytes)
    out = torch.empty(e, r, block.nb(c), block.block_bytes, dtype=torch.uint8)
    for k in range(e):
        out[k] = expert_blocks(t, k, fmt, errors)
    return out


def expert_blocks(t: Any, k: int, fmt: str, errors: list[float]) -> torch.Tensor:
    """Expert ``k`` of stored tensor ``t`` ``[E, R, C]`` as ``fmt`` blocks ``[R, nb, P]``: its stored bytes when they
    already are ``fmt``, else dequantized and requantized (``errors`` gets ||Δ||², ||w||²). The one conversion of
    every expert, whether loaded whole (``_blocks``) or into a budgeted load's expert cache file."""
    import numpy as np

    if GGUF_NATIVE.get(t.type_name) == fmt:
        return torch.from_numpy(np.array(t.data[k])).view(t.shape[1], -1, block_format(fmt).block_bytes)
    w = dequantize(t, k)
    blocks, back = _requantize(w, fmt)
    errors[0] += float((w - back).pow(2).sum())
    errors[1] += float(w.pow(2).sum())
    return blocks


@dataclass(frozen=True)
class GGUFExpertLayer:
    """One quantized MoE layer's experts as read from a GGUF file (what the expert core builds a backend over)."""

    index: int
    fmt: str
    """The block format gate/up run in (a kernel format: ``quant.formats.KERNEL_FORMATS``)."""
    down_fmt: str
    """The block format down runs in (a Q4_K_M file: ``q6_k`` in some layers, ``q4_k`` in the others)."""
    w13: torch.Tensor  # [E, 2I, nb(D), P] uint8: gate rows, then up rows
    w2: torch.Tensor  # [E, D, nb(I), P] uint8
    gate_up_bias: torch.Tensor | None  # [E, 2I] fp32 (GPT-OSS)
    down_bias: torch.Tensor | None  # [E, D] fp32
    float_bytes: int
    """What the stored experts hold as fp32."""


@dataclass
class GGUFExpertLoad:
    """Dense weights plus the routed experts left in the file; ``layers()`` reads each quantized layer's experts as
    blocks (as stored, or converted: each conversion is recorded in ``conversions``)."""

    model: GGUFModel
    weights: Any
    quant: str
    stored: StoredWeights | None = None
    """The dense weights read from kernel-format tensors (``stored_dense``)."""
    conversions: list[ExpertConversion] = field(default_factory=list)

    def stored_dense(self, w: torch.Tensor) -> Any:
        """``quantize_dense``'s ``stored``: a dense weight's blocks as stored, in the kernels' tiles, or ``None``."""
        return self.stored.packed(w) if self.stored is not None else None

    def release(self) -> None:
        """Forget the dense weights as read (after ``quantize_dense`` replaced the ones it runs as stored)."""
        if self.stored is not None:
            self.stored.clear()

    def layers(self) -> Iterator[GGUFExpertLayer]:
        """The quantized MoE layers' experts in layer order (float layers were read by ``load_quantized``)."""
        for i, group in sorted(self.model.reader.experts.items()):
            formats = layer_formats(group, self.quant)
            if formats is None:
                continue
            parts: dict[str, torch.Tensor] = {}
            float_bytes = 0
            for part, t in group.parts():
                fmt = part_format(formats, part)
                errors = [0.0, 0.0]
                parts[part] = _blocks(t, fmt, errors)
                native = GGUF_NATIVE.get(t.type_name) == fmt
                self.conversions.append(ExpertConversion(i, part, t.type_name, fmt, None if native else
                                                         (errors[0] / errors[1]) ** 0.5 if errors[1] else 0.0,
                                                         0 if native else t.shape[0]))
                float_bytes += t.shape[0] * t.shape[1] * t.shape[2] * 4
            w13 = parts["gate_up"] if "gate_up" in parts else torch.cat([parts["gate"], parts["up"]], dim=1)
            gate_up_bias = down_bias = None
            if group.down_bias is not None:  # GPT-OSS: gate/up biases in the kernels' row order (gate, then up)
                assert group.gate_bias is not None and group.up_bias is not None
                gate_up_bias = torch.cat([dequantize(group.gate_bias), dequantize(group.up_bias)], dim=1)
                down_bias = dequantize(group.down_bias)
            yield GGUFExpertLayer(i, formats[0], formats[1], w13, parts["down"], gate_up_bias, down_bias, float_bytes)


def is_float_type(type_name: str) -> bool:
    return type_name in FLOAT_TYPES
