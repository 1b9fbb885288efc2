"""The quantized-expert core: one factory builds every MoE layer's routed-experts backend.

Design. ``build_experts`` is the only place that decides how a model's routed experts are held. From the request's
format (``quant``), placement (``resident`` / ``mapped`` / ``managed``, or chosen), budget and whether the C kernels
are available it picks one **source** (``SOURCES``): the float experts as loaded, float experts quantized in
memory, the expert cache file mapped in, a GGUF file's blocks, or budgeted tiers of slots (filled from the expert
cache file, which a GGUF file's blocks are written into as a folder's quantized experts are). Each source reads the
dense weights its own way (only the float ones read the experts as a whole) and hands back one backend per MoE
layer; quantized ones are all made by one recipe (``quantized.quantized_experts``), and what each block format's
bytes mean lives in one registry (``runtime/quant/formats.py``). The backends are installed into the decoder once,
unwrapped, and say what they are through ``capabilities`` (``capabilities.py``): callers such as
``set_expert_mode`` and ``kernels.reference.dequantized_reference`` read those instead of probing classes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from freetoken_agent.runtime.errors import FreeTokenError, OptionError
from freetoken_agent.runtime.experts.capabilities import PLACEMENTS, capabilities_of
from freetoken_agent.runtime.experts.quantized import QuantReport, from_blobs, from_gguf, from_weights
from freetoken_agent.runtime.kernels.experts import EXPERT_MODES
from freetoken_agent.runtime.model.spec import ModelSpec
from freetoken_agent.runtime.quant.formats import check_quant

SOURCES = ("float", "quantize", "mapped", "gguf", "managed")
"""Where a load's experts come from: ``float`` (as loaded, plain torch), ``quantize`` (loaded, then quantized in
memory), ``mapped`` (the expert cache file, ``mapped.py``), ``gguf`` (a GGUF file's blocks, as stored or
converted), ``managed`` (budgeted tiers filled from the expert cache file, ``setup.py``)."""


@dataclass(frozen=True)
class ExpertsRequest:
    """What a load asks of the experts: the checkpoint, how to compute, and where the experts may live."""

    path: Path
    spec: ModelSpec
    reader: Any
    """The checkpoint's tensor reader (``CheckpointReader``, or a GGUF file's)."""
    dtype: torch.dtype
    device: str
    quant: str = "none"
    """Experts' block format (``check_quant``: ``none``, ``q8_0``, ``q4_0``); ``none`` keeps a GGUF file's own."""
    dense_quant: str = "none"
    """Dense weights' block format (``runtime/kernels/dense.py``)."""
    budget: Any = None
    """``runtime.memory.Budget``: with it (or ``residency``) the experts are managed in tiers."""
    residency: Any = None
    """``setup.ResidencyConfig`` for the managed tiers."""
    gguf: Any = None
    """The opened ``runtime.gguf.GGUFModel`` when the checkpoint is a GGUF file."""
    progress: bool = False
    """Show a progress bar while reading (big checkpoints)."""
    placement: str | None = None
    """Force a placement (``capabilities.PLACEMENTS``); ``None``: chosen (see ``choose_source``)."""


def choose_source(request: ExpertsRequest) -> str:
    """The source (``SOURCES``) a request's experts load from; a clear error for a combination that cannot load.

    Chosen: a budget or residency config → ``managed``, for a safetensors folder and a GGUF file alike (a GGUF
    file's experts go into the expert cache file as the blocks its unbudgeted load runs: ``setup.py``); a GGUF file
    with quantized experts (or ``quant``) on the CPU → ``gguf``; ``quant`` where the experts can be mapped (CPU, gated
    experts of one shape) → ``mapped``; other ``quant`` → ``quantize``; else ``float``. A forced ``placement`` picks
    among the same.
    """
    r = request
    placement = r.placement
    if placement is not None and placement not in PLACEMENTS:
        raise OptionError(f"unknown expert placement {placement!r}; expected one of {', '.join(PLACEMENTS)}")
    if r.budget is not None or r.residency is not None:
        if placement not in (None, "managed"):
            raise OptionError(f"a memory budget manages the experts in tiers; it cannot load them {placement}")
        placement = "managed"
    if placement == "managed":
        return "managed"
    if r.gguf is not None:
        if placement == "mapped":
            raise OptionError("GGUF experts are not mapped from the expert cache file; load them resident")
        return "gguf" if r.gguf.quantized_experts(r.quant, r.device) else "float"
    if r.quant == "none":
        if placement == "mapped":
            raise OptionError("mapped experts are quantized: pass a --quant format (q8 or q4)")
        return "float"
    from freetoken_agent.runtime.experts.mapped import supported

    if placement == "mapped" and not supported(r.spec, r.device):
        raise OptionError("these experts cannot be mapped from the expert cache file (it needs the CPU and gated "
                          "experts of one shape in every MoE layer); load them resident")
    if placement == "resident" or not supported(r.spec, r.device):
        return "quantize"
    return "mapped"


@dataclass
class BuiltExperts:
    """What ``build_experts`` returns: the dense weights and the backends to install over their experts."""

    source: str
    """One of ``SOURCES``."""
    weights: Any
    """``runtime.model.weights.ModelWeights`` (routed experts empty unless the source is ``float``)."""
    backends: dict[int, Any]
    """MoE layer → its experts backend (empty for ``float``: the weights' own ``TorchExperts`` compute)."""
    report: QuantReport | None
    """What quantizing the experts did (``None``: float or managed experts)."""
    dense_report: Any
    """``runtime.kernels.dense.DenseQuantReport`` when dense weights were quantized."""
    store: Any = None
    """The managed source's ``store.ExpertStore``."""

    def install(self, decoder: Any) -> None:
        """Put the backends in ``decoder`` (a ``runtime.model.decoder.Decoder`` over ``weights``)."""
        install(decoder, self.backends)


def install(decoder: Any, backends: dict[int, Any]) -> None:
    """``decoder.experts[layer] = backend`` for each MoE layer in ``backends`` (the decoder's one seam)."""
    for layer, backend in backends.items():
        if decoder.spec.layers[layer].moe is None:
            raise FreeTokenError(f"layer {layer} has no MoE block to install an experts backend into")
        decoder.experts[layer] = backend


def build_experts(request: ExpertsRequest, kernels: bool | None = None) -> BuiltExperts:
    """Load the dense weights and build every MoE layer's experts backend from the source ``choose_source`` picks;
    quantized experts are stored in the C kernels' tile layout when ``kernels`` (default: whether they load here).
    """
    from freetoken_agent.runtime.kernels import build
    from freetoken_agent.runtime.kernels.dense import quantize_dense

    r = request
    kernels = build.load() is not None if kernels is None else kernels
    source = choose_source(r)
    if source == "managed":
        from freetoken_agent.runtime.experts.setup import load_managed

        managed = load_managed(r.spec, r.reader, r.path, r.dtype, r.device, r.quant, r.budget, r.residency,
                               r.dense_quant, kernels, r.gguf)
        return BuiltExperts(source, managed.weights, managed.backends(), None, managed.dense_quant,
                            managed.store)
    backends: dict[int, Any] = {}
    report: QuantReport | None = None
    if source == "gguf":
        load = r.gguf.load_quantized(r.dtype, r.device, r.quant)
        weights = load.weights
        backends, report = from_gguf(r.spec, weights, load, kernels)
        # dense weights stored in a kernel format run as stored (a Q4_K_M file's Q4_K / Q6_K attention and output)
        dense = quantize_dense(r.spec, weights, r.dense_quant, stored=load.stored_dense if kernels else None)
        load.release()
        return BuiltExperts(source, weights, backends, report, dense)
    elif source == "mapped":
        from freetoken_agent.runtime.experts.mapped import load_mapped

        mapped = load_mapped(r.spec, r.reader, r.path, r.dtype, r.device, r.quant, kernels, r.progress)
        weights = mapped.weights
        backends, report = from_blobs(r.spec, weights, mapped)
    else:
        weights = _load_weights(r, stored_experts_dtype(r, kernels) if source == "float" else None)
        if source == "quantize":
            backends, report = from_weights(weights, check_quant(r.quant), kernels)
    return BuiltExperts(source, weights, backends, report, quantize_dense(r.spec, weights, r.dense_quant))


STORED16_ENV = "FREETOKEN_STORED16"
"""``0`` / ``off``: float experts of a bf16 checkpoint are widened to fp32 at load, as before (see
``stored_experts_dtype``)."""


def stored_experts_dtype(r: ExpertsRequest, kernels: bool) -> torch.dtype | None:
    """bf16 where float experts may stay as a bf16 checkpoint stores them under fp32 compute: on the CPU with the
    kernels loaded, whose fp32 MoE widens each bf16 weight in registers — exactly the value an fp32 copy holds, so the
    same bits — while a decode step streams half the bytes (and the experts take half the memory). Only SiLU-gated
    experts without biases (what that kernel computes) stay 16-bit, and only when the checkpoint holds them in bf16
    (``TensorLoader.experts``); ``$FREETOKEN_STORED16=0`` turns it off."""
    if os.environ.get(STORED16_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return None
    if not kernels or r.dtype != torch.float32 or torch.device(r.device).type != "cpu":
        return None
    return torch.bfloat16


def _load_weights(r: ExpertsRequest, expert_dtype: torch.dtype | None = None) -> Any:
    """Every weight as stored, experts included (the ``float`` and ``quantize`` sources); ``expert_dtype``: see
    ``stored_experts_dtype``."""
    from freetoken_agent.runtime.model.weights import load_weights

    if not r.progress:
        return load_weights(r.spec, r.reader, r.dtype, r.device, expert_dtype=expert_dtype)
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(f"loading {r.path.name}", total=r.spec.num_layers)
        return load_weights(r.spec, r.reader, r.dtype, r.device, on_layer=lambda i: bar.advance(task),
                            expert_dtype=expert_dtype)


def set_expert_mode(decoder: Any, mode: str) -> int:
    """Set how every MoE layer whose backend has modes computes (``EXPERT_MODES``: ``auto``, ``exact``, ``int8``;
    see ``QuantizedExperts.set_mode``); returns how many layers it set."""
    if mode not in EXPERT_MODES:
        raise FreeTokenError(f"unknown expert mode {mode!r}; expected one of {', '.join(EXPERT_MODES)}")
    backends = [b for b in decoder.experts if capabilities_of(b).modes]
    if mode == "int8" and any(not capabilities_of(b).kernels for b in backends):
        raise FreeTokenError("int8 expert mode needs the C kernels, which are unavailable here")
    for backend in backends:
        backend.set_mode(mode)
    return len(backends)
