"""Quantized routed experts mapped from the expert cache file: the ``quant=`` path without a memory budget.

Legend: ``L`` MoE layers, ``E`` experts per layer, ``S`` blob stride in the file (bytes).

The first load quantizes and repacks every expert once — one expert in memory at a time, never the float
checkpoint as a whole — into the expert-major cache file of ``runtime/experts/cache_file.py`` (the residency
path's file: same key, checkpoint files + blob layout, so a changed checkpoint or format gets a new file). Every
later load checks the file (header, size, CRC-32 of the data) and reads it into 2 MiB pages (``hugepages.py``;
a copy-on-write mapping where those are unavailable): each MoE layer gets a ``QuantizedExperts`` whose
``w13``/``w2`` are strided views into that memory (the kernels take a row stride), so nothing is quantized. A
damaged file is rewritten with a one-line warning; when the cache cannot be written at all (read-only or full disk)
the experts are quantized into memory, with a warning.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.experts import ExpertTensors
from ..errors import UnexpectedTensorError
from ..experts.cache_file import cache_key, cache_root, open_or_write
from ..experts.layout import ExpertLayout
from ..model.spec import ModelSpec
from . import build, hugepages, ops
from .apply import QuantReport, _TypedExperts
from .experts import QuantizedExperts

QUANTIZED_EXPERTS = [0]
"""Experts quantized by this process (a counter; tests use it to prove a cached load quantized nothing)."""


def supported(spec: ModelSpec, device: str) -> bool:
    """Whether this path applies: CPU, gated experts, every MoE layer with the same expert shape and count."""
    moes = [layer.moe for layer in spec.layers if layer.moe is not None]
    shapes = {(m.intermediate, m.num_experts, m.expert_bias, m.gated) for m in moes}
    return torch.device(device).type == "cpu" and len(shapes) == 1 and all(m.gated for m in moes)


def encoder(layout: ExpertLayout) -> Any:
    """``ExpertTensors → blob`` in ``layout``: the C quantizer where the kernels load (same rules, ~3x faster)."""
    if build.load() is None:
        c_quantize = None
    else:
        c_quantize = ops.quantize

    def encode(t: ExpertTensors) -> torch.Tensor:
        QUANTIZED_EXPERTS[0] += 1
        if c_quantize is None:
            return layout.encode(t)
        parts: dict[str, torch.Tensor] = {}
        for name, w in (("gate_up", t.gate_up), ("down", t.down)):  # bf16/fp16 read as they are
            parts[name] = ops.quantize_packed(w, layout.fmt) if layout.packed else c_quantize(w, layout.fmt).blocks
        if layout.bias:
            assert t.gate_up_bias is not None and t.down_bias is not None
            parts["gate_up_bias"], parts["down_bias"] = t.gate_up_bias.float(), t.down_bias.float()
        out = torch.zeros(layout.blob_bytes, dtype=torch.uint8)
        for name, (a, b) in layout.offsets.items():
            out[a:b] = parts[name].contiguous().reshape(-1).view(torch.uint8)
        return out

    return encode


@dataclass
class MappedLoad:
    """Dense weights plus every MoE layer's expert blobs; ``install(decoder)`` wires them in."""

    weights: Any  # runtime.model.weights.ModelWeights (routed experts left empty)
    spec: ModelSpec
    layout: ExpertLayout
    layers: list[int]
    blobs: torch.Tensor  # [L, E, S] uint8: a view of the mapped file, or memory when no cache could be written
    cache: Path | None
    written: bool
    float_bytes: int

    def install(self, decoder: Any) -> QuantReport:
        """Give every MoE layer of ``decoder`` a ``QuantizedExperts`` over its blobs (no copy)."""
        lay = self.layout
        quant_bytes = 0
        for j, layer in enumerate(self.layers):
            moe = self.spec.layers[layer].moe
            assert moe is not None
            views = lay.views(self.blobs[j])
            assert views.w13 is not None and views.w2 is not None
            qe = QuantizedExperts(lay.fmt, views.w13, views.w2, lay.hidden, lay.intermediate, lay.packed)
            qe.attach_int4()  # no compiler, q4 only: torch int4 copies
            if moe.activation != "silu" or moe.glu_clamp:
                qe.activation = self.weights.layers[layer].moe.experts.activation()  # the loader's empty experts
            qe.gate_up_bias, qe.down_bias = views.gate_up_bias, views.down_bias
            decoder.experts[layer] = _TypedExperts(qe)
            quant_bytes += qe.nbytes
        return QuantReport(lay.fmt, len(self.layers), self.float_bytes, quant_bytes, lay.packed, self.cache,
                           self.written)


def _map(path: Path, data_start: int, shape: tuple[int, int, int]) -> torch.Tensor:
    """The file's data region as ``uint8 [L, E, S]``: read into 2 MiB pages (``hugepages.py``: the kernels stream
    these bytes every token, and the file's own mapping has 4 KiB pages), else mapped copy-on-write."""
    n = shape[0] * shape[1] * shape[2]
    if hugepages.enabled() and hugepages.fits(n):  # else the mapping: its pages can be dropped under pressure
        out = hugepages.empty(n)
        view = memoryview(out.numpy())
        with open(path, "rb") as f:
            f.seek(data_start)
            done = 0
            while done < n:
                got = f.readinto(view[done : min(n, done + (64 << 20))])
                if not got:
                    raise OSError(f"{path} ended {n - done} bytes early")
                done += got
        return out.view(*shape)
    size = path.stat().st_size
    whole = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    return whole[data_start : data_start + n].view(*shape)


def load_quantized(
    spec: ModelSpec, reader: Any, path: Path, dtype: torch.dtype, device: str, fmt: str,
    progress: bool | None = None, cache_path: Path | None = None,
) -> MappedLoad:  # fmt: skip
    """Dense weights in ``dtype`` and the routed experts in ``fmt`` (``q4_0``/``q8_0``) from the cache file.

    ``cache_path`` overrides ``$FREETOKEN_CACHE/experts/<key>.ftx``. Experts are quantized from the checkpoint's
    stored values (upcast to fp32), whatever ``dtype`` is, so the file does not depend on the compute dtype.
    """
    import re

    from ..experts.setup import _DenseLoader
    from ..model import weights as weights_mod

    loader = _DenseLoader(reader, dtype, device)
    weights = weights_mod.walk_weights(spec, loader, None)
    ignored = [re.compile(p) for p in (*spec.ignored_tensors, *weights_mod._ALWAYS_IGNORED)]
    unexpected = [n for n in reader.unused() if not any(p.search(n) for p in ignored)]
    if unexpected:
        raise UnexpectedTensorError(f"checkpoint tensor {unexpected[0]} is not used by the {spec.model_type} architecture")
    layers = sorted(loader.sources)
    first = spec.layers[layers[0]].moe
    assert first is not None
    layout = ExpertLayout(fmt, spec.hidden_size, first.intermediate, first.expert_bias, build.load() is not None)
    e = first.num_experts

    def load(layer: int, k: int) -> ExpertTensors:
        return loader.sources[layer].load(k)

    encode = encoder(layout)
    float_bytes = len(layers) * e * 3 * first.intermediate * spec.hidden_size * dtype.itemsize
    file_path = cache_path or cache_root() / f"{cache_key(path, layout)}.ftx"
    try:
        with ops.pool_carries() if layout.packed else contextlib.nullcontext():  # packed: the C quantizer
            disk, written = open_or_write(file_path, layout, layers, e, load, progress=progress, encode=encode,
                                          verify=True)
    except OSError as exc:  # a read-only or full cache directory: quantize into memory instead
        print(f"freetoken: cannot write the expert cache {file_path} ({exc.strerror or exc}); quantizing the "
              "experts in memory this time", file=sys.stderr)
        blobs = torch.zeros(len(layers), e, layout.stride, dtype=torch.uint8)
        for j, layer in enumerate(layers):
            for k in range(e):
                blobs[j, k, : layout.blob_bytes] = encode(load(layer, k))
        return MappedLoad(weights, spec, layout, layers, blobs, None, True, float_bytes)
    blobs = _map(file_path, disk.data_start, (len(layers), e, disk.stride))
    disk.close()
    return MappedLoad(weights, spec, layout, layers, blobs, file_path, written, float_bytes)
