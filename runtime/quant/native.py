"""Read FP8-block and MXFP4 checkpoints as they are published, without a conversion step.

``NativeQuantReader`` is a ``CheckpointReader`` whose tensors are the *dequantized* ones under the names a
bf16 checkpoint of the same model would use, so every loader and adapter works unchanged:

- FP8 (DeepSeek-V3, Qwen3-FP8): ``X.weight`` float8_e4m3fn + ``X.weight_scale_inv`` → ``X.weight`` fp32; the block
  size comes from ``quantization_config.weight_block_size`` (default 128×128).
- MXFP4 (GPT-OSS): ``P_blocks`` ``[E, R, C/32, 16]`` + ``P_scales`` ``[E, R, C/32]`` → ``P`` decoded to ``[E, R, C]``
  and transposed to ``[E, C, R]`` (the bf16 GPT-OSS layout: ``gate_up_proj [E, D, 2I]``, ``down_proj [E, I, D]``).

The scale tensors disappear from the name list (they are consumed, not unexpected); reading a virtual tensor marks
its sources used.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.reader import CheckpointReader, TensorInfo
from .fp8 import DEFAULT_BLOCK, dequantize_fp8_block
from .mxfp4 import dequantize_mxfp4


def _quant_config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return qc if isinstance(qc, dict) else {}


class NativeQuantReader(CheckpointReader):
    """A checkpoint reader that decodes FP8-block and MXFP4 tensors on read (see the module docstring)."""

    def __init__(self, path: str | Path, renames: Sequence[tuple[str, str, bool]] = ()) -> None:
        super().__init__(path, renames=renames)
        qc = _quant_config(self.path)
        block = qc.get("weight_block_size") or DEFAULT_BLOCK
        self.fp8_block = (int(block[0]), int(block[1]))
        self._fp8: dict[str, str] = {}  # weight name -> scale name
        self._mx: dict[str, tuple[str, str]] = {}  # virtual name -> (blocks name, scales name)
        raw = dict(self.infos)
        self._all: dict[str, TensorInfo] = raw
        for name, info in raw.items():
            if name.endswith(".weight_scale_inv") and name[: -len("_scale_inv")] in raw:
                weight = name[: -len("_scale_inv")]
                if raw[weight].dtype.upper().startswith("F8"):
                    self._fp8[weight] = name
                    del self.infos[name]
                    w = raw[weight]
                    self.infos[weight] = TensorInfo(weight, w.file, "F32", w.shape, w.offsets)
            elif name.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in raw:
                base = name[: -len("_blocks")]
                shape = info.shape  # [..., R, G, 16]
                virtual = (*shape[:-3], shape[-2] * 32, shape[-3])
                self._mx[base] = (name, base + "_scales")
                del self.infos[name], self.infos[base + "_scales"]
                self.infos[base] = TensorInfo(base, info.file, "F32", virtual, info.offsets)

    @property
    def is_quantized(self) -> bool:
        """Whether any FP8 or MXFP4 tensor was found."""
        return bool(self._fp8 or self._mx)

    def _raw(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def _info(self, name: str) -> TensorInfo:
        # also finds the hidden source tensors (scales, blocks) of decoded FP8 / MXFP4 weights
        return self._all[name]

    def read(self, name: str) -> torch.Tensor:
        if name in self._fp8:
            weight = dequantize_fp8_block(self._raw(name), self._raw(self._fp8[name]), self.fp8_block)
            return weight.t().contiguous() if name in self.transposed else weight
        if name in self._mx:
            blocks, scales = self._mx[name]
            self.used.add(name)
            return dequantize_mxfp4(self._raw(blocks), self._raw(scales)).transpose(-1, -2).contiguous()
        return super().read(name)

    def read_row(self, name: str, index: int) -> torch.Tensor:
        if name in self._mx:
            blocks, scales = self._mx[name]
            self.used.update((name, blocks, scales))
            b = self._handle(blocks).get_slice(blocks)[index]
            s = self._handle(scales).get_slice(scales)[index]
            return dequantize_mxfp4(b, s).transpose(-1, -2).contiguous()
        if name in self._fp8:
            return self.read(name)[index]
        return super().read_row(name, index)


def open_checkpoint(path: str | Path, renames: Sequence[tuple[str, str, bool]] = ()) -> CheckpointReader:
    """A ``NativeQuantReader`` when the folder holds FP8-block or MXFP4 tensors, else a plain ``CheckpointReader``;
    ``renames``: the model's ``checkpoint_renames`` (see ``CheckpointReader``)."""
    reader = NativeQuantReader(path, renames)
    return reader if reader.is_quantized else CheckpointReader(path, renames=renames)
