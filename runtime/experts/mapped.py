"""Quantized routed experts mapped from the expert cache file (the core's ``mapped`` placement).

Legend: ``L`` MoE layers, ``E`` experts per layer, ``S`` blob stride in the file (bytes).

The first load quantizes and repacks every expert once — two experts in memory at a time, never the float
checkpoint as a whole — into the expert-major cache file of ``cache_file.py`` (the residency path's file: same key,
checkpoint files + blob layout, so a changed checkpoint or format gets a new file). Every later load checks the file
(header, size, CRC-32 of the data) and reads it into 2 MiB pages (``kernels/hugepages.py``; a copy-on-write mapping
where those are unavailable): ``load_mapped`` returns the dense weights and the ``[L, E, S]`` blobs, over which the
core builds one ``QuantizedExperts`` per layer whose ``w13``/``w2`` are strided views (the kernels take a row
stride), so nothing is quantized. A damaged file is rewritten with a one-line warning; when the cache cannot be
written at all (read-only or full disk) the experts are quantized into memory, with a warning.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from freetoken_agent.runtime.checkpoint.experts import ExpertTensors
from freetoken_agent.runtime.experts.cache_file import cache_key, cache_root, open_or_write
from freetoken_agent.runtime.experts.layout import ExpertLayout
from freetoken_agent.runtime.experts.loader import DenseLoader
from freetoken_agent.runtime.model.weights import check_unused
from freetoken_agent.runtime.kernels import build, hugepages, ops
from freetoken_agent.runtime.model import weights as weights_mod
from freetoken_agent.runtime.model.spec import ModelSpec

QUANTIZED_EXPERTS = [0]
"""Experts quantized by this process (a counter; tests use it to prove a cached load quantized nothing)."""


def supported(spec: ModelSpec, device: str) -> bool:
    """Whether experts can be mapped: CPU, gated experts, every MoE layer with the same expert shape and count."""
    moes = [layer.moe for layer in spec.layers if layer.moe is not None]
    shapes = {(m.intermediate, m.num_experts, m.expert_bias, m.gated) for m in moes}
    return torch.device(device).type == "cpu" and len(shapes) == 1 and all(m.gated for m in moes)


def encoder(layout: ExpertLayout) -> Callable[[ExpertTensors], torch.Tensor]:
    """``ExpertTensors → blob`` in ``layout``: the C quantizer where the kernels load (same rules, ~3x faster)."""
    c_quantize = None if build.load() is None else ops.quantize

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
class MappedExperts:
    """Dense weights plus every MoE layer's expert blobs (what ``load_mapped`` returns)."""

    weights: Any  # runtime.model.weights.ModelWeights (routed experts left empty)
    layout: ExpertLayout
    layers: list[int]
    blobs: torch.Tensor  # [L, E, S] uint8: a view of the mapped file, or memory when no cache could be written
    cache: Path | None
    written: bool
    float_bytes: int


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


def load_mapped(
    spec: ModelSpec, reader: Any, path: Path, dtype: torch.dtype, device: str, fmt: str, kernels: bool,
    progress: bool | None = None, cache_path: Path | None = None,
) -> MappedExperts:  # fmt: skip
    """Dense weights in ``dtype`` and the routed experts in ``fmt`` (``q4_0``/``q8_0``) from the cache file, in the
    kernels' tile layout when ``kernels``.

    ``cache_path`` overrides ``$FREETOKEN_CACHE/experts/<key>.ftx``. Experts are quantized from the checkpoint's
    stored values (upcast to fp32), whatever ``dtype`` is, so the file does not depend on the compute dtype.
    """
    loader = DenseLoader(reader, dtype, device)
    weights = weights_mod.walk_weights(spec, loader, None)
    check_unused(spec, reader)
    layers = sorted(loader.sources)
    first = spec.layers[layers[0]].moe
    assert first is not None
    layout = ExpertLayout(fmt, spec.hidden_size, first.intermediate, first.expert_bias, kernels)
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
        return MappedExperts(weights, layout, layers, blobs, None, True, float_bytes)
    blobs = _map(file_path, disk.data_start, (len(layers), e, disk.stride))
    disk.close()
    return MappedExperts(weights, layout, layers, blobs, file_path, written, float_bytes)
