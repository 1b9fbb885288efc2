"""FP8 e4m3 weights with 128×128 block scales (DeepSeek-V3 / Qwen3 FP8 checkpoints), read without conversion.

Checkpoint layout: ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale_inv`` fp32 (or e8m0) ``[ceil(N/bn),
ceil(K/bk)]`` with ``[bn, bk] = weight_block_size`` (128×128 in every published checkpoint); the real value is
``weight * weight_scale_inv`` of its block (despite the name, the scale multiplies).
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError

DEFAULT_BLOCK = (128, 128)


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> torch.Tensor:
    """fp32 ``[N, K]`` from an FP8 e4m3 weight and its per-block scales; the last blocks may be partial."""
    if weight.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise CheckpointError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise CheckpointError(
            f"FP8 block weight needs a 2-D weight and 2-D scales, "
            f"got {tuple(weight.shape)} and {tuple(scale_inv.shape)}"
        )
    bn, bk = block
    n, k = weight.shape
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(
            f"FP8 weight {tuple(weight.shape)} with {bn}x{bk} blocks needs scales of shape {want}, "
            f"got {tuple(scale_inv.shape)}"
        )
    scale = scale_inv.to(torch.float32)
    scale = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]  # [N, K]
    return weight.to(torch.float32) * scale


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, as the checkpoint producers do it (absmax per block ↦ 448): ``(weight_fp8, scale_inv)``.

    Used to build FP8 checkpoints in tests and tools; the engine only ever reads them.
    """
    bn, bk = block
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32)
    padded[:n, :k] = w.float()
    tiles = padded.reshape(gn, bn, gk, bk)
    amax = tiles.abs().amax(dim=(1, 3))  # [gn, gk]
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).reshape(gn * bn, gk * bk)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale
