"""``GGUFCheckpointReader``: a GGUF model's tensors under the names (and shapes) of its Hugging Face checkpoint.

It is a ``CheckpointReader``, so the strict weight loader, the family adapters and the expert normalization work
unchanged. Each Hugging Face name points at a *source*: a GGUF tensor, optionally one expert of a stacked expert
tensor, optionally a row range of it (a fused gate/up), optionally with llama.cpp's rope permutation to undo.
Reading a source dequantizes it with the ``gguf`` package (``gguf.quants.dequantize``: every ggml type llama.cpp
writes), one expert at a time for stacked tensors; nothing is read before it is asked for (the file stays mapped).

The raw stacked expert tensors stay reachable (``experts``) so Q8_0 / Q4_0 experts can go to the kernels without
being dequantized (``runtime/gguf/model.py``). GPT-OSS experts (``expert_layout="gpt_oss"``) are served as
transformers' fused tensors instead (``experts.gate_up_proj`` [E, D, 2I] with gate/up interleaved by column,
``experts.down_proj`` [E, I, D], their ``_bias`` tensors), composed from the split GGUF tensors one expert at a time:
the only per-expert layout the weight loader reads expert biases from. DeepSeek's MLA up-projection ``kv_b_proj``
is joined back from llama.cpp's per-head split ``attn_k_b`` (transposed) / ``attn_v_b``. Multi-token-prediction
blocks after the decoder's (``nextn_predict_layers``) are left unread.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    mtp_layers,
)
from freetoken_agent.runtime.gguf.file import GGUFFile, GGUFTensor, GGUFTensorTypeError
from freetoken_agent.runtime.model.spec import ModelSpec
from freetoken_agent.runtime.model.weights import expected_tensors

FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL",
               "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "MXFP4", "TQ1_0", "TQ2_0")
"""ggml types read as weights: the float types as they are, the block types dequantized by the ``gguf`` package."""

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_EXPERT_KIND = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up", "ffn_down_exps.weight": "down",
                "ffn_gate_up_exps.weight": "gate_up", "ffn_gate_exps.bias": "gate_bias", "ffn_up_exps.bias": "up_bias",
                "ffn_down_exps.bias": "down_bias"}


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
    compose: str = ""
    """Not one stored tensor but one composed per expert from ``parts`` (``gpt_oss_gate_up``, ``gpt_oss_down``,
    ``gpt_oss_gate_up_bias``, ``gpt_oss_down_bias``), or from a split one (``mla_kv_b``, ``qwen3next_qkvz``)."""
    parts: tuple[GGUFTensor, ...] = ()
    undo: str = ""
    """A value change of the converter to undo: ``minus_one`` (norm weights stored + 1), ``log_neg`` (``A_log``
    stored as −exp(A_log))."""


@dataclass(frozen=True)
class ExpertTensorsGGUF:
    """One MoE layer's stacked expert tensors as stored: gate and up ``[E, I, D]`` (or one fused ``gate_up``
    ``[E, 2I, D]``) and down ``[E, D, I]``."""

    down: GGUFTensor
    gate: GGUFTensor | None = None
    up: GGUFTensor | None = None
    gate_up: GGUFTensor | None = None
    gate_bias: GGUFTensor | None = None
    """GPT-OSS: the experts' biases, gate and up ``[E, I]``, down ``[E, D]``."""
    up_bias: GGUFTensor | None = None
    down_bias: GGUFTensor | None = None

    def parts(self) -> list[tuple[str, GGUFTensor]]:
        """The weight tensors (not the biases), by part name."""
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
        self.renames = dict(arch.renames)
        self.fused: set[str] = set()
        """MoE prefixes whose experts are served as fused tensors (their per-expert names are not expected)."""
        self.skipped: list[str] = []
        """GGUF tensors left unread: the multi-token-prediction blocks."""
        self.kv_b: dict[int, dict[str, GGUFTensor]] = {}
        """MLA layer → its ``attn_k_b`` / ``attn_v_b`` (joined into ``kv_b_proj`` once both are seen)."""
        self.qkvz: dict[int, dict[str, GGUFTensor]] = {}
        """Gated DeltaNet layer → its ``attn_qkv`` / ``attn_gate`` (joined into ``in_proj_qkvz``)."""
        mtp = mtp_layers(file)
        expected = expected_tensors(spec)
        for t in file.tensors.values():
            m = _BLOCK.match(t.name)
            if m and spec.num_layers <= int(m[1]) < spec.num_layers + mtp:
                self.skipped.append(t.name)
                continue
            self._place(t, expected)
        if arch.expert_layout == "gpt_oss":
            for layer in sorted(self.experts):
                self._fuse_gpt_oss(layer, expected)
        for layer in sorted(self.kv_b):
            if f"blk.{layer}.attn_kv_b.weight" in file.tensors:  # both forms (early 2025 files): the unsplit one read
                self.skipped += [t.name for t in self.kv_b[layer].values()]
                continue
            self._join_kv_b(layer, expected)
        for layer in sorted(self.qkvz):
            self._join_qkvz(layer, expected)
        missing = [n for n in expected if n not in self.infos
                   and not any(n.startswith(f"{p}.experts.") for p in self.fused)]
        if missing:
            first = missing[0]
            raise MissingTensorError(f"{file.path.name}: no tensor for {first} (shape {list(expected[first])})"
                                     + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                                     + f" of the {spec.model_type} model")

    # ------------------------------------------------------------------------------------------------ mapping

    def _add(self, name: str, src: Source, shape: tuple[int, ...], expected: dict[str, tuple[int, ...]]) -> None:
        t = src.tensor
        if src.compose:  # a composed tensor: the shape is the one it is served in
            self.sources[name] = src
            self.infos[name] = TensorInfo(name, t.file, t.type_name, shape, (t.offset, t.offset + t.nbytes))
            self.gguf_names[name] = t.name
            return
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
            undo = "minus_one" if self.arch.norms_plus_one and t.name == "output_norm.weight" else ""
            self._add(name, Source(t, undo=undo), t.shape, expected)
            return
        m = _BLOCK.match(t.name)
        if not m or int(m[1]) >= spec.num_layers:
            raise UnexpectedTensorError(f"{self.path.name}: GGUF tensor {t.name} is not used by the "
                                        f"{spec.model_type} architecture")
        layer, leaf = int(m[1]), self.renames.get(m[2], m[2])
        if leaf in _EXPERT_KIND:
            self._place_experts(t, layer, leaf, expected)
            return
        if leaf in ("attn_k_b.weight", "attn_v_b.weight"):
            self.kv_b.setdefault(layer, {})[leaf] = t
            return
        if spec.layers[layer].recurrent is not None and leaf in ("attn_qkv.weight", "attn_gate.weight"):
            self.qkvz.setdefault(layer, {})[leaf] = t
            return
        name = block_names(spec, layer).get(leaf)
        if name is None:
            raise UnexpectedTensorError(f"{self.path.name}: GGUF tensor {t.name} is not used by the "
                                        f"{spec.model_type} architecture")
        heads = 0
        attn = spec.layers[layer].attention
        if self.arch.rope_permuted and attn is not None and leaf.split(".")[0] in ("attn_q", "attn_k"):
            heads = attn.num_heads if leaf.startswith("attn_q") else attn.num_kv_heads
        undo = ""
        if self.arch.norms_plus_one and leaf.endswith("norm.weight") and leaf != "ssm_norm.weight":
            undo = "minus_one"  # every RMSNorm but the DeltaNet's gated output norm (the converter's rule)
        elif self.arch.norms_plus_one and leaf == "ssm_a":
            undo = "log_neg"
        self._add(name, Source(t, heads=heads, undo=undo), t.shape, expected)

    def _place_experts(self, t: GGUFTensor, layer: int, leaf: str, expected: dict[str, tuple[int, ...]]) -> None:
        moe = self.spec.layers[layer].moe
        kind = _EXPERT_KIND[leaf]
        bias = kind.endswith("_bias")
        if moe is None or len(t.shape) != (2 if bias else 3) or t.shape[0] != moe.num_experts:
            raise UnexpectedTensorError(f"{self.path.name}: GGUF tensor {t.name} (shape {list(t.shape)}) does not fit "
                                        f"layer {layer} of the {self.spec.model_type} model")
        if bias and self.arch.expert_layout != "gpt_oss":
            raise UnexpectedTensorError(f"{self.path.name}: GGUF tensor {t.name}: expert biases are not used by the "
                                        f"{self.spec.model_type} architecture")
        prefix = expert_prefix(self.spec, layer)
        group = self.experts.get(layer)
        fields = dict(group.__dict__) if group else {"down": None}
        fields[kind] = t
        self.experts[layer] = ExpertTensorsGGUF(**fields)
        if self.arch.expert_layout == "gpt_oss":  # served fused once the layer's tensors are all seen
            return
        e, rows, cols = t.shape
        if kind == "gate_up":
            i = rows // 2
            for k in range(e):
                for part, rng in (("gate_proj", (0, i)), ("up_proj", (i, rows))):
                    self._add(f"{prefix}.experts.{k}.{part}.weight", Source(t, k, rng), (i, cols), expected)
            return
        for k in range(e):
            self._add(f"{prefix}.experts.{k}.{EXPERT_LEAVES[leaf]}.weight", Source(t, k), (rows, cols), expected)

    def _fuse_gpt_oss(self, layer: int, expected: dict[str, tuple[int, ...]]) -> None:
        """Serve one layer's split GPT-OSS experts as transformers' fused tensors (see the module docstring)."""
        g, moe = self.experts[layer], self.spec.layers[layer].moe
        assert moe is not None
        e, i, d = moe.num_experts, moe.intermediate, self.spec.hidden_size
        need = {"ffn_gate_exps.weight": (g.gate, (e, i, d)), "ffn_up_exps.weight": (g.up, (e, i, d)),
                "ffn_down_exps.weight": (g.down, (e, d, i)), "ffn_gate_exps.bias": (g.gate_bias, (e, i)),
                "ffn_up_exps.bias": (g.up_bias, (e, i)), "ffn_down_exps.bias": (g.down_bias, (e, d))}
        for leaf, (t, shape) in need.items():
            if t is None:
                raise MissingTensorError(f"{self.path.name}: no tensor blk.{layer}.{leaf} (shape {list(shape)}) of the "
                                         f"{self.spec.model_type} model")
            if tuple(t.shape) != shape:
                raise ShapeMismatchError(f"{self.path.name}: GGUF tensor {t.name} has shape {list(t.shape)}, expected "
                                         f"{list(shape)}")
        assert g.gate and g.up and g.gate_bias and g.up_bias and g.down_bias
        prefix = expert_prefix(self.spec, layer)
        self.fused.add(prefix)
        for name, compose, parts, shape in (
            ("experts.gate_up_proj", "gpt_oss_gate_up", (g.gate, g.up), (e, d, 2 * i)),
            ("experts.down_proj", "gpt_oss_down", (g.down,), (e, i, d)),
            ("experts.gate_up_proj_bias", "gpt_oss_gate_up_bias", (g.gate_bias, g.up_bias), (e, 2 * i)),
            ("experts.down_proj_bias", "gpt_oss_down_bias", (g.down_bias,), (e, d)),
        ):
            self._add(f"{prefix}.{name}", Source(parts[0], compose=compose, parts=parts), shape, expected)

    def _join_kv_b(self, layer: int, expected: dict[str, tuple[int, ...]]) -> None:
        """``kv_b_proj`` [H·(nope + v), R] of one MLA layer from ``attn_k_b`` [H, R, nope] and ``attn_v_b``
        [H, v, R] (the converter's ``DeepseekV2Model.modify_tensors``, undone)."""
        parts, attn = self.kv_b[layer], self.spec.layers[layer].attention
        if attn is None or attn.kind != "mla" or set(parts) != {"attn_k_b.weight", "attn_v_b.weight"}:
            got = ", ".join(f"blk.{layer}.{leaf}" for leaf in sorted(parts))
            raise UnexpectedTensorError(f"{self.path.name}: GGUF tensor(s) {got} do not make an MLA kv_b_proj of "
                                        f"layer {layer} of the {self.spec.model_type} model")
        k_b, v_b = parts["attn_k_b.weight"], parts["attn_v_b.weight"]
        h, r, nope, v = attn.num_heads, attn.kv_lora_rank, attn.qk_nope_dim, attn.v_head_dim
        for t, shape in ((k_b, (h, r, nope)), (v_b, (h, v, r))):
            if tuple(t.shape) != shape:
                raise ShapeMismatchError(f"{self.path.name}: GGUF tensor {t.name} has shape {list(t.shape)}, expected "
                                         f"{list(shape)}")
        names = self.spec.layers[layer].names or self.spec.names
        name = f"{self.spec.layers[layer].prefix or f'{names.layers}.{layer}'}.{names.attn}.kv_b_proj.weight"
        if name not in expected:
            raise UnexpectedTensorError(f"{self.path.name}: GGUF tensor {k_b.name} ({name}) is not used by the "
                                        f"{self.spec.model_type} architecture")
        self._add(name, Source(k_b, compose="mla_kv_b", parts=(k_b, v_b)), (h * (nope + v), r), expected)

    def _join_qkvz(self, layer: int, expected: dict[str, tuple[int, ...]]) -> None:
        """``in_proj_qkvz`` [Hk·(2dk + 2r·dv), D] (per key head: q, k, v, z; r value heads per key head) of one Gated
        DeltaNet layer from ``attn_qkv`` [Hk·dk (q) + Hk·dk (k) + Hv·dv (v), D] and ``attn_gate`` [Hv·dv, D]
        (the converter's ``Qwen3NextModel.modify_tensors``, undone)."""
        parts, r = self.qkvz[layer], self.spec.layers[layer].recurrent
        assert r is not None
        if set(parts) != {"attn_qkv.weight", "attn_gate.weight"} or r.layout != "grouped":
            got = ", ".join(f"blk.{layer}.{leaf}" for leaf in sorted(parts))
            raise UnexpectedTensorError(f"{self.path.name}: GGUF tensor(s) {got} do not make a Gated DeltaNet "
                                        f"in_proj_qkvz of layer {layer} of the {self.spec.model_type} model")
        qkv, z = parts["attn_qkv.weight"], parts["attn_gate.weight"]
        d, hk, hv = self.spec.hidden_size, r.num_k_heads, r.num_v_heads
        for t, shape in ((qkv, (2 * hk * r.head_k_dim + hv * r.head_v_dim, d)), (z, (hv * r.head_v_dim, d))):
            if tuple(t.shape) != shape:
                raise ShapeMismatchError(f"{self.path.name}: GGUF tensor {t.name} has shape {list(t.shape)}, expected "
                                         f"{list(shape)}")
        names = self.spec.layers[layer].names or self.spec.names
        name = f"{self.spec.layers[layer].prefix or f'{names.layers}.{layer}'}.{names.recurrent}.in_proj_qkvz.weight"
        if name not in expected:
            raise UnexpectedTensorError(f"{self.path.name}: GGUF tensor {qkv.name} ({name}) is not used by the "
                                        f"{self.spec.model_type} architecture")
        self._add(name, Source(qkv, compose="qwen3next_qkvz", parts=(qkv, z)), expected[name], expected)

    def _qkvz(self, src: Source) -> torch.Tensor:
        qkv, z = (dequantize(t) for t in src.parts)
        layer = int(_BLOCK.match(src.tensor.name)[1])  # type: ignore[index]
        r = self.spec.layers[layer].recurrent
        assert r is not None
        hk, dk, vdim = r.num_k_heads, r.head_k_dim, r.num_v_heads // r.num_k_heads * r.head_v_dim
        d = qkv.shape[-1]
        q, k, v = qkv.split([hk * dk, hk * dk, hk * vdim])
        groups = [q.reshape(hk, dk, d), k.reshape(hk, dk, d), v.reshape(hk, vdim, d), z.reshape(hk, vdim, d)]
        return torch.cat(groups, dim=1).reshape(-1, d)

    def _composed(self, src: Source, k: int) -> torch.Tensor:
        """Expert ``k`` of a composed tensor, in the layout transformers stores it."""
        if src.compose == "gpt_oss_gate_up":  # [D, 2I], columns gate_0, up_0, gate_1, ...
            gate, up = (dequantize(t, k) for t in src.parts)
            return torch.stack([gate.T, up.T], dim=-1).reshape(gate.shape[1], -1)
        if src.compose == "gpt_oss_gate_up_bias":  # [2I], gate_0, up_0, gate_1, ...
            gate, up = (dequantize(t, k) for t in src.parts)
            return torch.stack([gate, up], dim=-1).reshape(-1)
        if src.compose == "gpt_oss_down":  # [I, D]
            return dequantize(src.parts[0], k).T.contiguous()
        return dequantize(src.parts[0], k)  # gpt_oss_down_bias [D]

    # ------------------------------------------------------------------------------------------------ reading

    def read(self, name: str) -> torch.Tensor:
        src = self.sources[name]
        self.used.add(name)
        if src.compose == "qwen3next_qkvz":
            return self._qkvz(src)
        if src.compose == "mla_kv_b":  # per head: k_b transposed back, then v_b
            k_b, v_b = (dequantize(t) for t in src.parts)  # [H, R, nope], [H, v, R]
            return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(self.infos[name].shape)
        if src.compose:
            return torch.stack([self._composed(src, k) for k in range(self.infos[name].shape[0])])
        out = dequantize(src.tensor, src.expert, src.rows).reshape(self.infos[name].shape)
        if src.heads:
            out = unpermute_rope(out, src.heads)
        if src.undo == "minus_one":
            out = out - 1.0
        elif src.undo == "log_neg":
            out = torch.log(-out)
        return out

    def read_row(self, name: str, index: int) -> torch.Tensor:
        src = self.sources[name]
        if src.compose.startswith("gpt_oss"):
            self.used.add(name)
            return self._composed(src, index)
        return self.read(name)[index]

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.checked(name, self.read(name)[start:stop], f"rows {start}:{stop}")

    def _handle(self, name: str) -> None:  # no safetensors handles: every read goes through ``read``
        self.used.add(name)

    def total_bytes(self) -> int:
        return self.file.total_bytes()

    def stored_blocks(self, name: str) -> tuple[str, torch.Tensor] | None:
        """The Hugging Face 2-D weight ``name`` as the kernel-format blocks it is stored in: ``(format, blocks [N, nb,
        P])`` (a copy of the file's bytes, rows in the checkpoint's order), or ``None`` where it is not one stored
        tensor of a kernel format with whole blocks per row (float, converted types, composed tensors)."""
        from freetoken_agent.runtime.quant.formats import GGUF_NATIVE, block_format

        src = self.sources.get(name)
        info = self.infos.get(name)
        if src is None or info is None or src.compose or src.undo or src.expert is not None or len(info.shape) != 2:
            return None
        fmt = GGUF_NATIVE.get(src.tensor.type_name)
        if fmt is None:
            return None
        n, k = info.shape
        block = block_format(fmt)
        if k % block.block_values:
            return None
        data = src.tensor.data if src.rows is None else src.tensor.data[src.rows[0] : src.rows[1]]
        blocks = torch.from_numpy(np.array(data, dtype=np.uint8)).view(n, k // block.block_values, block.block_bytes)
        self.used.add(name)
        return fmt, unpermute_rope(blocks, src.heads) if src.heads else blocks

    def gguf_type(self, name: str) -> str:
        """The ggml type the Hugging Face tensor ``name`` is stored in."""
        return self.sources[name].tensor.type_name


class StoredWeights:
    """The weights a loader read from kernel-format tensors of a GGUF file, by identity, so they can run as stored
    (``quantize_dense``'s ``stored``) instead of in the float they were dequantized to."""

    def __init__(self, reader: CheckpointReader | None) -> None:
        self.reader = reader if isinstance(reader, GGUFCheckpointReader) else None  # others: nothing is remembered
        self.by_id: dict[int, tuple[str, torch.Tensor]] = {}
        """id(weight as read) → (its name, the weight: held, so the id stays its own)."""

    def note(self, name: str, t: torch.Tensor) -> None:
        """Remember ``t``, read as ``name``, when it is 2-D and stored in a kernel format."""
        from freetoken_agent.runtime.quant.formats import GGUF_NATIVE

        src = self.reader.sources.get(name) if self.reader is not None else None
        if t.dim() == 2 and src is not None and src.tensor.type_name in GGUF_NATIVE:
            self.by_id[id(t)] = (name, t)

    def format(self, w: torch.Tensor) -> str | None:
        """The kernel format ``w`` is stored in (``None``: not remembered); reads nothing."""
        from freetoken_agent.runtime.quant.formats import GGUF_NATIVE, block_format

        entry = self.by_id.get(id(w))
        if entry is None or entry[1] is not w or self.reader is None:
            return None
        fmt = GGUF_NATIVE[self.reader.sources[entry[0]].tensor.type_name]
        return fmt if w.shape[1] % block_format(fmt).block_values == 0 else None

    def packed(self, w: torch.Tensor) -> Any:
        """``w``'s stored blocks in the kernels' tiles (``runtime.kernels.ops.PackedWeight``), or ``None``."""
        from freetoken_agent.runtime.kernels.ops import PackedWeight

        if self.format(w) is None or self.reader is None:
            return None
        got = self.reader.stored_blocks(self.by_id[id(w)][0])
        return None if got is None else PackedWeight.from_rows(got[0], got[1], w.shape[1])

    def clear(self) -> None:
        self.by_id.clear()
