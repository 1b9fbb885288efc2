"""Dense weights without the routed experts: the loader every mapped and residency-managed load starts from.

``DenseLoader`` walks a checkpoint like the strict ``TensorLoader`` but records each MoE layer's ``ExpertSource``
instead of reading its experts, so the routed experts are never loaded as a whole; the expert core then reads them
one expert at a time (into the expert cache file). ``tensor_bytes`` counts what the dense weights hold (the
budget's ``dense`` claim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from freetoken_agent.runtime.checkpoint.experts import ExpertSource
from freetoken_agent.runtime.checkpoint.reader import CheckpointReader
from freetoken_agent.runtime.errors import MissingTensorError, ShapeMismatchError
from freetoken_agent.runtime.gguf.reader import StoredWeights
from freetoken_agent.runtime.kernels import build, ops
from freetoken_agent.runtime.kernels.dense import ATTENTION_LEAVES, MLP_LEAVES, STORED, QuantLinear
from freetoken_agent.runtime.model import weights as weights_mod
from freetoken_agent.runtime.model.moe import TorchExperts
from freetoken_agent.runtime.model.spec import MoESpec, WeightNames

class DenseLoader(weights_mod.TensorLoader):
    """The strict loader, except routed experts: it records each MoE layer's ``ExpertSource`` instead.

    With ``dense_quant`` it quantizes each layer's dense weights as soon as the layer is read (``on_layer``), so a
    load never holds more than one layer of them in float. With ``meta`` it reads no tensor data at all (every
    tensor is a ``meta`` tensor of the right shape, and quantized weights only their packed size): the pre-flight
    pass that sizes a model before any of it is loaded.
    """

    def __init__(self, reader: CheckpointReader, dtype: torch.dtype, device: torch.device | str,
                 dense_quant: str = "none", meta: bool = False) -> None:  # fmt: skip
        super().__init__(reader, dtype, device)
        self.sources: dict[int, ExpertSource] = {}
        self.dense_quant, self.meta = dense_quant, meta
        self._pending: list[tuple[dict[str, Any], tuple[str, ...]]] = []
        self.quantized = [0, 0, 0]
        """Weights converted layer by layer: count, float bytes, packed bytes."""
        self.formats: set[str] = set()
        """What they were converted to: ``dense_quant``, and ``STORED`` for weights kept in their stored blocks."""
        on_kernels = torch.device(device).type == "cpu" and build.load() is not None
        self.stored = StoredWeights(reader if on_kernels else None)
        """Weights read from a GGUF file's kernel-format tensors: they run as stored, whatever ``dense_quant``."""

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        if not self.meta:
            t = super().take(name, shape, dtype)
            self.stored.note(name, t)
            return t
        if name not in self.reader:
            raise MissingTensorError(f"missing tensor {name} (expected shape {list(shape)})")
        if self.reader.shape(name) != shape:
            raise ShapeMismatchError(f"tensor {name} has shape {list(self.reader.shape(name))}, expected {list(shape)}")
        self.mark_used(name)
        t = torch.empty(shape, dtype=dtype or self.dtype, device="meta")
        self.stored.note(name, t)
        return t

    def packed(self, w: torch.Tensor) -> Any:
        """``w`` as the kernels will hold it: its stored blocks, else quantized to ``dense_quant``, else ``None``
        (it stays float). ``meta``: a ``Packed`` of the right size."""
        fmt = self.stored.format(w)
        if fmt is not None:
            self.formats.add(STORED)
            return Packed(fmt, *w.shape) if self.meta else QuantLinear.from_packed(self.stored.packed(w))
        if self.dense_quant == "none":
            return None
        self.formats.add(self.dense_quant)
        return Packed(self.dense_quant, *w.shape) if self.meta else QuantLinear(w, self.dense_quant)

    def stored_dtype(self, name: str) -> torch.dtype | None:
        return self.reader.dtype(name) if name in self.reader else None

    def share_layer(self, layer: int, base: int) -> None:
        if base in self.sources:  # a repeated layer (a loop's later pass) reads the same experts
            self.sources[layer] = self.sources[base]

    def experts(self, prefix: str, m: MoESpec, names: WeightNames, d: int) -> TorchExperts:
        source = ExpertSource(self.reader, prefix, m, names, d)  # validates every expert tensor's shape
        before = set(self.reader.used)
        source.load(0)
        new = self.reader.used - before
        for name in new:  # mark the other experts' tensors used too (per-expert layouts name each expert)
            if ".experts.0." in name:
                self.reader.used.update(name.replace(".experts.0.", f".experts.{k}.") for k in range(m.num_experts))
        self.sources[self.layer] = source
        empty = torch.empty(0, dtype=self.dtype)
        return TorchExperts(m, empty, empty)

    # the tables ``quantize_dense`` converts: GQA/MLA attention, dense MLPs, shared experts (every ``mlp`` call)
    def attention(self, prefix: str, a: Any, d: int, names: WeightNames) -> dict[str, torch.Tensor]:
        w = super().attention(prefix, a, d, names)
        if a.kind in ("gqa", "mla"):
            self._pending.append((w, ATTENTION_LEAVES))
        return w

    def mlp(self, prefix: str, spec: Any, d: int) -> dict[str, torch.Tensor]:
        w = super().mlp(prefix, spec, d)
        self._pending.append((w, MLP_LEAVES))
        return w

    def on_layer(self, layer: int) -> None:
        """Quantize the dense weights of the layer just read (``walk_weights``'s per-layer callback), or put the
        ones stored in a kernel format in the kernels' tiles as they are."""
        pending, self._pending = self._pending, []
        if self.dense_quant == "none" and not self.stored.by_id:
            return
        for table, leaves in pending:
            for leaf in leaves:
                w = table.get(f"{leaf}.weight")
                if isinstance(w, torch.Tensor) and w.dim() == 2:
                    q = self.packed(w)
                    self.stored.by_id.pop(id(w), None)
                    if q is None:
                        continue
                    table[f"{leaf}.weight"] = q
                    self.quantized[0] += 1
                    self.quantized[1] += w.numel() * w.element_size()
                    self.quantized[2] += q.nbytes


@dataclass(frozen=True)
class Packed:
    """A dense weight the pre-flight pass counts at its packed size (nothing is quantized there)."""

    fmt: str
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return ops.packed_bytes(self.fmt, self.n, self.k)


def tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes held by the tensors (and packed weights) in ``obj`` — nested dicts, lists, dataclasses — each
    storage counted once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = id(obj) if obj.is_meta else obj.data_ptr()  # meta tensors have no storage to tell copies apart
        if obj.numel() == 0 or key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (QuantLinear, Packed)):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(tensor_bytes(getattr(obj, f), seen) for f in obj.__dataclass_fields__)
    return 0
