"""Q5_K: GGUF's 5-bit k-quant, byte for byte (quantize and dequantize; the kernels: ``kernels/csrc/ft_kquant.h``).

Legend: ``N`` rows, ``K`` columns, ``S`` = 256 values per super-block, ``ns = ceil(K / S)`` super-blocks per row,
8 sub-blocks of 32 values per super-block.

A super-block is 176 bytes, as GGUF stores ``block_q5_K``: Q4_K's 16-byte head (``d``, ``dmin`` fp16 and the 12
bytes of 6-bit scales and mins: ``q4k.py``), then

- ``qh[32]``: the codes' fifth bits; byte ``l`` holds that of value ``32j + l`` in bit ``j``;
- ``qs[128]``: the low 4 bits, as Q4_K's codes: byte ``32c + l`` holds value ``64c + l`` in its low nibble and
  ``64c + 32 + l`` in its high one.

Value ``i`` of sub-block ``j`` = ``d * sc_j * q_i - dmin * m_j``, ``q_i`` in 0..31.

The quantizer follows ggml's reference (``quantize_row_q5_K_ref``): Q4_K's weighted least-squares fit of scale and
min per sub-block with ggml's Q5_K parameters (``make_qkx2_quants(32, 31, rmin=-0.5, rdelta=0.1, nstep=15)``), the
scales and mins quantized to 6 bits against the super-block's largest, and the codes recomputed for the rounded
scales. Rows whose ``K`` is not a multiple of 256 are zero-padded (valid for us, not for a GGUF file).
"""

from __future__ import annotations

import torch

from ..errors import FreeTokenError
from .q4k import SUB, SUPER, quantize_super_blocks, super_block_scales

Q5_K_BYTES = 176
_BITS = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)  # sub-block j's fifth bits sit in bit j of qh


def quantize_q5_k(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` → Q5_K super-blocks, uint8 ``[N, ns, 176]``."""
    head, q = quantize_super_blocks(w, nmax=31, rmin=-0.5, nstep=15)  # q [B, 8, 32] in 0..31
    qh = ((q >> 4) << _BITS).sum(1, dtype=torch.uint8)  # [B, 32]: distinct bits, so the sum is an OR
    low = (q & 0x0F).reshape(-1, 4, 2, SUB)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)  # [B, 128]
    return torch.cat([head, qh, qs], dim=-1).reshape(w.shape[0], -1, Q5_K_BYTES).contiguous()


def dequantize_q5_k(blocks: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Q5_K super-blocks uint8 ``[N, ns, 176]`` → fp32 ``[N, K]`` (``K`` defaults to ``ns * 256``)."""
    if blocks.dim() != 3 or blocks.shape[-1] != Q5_K_BYTES or blocks.dtype != torch.uint8:
        raise FreeTokenError(f"Q5_K blocks must be uint8 [N, ns, {Q5_K_BYTES}], got {tuple(blocks.shape)}")
    n, ns, _ = blocks.shape
    b = blocks.reshape(-1, Q5_K_BYTES)
    dsc, dm = super_block_scales(b)  # [B, 8]
    high = (b[:, None, 16:48] >> _BITS) & 1  # [B, 8, 32]
    qs = b[:, 48:].reshape(-1, 4, 1, SUB)
    low = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, SUB)  # [B, 8, 32]
    q = (low | (high << 4)).float()
    vals = dsc[..., None] * q - dm[..., None]
    return vals.reshape(n, ns * SUPER)[:, : ns * SUPER if k is None else k].contiguous()
