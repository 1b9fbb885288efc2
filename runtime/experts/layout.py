"""The byte layout of one expert ("blob"): how it is stored in the cache file and in a slot.

Legend: ``S`` slots, ``D`` hidden, ``I`` expert intermediate size.

Every tier holds experts as equal-size blobs, so one read (or one DMA) moves one expert and a pool of ``S`` slots is
one ``uint8 [S, stride]`` tensor. ``ExpertLayout.views(pool)`` gives typed per-slot views with no copy:

- float formats (``float32``/``bfloat16``/``float16``): ``gate_up [S, 2I, D]`` (ungated experts: up ``[S, I, D]``),
  ``down [S, D, I]`` in that dtype;
- block formats (``q4_0``/``q8_0``/``q4_k``/``q6_k``): ``w13 [S, b13]`` and ``w2 [S, b2]`` bytes in the CPU kernels'
  tile layout (or plain GGUF blocks when the kernels are unavailable), exactly as ``QuantizedExperts`` holds them, so
  its kernels run on a pool; down may have its own format (``down_fmt``: a Q4_K_M GGUF file's Q6_K down);
- optional biases (``gate_up_bias [S, 2I]``, ``down_bias [S, D]``) after the weights, in fp32 for quantized blobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from freetoken_agent.runtime.checkpoint.experts import ExpertTensors
from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.quant.formats import KERNEL_FORMATS, block_format

FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANT_FORMATS = KERNEL_FORMATS
"""Block formats an expert blob can hold (the kernels' formats)."""
ALIGN = 64
"""Slot row alignment in bytes (cache-line; typed views need rows aligned to the element size)."""


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class SlotViews:
    """Typed views of a slot pool (no copies); quantized pools fill ``w13``/``w2``, float pools ``gate_up``/``down``."""

    gate_up: torch.Tensor | None = None  # [S, 2I, D]
    down: torch.Tensor | None = None  # [S, D, I]
    w13: torch.Tensor | None = None  # [S, b13] uint8
    w2: torch.Tensor | None = None  # [S, b2] uint8
    gate_up_bias: torch.Tensor | None = None  # [S, 2I]
    down_bias: torch.Tensor | None = None  # [S, D]


@dataclass(frozen=True)
class ExpertLayout:
    """Format and shapes of one expert blob; ``blob_bytes`` of payload in a row of ``stride`` bytes."""

    fmt: str
    hidden: int
    intermediate: int
    bias: bool = False
    packed: bool = False
    """Quantized blobs only: tile layout of the C kernels (True) or plain GGUF blocks (False)."""
    down_fmt: str | None = None
    """Quantized blobs only: down's block format where it differs from ``fmt`` (gate/up); ``None``: ``fmt``."""
    gated: bool = True
    """False: ungated experts (down(act(up x))); the first projection holds the up rows alone, ``[I, D]``."""

    def __post_init__(self) -> None:
        if self.fmt not in FLOAT_FORMATS and self.fmt not in QUANT_FORMATS:
            raise FreeTokenError(f"unknown expert storage format {self.fmt!r}")
        if self.down_fmt == self.fmt:  # one spelling per layout: equal layouts compare (and hash) equal
            object.__setattr__(self, "down_fmt", None)
        if self.down_fmt is not None and (not self.quantized or self.down_fmt not in QUANT_FORMATS):
            raise FreeTokenError(f"expert down format {self.down_fmt!r} needs block formats for gate/up and down, "
                                 f"got {self.fmt!r} gate/up")

    @property
    def quantized(self) -> bool:
        return self.fmt in QUANT_FORMATS

    @property
    def formats(self) -> tuple[str, str]:
        """(gate/up, down) storage formats."""
        return self.fmt, self.down_fmt or self.fmt

    @property
    def rows13(self) -> int:
        """Rows of the first projection: gate and up (2I), or up alone (I) for ungated experts."""
        return 2 * self.intermediate if self.gated else self.intermediate

    def _weight_bytes(self) -> tuple[int, int]:
        d, i, r = self.hidden, self.intermediate, self.rows13
        if not self.quantized:
            es = FLOAT_FORMATS[self.fmt].itemsize
            return r * d * es, d * i * es
        f13, f2 = (block_format(f) for f in self.formats)
        return f13.matrix_bytes(r, d, self.packed), f2.matrix_bytes(d, i, self.packed)

    @property
    def _bias_itemsize(self) -> int:
        return 4 if self.quantized else FLOAT_FORMATS[self.fmt].itemsize

    @property
    def offsets(self) -> dict[str, tuple[int, int]]:
        """Byte ranges of each part inside a blob."""
        b13, b2 = self._weight_bytes()
        out = {"gate_up": (0, b13), "down": (_round(b13, ALIGN), _round(b13, ALIGN) + b2)}
        if self.bias:
            es = self._bias_itemsize
            start = _round(out["down"][1], ALIGN)
            out["gate_up_bias"] = (start, start + self.rows13 * es)
            start = _round(out["gate_up_bias"][1], ALIGN)
            out["down_bias"] = (start, start + self.hidden * es)
        return out

    @property
    def blob_bytes(self) -> int:
        return max(end for _, end in self.offsets.values())

    @property
    def stride(self) -> int:
        """Bytes per slot row (payload rounded up to the alignment)."""
        return _round(self.blob_bytes, ALIGN)

    # ---------------------------------------------------------------- encode / view

    def encode(self, t: ExpertTensors) -> torch.Tensor:
        """One normalized expert → its blob (uint8 ``[blob_bytes]``); quantizes when the format says so."""
        parts: dict[str, torch.Tensor] = {}
        if self.quantized:
            for name, w, fmt in zip(("gate_up", "down"), (t.gate_up, t.down), map(block_format, self.formats)):
                parts[name] = fmt.storage(fmt.quantize_rows(w.float()), self.packed)  # blocks [N, nb, P] → bytes
            bias_dtype = torch.float32
        else:
            dtype = FLOAT_FORMATS[self.fmt]
            parts = {"gate_up": t.gate_up.to(dtype).contiguous(), "down": t.down.to(dtype).contiguous()}
            bias_dtype = dtype
        if self.bias:
            if t.gate_up_bias is None or t.down_bias is None:
                raise FreeTokenError("this expert layout stores biases but the expert has none")
            parts["gate_up_bias"] = t.gate_up_bias.to(bias_dtype).contiguous()
            parts["down_bias"] = t.down_bias.to(bias_dtype).contiguous()
        return self.place(parts)

    def place(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """An expert's parts in their stored form (``offsets``' names: weights as stored bytes, biases in the bias
        dtype) → its blob (uint8 ``[blob_bytes]``); a clear error for a part of the wrong size."""
        out = torch.zeros(self.blob_bytes, dtype=torch.uint8)
        for name, (a, b) in self.offsets.items():
            raw = parts[name].contiguous().reshape(-1).view(torch.uint8)
            if raw.numel() != b - a:
                raise FreeTokenError(f"expert part {name} has {raw.numel()} bytes, layout expects {b - a}")
            out[a:b] = raw
        return out

    def views(self, pool: torch.Tensor) -> SlotViews:
        """Typed views of ``pool`` (uint8 ``[S, stride]``)."""
        s, d, i = pool.shape[0], self.hidden, self.intermediate
        off = self.offsets

        def typed(name: str, dtype: torch.dtype, *shape: int) -> torch.Tensor:
            a, b = off[name]
            return pool[:, a:b].view(dtype).view(s, *shape)

        bias_dtype = torch.float32 if self.quantized else FLOAT_FORMATS[self.fmt]
        gub = typed("gate_up_bias", bias_dtype, self.rows13) if self.bias else None
        db = typed("down_bias", bias_dtype, d) if self.bias else None
        if self.quantized:
            (a13, b13), (a2, b2) = off["gate_up"], off["down"]
            return SlotViews(w13=pool[:, a13:b13], w2=pool[:, a2:b2], gate_up_bias=gub, down_bias=db)
        dtype = FLOAT_FORMATS[self.fmt]
        return SlotViews(gate_up=typed("gate_up", dtype, self.rows13, d), down=typed("down", dtype, d, i),
                         gate_up_bias=gub, down_bias=db)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"fmt": self.fmt, "hidden": self.hidden, "intermediate": self.intermediate,
                                  "bias": self.bias, "packed": self.packed}
        if self.down_fmt is not None:  # absent when it is fmt: the cache keys of one-format layouts stay as they were
            out["down_fmt"] = self.down_fmt
        if not self.gated:  # likewise absent for gated experts
            out["gated"] = False
        return out
