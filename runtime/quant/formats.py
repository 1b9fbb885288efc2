"""The registry of block formats: one entry per format, each with its layout, dequantization and kernel.

Legend: ``N`` rows, ``K`` columns (the reduction dim), ``nb`` blocks per row, ``P`` bytes per block.

A ``BlockFormat`` is the one place that knows, for its format:

- **layout**: values and bytes per block; the bytes of an ``[N, K]`` matrix as plain GGUF blocks ``[N, nb, P]`` or
  in the C kernels' tile layout (``packed``; ``runtime/kernels/layout.py``); ``storage`` / ``blocks`` convert
  between the two;
- **dequantization**: blocks ``[N, nb, P]`` → fp32 ``[N, K]``, the values every kernel must reproduce, and the
  plain-torch quantizer that writes them (the C quantizer, ``kernels.ops.quantize*``, writes the same bytes);
- **kernel**: whether the C kernels compute in it, and otherwise the format it runs as (``runs_as``).

The math itself lives beside this file (``blocks.py`` for Q8_0/Q4_0, ``q4k.py`` / ``q5k.py`` / ``q6k.py`` for
GGUF's Q4_K / Q5_K / Q6_K super-blocks of 256 values, whose rows must be whole super-blocks for the kernels,
``mxfp4.py`` for GGUF's MXFP4 blocks); checkpoint encodings that are decoded on read (FP8 blocks, a safetensors
checkpoint's MXFP4 tensors: ``native.py``) are not block formats the experts are stored in. ``GGUF_TYPES`` maps the ggml block types of a GGUF file onto these formats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import FreeTokenError, OptionError
from . import blocks as q80
from .mxfp4 import GROUP, MXFP4_BYTES, dequantize_mxfp4_blocks, quantize_mxfp4_blocks
from .q4k import Q4_K_BYTES, SUPER, dequantize_q4_k, quantize_q4_k
from .q5k import Q5_K_BYTES, dequantize_q5_k, quantize_q5_k
from .q6k import Q6_K_BYTES, dequantize_q6_k, quantize_q6_k


@dataclass(frozen=True)
class BlockFormat:
    """One block format (see the module docstring); ``name`` is its canonical lower-case name (``q4_0``)."""

    name: str
    block_values: int
    """Values per block along ``K``."""
    block_bytes: int
    """Bytes per block (``P``)."""
    kernel: bool
    """Whether the C kernels (``runtime/kernels``) compute in this format."""
    runs_as: str
    """The kernel format its weights are converted to at load (itself for a kernel format)."""
    quantize_rows: Callable[[torch.Tensor], torch.Tensor]
    """``w [N, K]`` → blocks ``[N, nb, P]`` uint8 (plain torch; rows zero-padded to whole blocks)."""
    dequantize_rows: Callable[[torch.Tensor, int], torch.Tensor]
    """(blocks ``[N, nb, P]``, ``K``) → fp32 ``[N, K]``."""

    def nb(self, k: int) -> int:
        """Blocks per row of ``K`` values."""
        return -(-k // self.block_values)

    def matrix_bytes(self, n: int, k: int, packed: bool = False) -> int:
        """Bytes of an ``[N, K]`` matrix: plain blocks, or the kernels' tiles (``packed``, kernel formats only)."""
        if packed:
            from ..kernels.ops import packed_bytes

            self._need_kernel("the kernels' tile layout")
            return packed_bytes(self.name, n, k)
        return n * self.nb(k) * self.block_bytes

    def storage(self, blocks: torch.Tensor, packed: bool) -> torch.Tensor:
        """Blocks ``[..., N, nb, P]`` → the stored bytes ``[..., bytes]``: tiles when ``packed``, else as they are."""
        if packed:
            from ..kernels.layout import pack_blocks

            self._need_kernel("the kernels' tile layout")
            return pack_blocks(blocks)
        return blocks.reshape(*blocks.shape[:-3], -1)

    def blocks(self, raw: torch.Tensor, n: int, k: int, packed: bool) -> torch.Tensor:
        """The inverse of ``storage``: stored bytes ``[..., bytes]`` of ``[N, K]`` matrices → ``[..., N, nb, P]``."""
        if packed:
            from ..kernels.layout import unpack_blocks

            return unpack_blocks(raw, n, self.nb(k), self.block_bytes)
        return raw.reshape(*raw.shape[:-1], n, self.nb(k), self.block_bytes)

    def dequantize(self, raw: torch.Tensor, n: int, k: int, packed: bool = False) -> torch.Tensor:
        """Stored bytes of one ``[N, K]`` matrix (plain or packed) → fp32 ``[N, K]``, with torch ops on its device."""
        return self.dequantize_rows(self.blocks(raw, n, k, packed), k)

    def _need_kernel(self, what: str) -> None:
        if not self.kernel:
            raise FreeTokenError(f"{self.name} has no kernels, so no {what}; it runs as {self.runs_as}")


def _q(fmt: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda w: q80.quantize(w, fmt).blocks


def _dq(fmt: str) -> Callable[[torch.Tensor, int], torch.Tensor]:
    return lambda b, k: q80.dequantize(q80.BlockQuantized(fmt, (b.shape[0], k), b))


FORMATS: dict[str, BlockFormat] = {
    "q8_0": BlockFormat("q8_0", q80.BLOCK, q80.BLOCK_BYTES["q8_0"], True, "q8_0", _q("q8_0"), _dq("q8_0")),
    "q4_0": BlockFormat("q4_0", q80.BLOCK, q80.BLOCK_BYTES["q4_0"], True, "q4_0", _q("q4_0"), _dq("q4_0")),
    "q4_k": BlockFormat("q4_k", SUPER, Q4_K_BYTES, True, "q4_k", quantize_q4_k, dequantize_q4_k),
    "q5_k": BlockFormat("q5_k", SUPER, Q5_K_BYTES, True, "q5_k", quantize_q5_k, dequantize_q5_k),
    "q6_k": BlockFormat("q6_k", SUPER, Q6_K_BYTES, True, "q6_k", quantize_q6_k, dequantize_q6_k),
    "mxfp4": BlockFormat("mxfp4", GROUP, MXFP4_BYTES, True, "mxfp4", quantize_mxfp4_blocks, dequantize_mxfp4_blocks),
}
"""Every block format, by canonical name."""
KERNEL_FORMATS = tuple(name for name, f in FORMATS.items() if f.kernel)
"""The formats the C kernels compute in (``--quant`` offers the ones they also quantize to: ``QUANT_CHOICES``)."""

GGUF_TYPES: dict[str, str] = {
    "Q8_0": "q8_0", "Q4_0": "q4_0",
    "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k",
    "Q4_1": "q4_0", "Q3_K": "q4_0", "Q2_K": "q4_0", "IQ4_XS": "q4_0", "IQ4_NL": "q4_0",
    "MXFP4": "mxfp4", "IQ3_S": "q4_0", "IQ3_XXS": "q4_0", "IQ2_XXS": "q4_0", "IQ2_XS": "q4_0", "IQ2_S": "q4_0",
    "IQ1_S": "q4_0", "IQ1_M": "q4_0", "TQ1_0": "q4_0", "TQ2_0": "q4_0",
    "Q5_0": "q8_0", "Q5_1": "q8_0",
}  # fmt: skip
"""Stored ggml block type → the kernel format it runs in (the nearest one at least as wide)."""
GGUF_NATIVE = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "MXFP4": "mxfp4"}
"""Stored ggml types the kernels run byte for byte as they are."""


def block_format(name: str) -> BlockFormat:
    """The registry entry for ``name`` (``q4``/``q8`` accepted for ``q4_0``/``q8_0``); a clear error otherwise."""
    key = q80.FORMAT_ALIASES.get(name.lower(), name.lower())
    try:
        return FORMATS[key]
    except KeyError:
        raise FreeTokenError(f"unknown block format {name!r}; expected one of {', '.join(FORMATS)}") from None


QUANT_CHOICES = ("none", "q8", "q4")
"""What ``--quant`` / ``dense_quant`` accept (``q8_0`` / ``q4_0`` too)."""


def check_quant(quant: str | None) -> str:
    """Normalize a user's ``--quant`` value to ``none`` or a kernel format (``q8_0`` / ``q4_0``)."""
    q = (quant or "none").lower()
    if q in ("none", "fp", "float", ""):
        return "none"
    if q in ("q8", "q8_0", "q4", "q4_0"):
        return q80.canonical_format(q)
    raise OptionError(f"unknown --quant {quant!r}; expected one of {', '.join(QUANT_CHOICES)}")
