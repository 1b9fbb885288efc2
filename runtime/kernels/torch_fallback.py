"""The no-compiler fallback for q4: torch's own int4 CPU matmul with bf16 activations.

Without a C compiler the experts stay in GGUF blocks; q4 experts additionally get torch's int4 packing
(``_convert_weight_to_int4pack_for_cpu``, group 32, scale = the block's scale in bf16, zero point 0, so
``(code - 8) * scale`` is exactly Q4_0's rule) and run through ``_weight_int4pack_mm_for_cpu``. Measured on a
first-generation Zen, that op streams 2.5-4.8 GB/s with bf16 activations but 0.1-0.8 GB/s with fp32 ones, hence the
cast. Costs: bf16 scales and activations add ~0.3% relative error, and the packed copy doubles expert memory on this
path. q8 (no group-wise int8 op in torch) and any failure here fall back to dequantize + fp32 ``torch.mm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant.blocks import BLOCK


@dataclass(frozen=True)
class Int4Weight:
    """A ``[N, K]`` Q4_0 weight in torch's CPU int4 layout."""

    packed: torch.Tensor  # uint8 [N, K/2]
    scales_zeros: torch.Tensor  # bf16 [K/32, N, 2]
    n: int
    k: int


def int4pack(blocks: torch.Tensor) -> Int4Weight | None:
    """Q4_0 blocks ``[N, nb, 18]`` → ``Int4Weight``; ``None`` where this torch lacks the op or rejects the shape."""
    n, nb, _ = blocks.shape
    k = nb * BLOCK
    scales = blocks[..., :2].contiguous().view(torch.float16).float().reshape(n, nb)  # [N, G]
    body = blocks[..., 2:]
    codes = torch.cat([body & 0x0F, body >> 4], dim=-1).reshape(n, k).to(torch.int32)  # [N, K], 0..15
    pad = -n % 16  # the op wants whole groups of 16 rows: pad with zero-scale rows, sliced off after the matmul
    if pad:
        codes = torch.cat([codes, torch.full((pad, k), 8, dtype=torch.int32)])
        scales = torch.cat([scales, torch.zeros(pad, nb)])
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    except (RuntimeError, AttributeError):
        return None
    sz = torch.stack([scales.t(), torch.zeros_like(scales.t())], dim=-1).to(torch.bfloat16).contiguous()
    return Int4Weight(packed, sz, n, k)


def int4_linear(w: Int4Weight, x: torch.Tensor) -> torch.Tensor:
    """``x [M, K']`` (K' <= K, zero-padded to K) → fp32 ``x @ W^T [M, N]`` with bf16 activations."""
    if x.shape[1] != w.k:
        x = torch.nn.functional.pad(x, (0, w.k - x.shape[1]))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), w.packed, BLOCK, w.scales_zeros)
    return y[:, : w.n].float()
