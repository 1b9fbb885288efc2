"""``GGUFCheckpointReader``: a GGUF model's tensors under the names (and shapes) of its Hugging Face checkpoint.

It is a ``CheckpointReader``, so the strict weight loader, the family adapters and the expert normalization work
unchanged. Each Hugging Face name points at a *source*: a GGUF tensor, optionally one expert of a stacked expert
tensor, optionally a row range of it (a fused gate/up), optionally with llama.cpp's rope permutation to undo.
Reading a source dequantizes it with the ``gguf`` package (``gguf.quants.dequantize``: every ggml type llama.cpp
writes), one expert at a time for stacked tensors; nothing is read before it is asked for (the file stays mapped).

The raw stacked expert tensors stay reachable (``expert_tensors``) so Q8_0 / Q4_0 experts can go to the kernels
without being dequantized (``runtime/gguf/experts.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from freetoken_agent.runtime.checkpoint.reader import CheckpointReader, TensorInfo, check_weights_enabled
from freetoken_agent.runtime.errors import MissingTensorError, ShapeMismatchError, UnexpectedTensorError
from freetoken_agent.runtime.gguf.arch import (
    EXPERT_LEAVES,
    ArchMap,
    block_names,
    expert_prefix,
    global_name,
)
from freetoken_agent.runtime.gguf.file import GGUFFile, GGUFTensor, GGUFTensorTypeError
from freetoken_agent.runtime.model.spec import ModelSpec
from freetoken_agent.runtime.model.weights import expected_tensors

FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL",
               "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "MXFP4", "TQ1_0", "TQ2_0")
"""ggml types read as weights: the float types as they are, the block types dequantized by the ``gguf`` package."""

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def dequantize(t: GGUFTensor, expert: int | None = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """``t`` (or expert ``expert`` of a stacked tensor, rows ``rows`` of it) as a float32 tensor, element shape."""
    import gguf

    data = t.data if expert is None else t.data[expert]
    if rows is not None:
        data = data[rows[0] : rows[1]]
    arr = gguf.quants.dequantize(np.asarray(data), gguf.GGMLQuantizationType(t.type_id))
    if not arr.flags.writeable or arr.dtype != np.float32:  # F32 comes back as the read-only mapping itself
        arr = np.array(arr, dtype=np.float32)
    return torch.from_numpy(arr)


def unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of Q/K rows (for its interleaved rope): per head, rows ``(2i, 2i+1)`` go back to
    ``(i, i + d/2)``. Works on weights ``[H·d, D]`` and biases ``[H·d]``."""
    shape = w.shape
    return w.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape).contiguous()


@dataclass(frozen=True)
class Source:
    """Where one Hugging Face tensor comes from."""

    tensor: GGUFTensor
    expert: int | None = None
    rows: tuple[int, int] | None = None
    heads: int = 0
    """> 0: undo llama.cpp's rope permutation with this many heads."""


@dataclass(frozen=True)
class ExpertTensorsGGUF:
    """One MoE layer's stacked expert tensors as stored: gate and up ``[E, I, D]`` (or one fused ``gate_up``
    ``[E, 2I, D]``) and down ``[E, D, I]``."""

    down: GGUFTensor
    gate: GGUFTensor | None = None
    up: GGUFTensor | None = None
    gate_up: GGUFTensor | None = None

    def parts(self) -> list[tuple[str, GGUFTensor]]:
        named = (("gate", self.gate), ("up", self.up), ("gate_up", self.gate_up), ("down", self.down))
        return [(k, t) for k, t in named if t is not None]


class GGUFCheckpointReader(CheckpointReader):
    """All tensors of a GGUF model under Hugging Face names, dequantized on read (see the module docstring)."""

    def __init__(self, file: GGUFFile, spec: ModelSpec, arch: ArchMap, check_finite: bool | None = None) -> None:
        # not CheckpointReader.__init__: that one reads a folder of safetensors
        self.path: Path = file.path
        self.file = file
        self.files = list(file.parts)
        self.check_finite = check_weights_enabled() if check_finite is None else check_finite
        self.used: set[str] = set()
        self._handles: dict = {}
        self.spec, self.arch = spec, arch
        self.sources: dict[str, Source] = {}
        self.infos: dict[str, TensorInfo] = {}
        self.experts: dict[int, ExpertTensorsGGUF] = {}
        """MoE layer index → its stacked expert tensors as stored."""
        self.gguf_names: dict[str, str] = {}
        """Hugging Face name → the GGUF tensor it reads."""
        for t in file.tensors.values():
            if t.type_name not in FLOAT_TYPES + QUANT_TYPES:
                raise GGUFTensorTypeError(f"{file.path.name}: tensor {t.name} has ggml type {t.type_name}, which is "
                                          "not a weight type this engine reads")
        expected = expected_tensors(spec)
        for t in file.tensors.values():
            self._place(t, expected)
        missing = [n for n in expected if n not in self.infos]
        if missing:
            first = missing[0]
            raise MissingTensorError(f"{file.path.name}: no tensor for {first} (shape {list(expected[first])})"
                                     + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                                     + f" of the {spec.model_type} model")

    # ------------------------------------------------------------------------------------------------ mapping

    def _add(self, name: str, src: Source, shape: tuple[int, ...], expected: dict[str, tuple[int, ...]]) -> None:
        t = src.tensor
        if name not in expected:
            raise UnexpectedTensorError(f"{self.path.name}: GGUF tensor {t.name} ({name}) is not used by the "
                                        f"{self.spec.model_type} architecture")
        want = expected[name]
        if int(np.prod(want)) != int(np.prod(shape)):
            raise ShapeMismatchError(f"{self.path.name}: GGUF tensor {t.name} has shape {list(t.shape)}, expected "
                                     f"{list(want)} for {name}")
        per = t.nbytes // max(1, t.shape[0]) if src.expert is not None else t.nbytes
        start = t.offset + (src.expert or 0) * per if src.expert is not None else t.offset
        self.sources[name] = src
        self.infos[name] = TensorInfo(name, t.file, t.type_name, tuple(want), (start, start + per))
        self.gguf_names[name] = t.name

    def _place(self, t: GGUFTensor, expected: dict[str, tuple[int, ...]]) -> None:
        spec = self.spec
        name = global_name(spec, t.name)
        if name is not None:
            self._add(name, Source(t), t.shape, expected)
            return
        m = _BLOCK.match(t.name)
        if not m or int(m[1]) >= spec.num_layers:
            raise UnexpectedTensorError(f"{self.path.name}: GGUF tensor {t.name} is not used by the "
                                        f"{spec.model_type} architecture")
        layer, leaf = int(m[1]), m[2]
        if leaf in EXPERT_LEAVES or leaf == "ffn_gate_up_exps.weight":
            self._place_experts(t, layer, leaf, expected)
            return
        name = block_names(spec, layer).get(leaf)
        if name is None:
            raise UnexpectedTensorError(f"{self.path.name}: GGUF tensor {t.name} is not used by the "
                                        f"{spec.model_type} architecture")
        heads = 0
        attn = spec.layers[layer].attention
        if self.arch.rope_permuted and attn is not None and leaf.split(".")[0] in ("attn_q", "attn_k"):
            heads = attn.num_heads if leaf.startswith("attn_q") else attn.num_kv_heads
        self._add(name, Source(t, heads=heads), t.shape, expected)

    def _place_experts(self, t: GGUFTensor, layer: int, leaf: str, expected: dict[str, tuple[int, ...]]) -> None:
        moe = self.spec.layers[layer].moe
        if moe is None or len(t.shape) != 3 or t.shape[0] != moe.num_experts:
            raise UnexpectedTensorError(f"{self.path.name}: GGUF tensor {t.name} (shape {list(t.shape)}) does not fit "
                                        f"layer {layer} of the {self.spec.model_type} model")
        prefix = expert_prefix(self.spec, layer)
        group = self.experts.get(layer)
        kind = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up", "ffn_down_exps.weight": "down",
                "ffn_gate_up_exps.weight": "gate_up"}[leaf]
        fields = dict(group.__dict__) if group else {"down": None}
        fields[kind] = t
        self.experts[layer] = ExpertTensorsGGUF(**fields)
        e, rows, cols = t.shape
        if kind == "gate_up":
            i = rows // 2
            for k in range(e):
                for part, rng in (("gate_proj", (0, i)), ("up_proj", (i, rows))):
                    self._add(f"{prefix}.experts.{k}.{part}.weight", Source(t, k, rng), (i, cols), expected)
            return
        for k in range(e):
            self._add(f"{prefix}.experts.{k}.{EXPERT_LEAVES[leaf]}.weight", Source(t, k), (rows, cols), expected)

    # ------------------------------------------------------------------------------------------------ reading

    def read(self, name: str) -> torch.Tensor:
        src = self.sources[name]
        self.used.add(name)
        out = dequantize(src.tensor, src.expert, src.rows).reshape(self.infos[name].shape)
        if src.heads:
            out = unpermute_rope(out, src.heads)
        return out

    def read_row(self, name: str, index: int) -> torch.Tensor:
        return self.read(name)[index]

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.checked(name, self.read(name)[start:stop], f"rows {start}:{stop}")

    def _handle(self, name: str) -> None:  # no safetensors handles: every read goes through ``read``
        self.used.add(name)

    def total_bytes(self) -> int:
        return self.file.total_bytes()

    def gguf_type(self, name: str) -> str:
        """The ggml type the Hugging Face tensor ``name`` is stored in."""
        return self.sources[name].tensor.type_name
