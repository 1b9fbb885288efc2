"""MXFP4 weights (GPT-OSS checkpoints), read without conversion.

Checkpoint layout per projection: ``*_blocks`` uint8 ``[..., G, 16]`` (32 FP4 e2m1 values per block, two per byte:
the low nibble is the even element, the high nibble the odd one) and ``*_scales`` uint8 ``[..., G]`` (E8M0: the
block's scale is ``2 ** (s - 127)``). Decoding gives ``[..., G * 32]``; GPT-OSS stores experts as
``gate_up_proj_blocks [E, 2I, D/32, 16]`` (rows interleaved gate/up) and ``down_proj_blocks [E, D, I/32, 16]``.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., G * 32]`` from MXFP4 ``blocks [..., G, 16]`` and E8M0 ``scales [..., G]``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            "(want [..., G, 16] / [..., G])"
        )
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    vals = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    vals = vals.reshape(*blocks.shape[:-1], 32)
    exp = scales.to(torch.int32) - 127
    out = torch.ldexp(vals, exp[..., None].to(torch.float32))
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse (for building test checkpoints): ``w [..., K]`` with ``K % 32 == 0`` → ``(blocks, scales)``."""
    if w.shape[-1] % 32:
        raise CheckpointError(f"MXFP4 needs the last dim to be a multiple of 32, got {w.shape[-1]}")
    x = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = x.abs().amax(-1)
    # the largest e2m1 magnitude is 6 = 1.5 * 2**2: choose the smallest power of two that keeps amax/2**e <= 6
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = x / torch.pow(2.0, e)[..., None]
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (e.to(torch.int32) + 127).to(torch.uint8)
