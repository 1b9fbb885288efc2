"""The kernels' repacked weight layout, as pure torch reshapes of GGUF Q8_0 / Q4_0 blocks.

Legend: ``N`` rows, ``nb`` blocks per row, ``P`` bytes per GGUF block (34 or 18), ``R`` = 4 rows per tile.
GGUF blocks ``[N, nb, P]`` (fp16 scale + codes) become tiles ``[ceil(N/R), nb, 2R + R(P-2)]``: per tile-block the
four rows' fp16 scales first, then their four code runs, so the C kernel reads one contiguous stream per 4 rows
(see ``csrc/ft_kernels.c``). Padding rows are all-zero blocks (scale 0) and never reach the output.
"""

from __future__ import annotations

import torch

TILE_ROWS = 4


def pack_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF blocks ``[..., N, nb, P]`` → flat tiles ``[..., ceil(N/4) * nb * (8 + 4(P-2))]`` (uint8)."""
    *lead, n, nb, p = blocks.shape
    n4 = -(-n // TILE_ROWS)
    if n4 * TILE_ROWS != n:
        pad = torch.zeros(*lead, n4 * TILE_ROWS - n, nb, p, dtype=torch.uint8)
        blocks = torch.cat([blocks, pad], dim=-3)
    t = blocks.reshape(*lead, n4, TILE_ROWS, nb, p).transpose(-3, -2)  # [..., n4, nb, R, P]
    scales = t[..., :2].reshape(*lead, n4, nb, 2 * TILE_ROWS)
    codes = t[..., 2:].reshape(*lead, n4, nb, TILE_ROWS * (p - 2))
    return torch.cat([scales, codes], dim=-1).reshape(*lead, -1).contiguous()


def unpack_blocks(packed: torch.Tensor, n: int, nb: int, p: int) -> torch.Tensor:
    """The inverse of ``pack_blocks``: flat tiles ``[..., bytes]`` → GGUF blocks ``[..., N, nb, P]``."""
    *lead, _ = packed.shape
    n4 = -(-n // TILE_ROWS)
    t = packed.reshape(*lead, n4, nb, 2 * TILE_ROWS + TILE_ROWS * (p - 2))
    scales = t[..., : 2 * TILE_ROWS].reshape(*lead, n4, nb, TILE_ROWS, 2)
    codes = t[..., 2 * TILE_ROWS :].reshape(*lead, n4, nb, TILE_ROWS, p - 2)
    blocks = torch.cat([scales, codes], dim=-1).transpose(-3, -2)  # [..., n4, R, nb, P]
    return blocks.reshape(*lead, n4 * TILE_ROWS, nb, p)[..., :n, :, :].contiguous()
