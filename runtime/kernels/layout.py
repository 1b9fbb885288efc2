"""The kernels' repacked weight layout, as pure torch reshapes of GGUF Q8_0 / Q4_0 blocks.

Legend: ``N`` rows, ``nb`` blocks per row, ``P`` bytes per GGUF block (34 or 18), ``R`` = 8 rows per tile,
``J`` chunks per tile-block (q8: 8, q4: 4).

GGUF blocks ``[N, nb, P]`` become tiles ``[ceil(N/R), nb, 2R + 32J]``: per tile-block the eight rows' fp16 scales,
then ``J`` chunks of 32 bytes holding 4 bytes of each row (see ``csrc/ft_tiles.h``: q8 chunk ``j`` holds values
``4j..4j+3``; q4 chunk ``j`` byte ``p`` holds value ``8j+p`` in its low nibble and ``8j+4+p`` in its high one).
Padding rows are all-zero blocks (scale 0) and never reach the output. The same bytes, reordered: a tile-block
is exactly ``R`` GGUF blocks long.
"""

from __future__ import annotations

import torch

TILE_ROWS = 4 * 2


def _codes(body: torch.Tensor, q4: bool) -> torch.Tensor:
    """GGUF block bodies ``[..., P-2]`` → one uint8 code per value ``[..., 32]`` (q4: 0..15; q8: int8 bits)."""
    if not q4:
        return body
    return torch.cat([body & 0x0F, body >> 4], dim=-1)


def pack_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF blocks ``[..., N, nb, P]`` → flat tiles ``[..., ceil(N/8) * nb * 8P]`` (uint8)."""
    *lead, n, nb, p = blocks.shape
    q4 = p == 18
    nt = -(-n // TILE_ROWS)
    if nt * TILE_ROWS != n:
        pad = torch.zeros(*lead, nt * TILE_ROWS - n, nb, p, dtype=torch.uint8)
        blocks = torch.cat([blocks, pad], dim=-3)
    t = blocks.reshape(*lead, nt, TILE_ROWS, nb, p).transpose(-3, -2)  # [..., nt, nb, R, P]
    scales = t[..., :2].reshape(*lead, nt, nb, 2 * TILE_ROWS)
    codes = _codes(t[..., 2:], q4)  # [..., nt, nb, R, 32]
    if q4:
        c = codes.reshape(*lead, nt, nb, TILE_ROWS, 4, 2, 4)  # [..., R, j, half, p]
        chunks = (c[..., 0, :] | (c[..., 1, :] << 4)).transpose(-3, -2)  # [..., nt, nb, j, R, 4]
    else:
        chunks = codes.reshape(*lead, nt, nb, TILE_ROWS, 8, 4).transpose(-3, -2)  # [..., nt, nb, j, R, 4]
    body = chunks.reshape(*lead, nt, nb, -1)
    return torch.cat([scales, body], dim=-1).reshape(*lead, -1).contiguous()


def unpack_blocks(packed: torch.Tensor, n: int, nb: int, p: int) -> torch.Tensor:
    """The inverse of ``pack_blocks``: flat tiles ``[..., bytes]`` → GGUF blocks ``[..., N, nb, P]``."""
    *lead, _ = packed.shape
    q4 = p == 18
    nt = -(-n // TILE_ROWS)
    t = packed.reshape(*lead, nt, nb, TILE_ROWS * p)
    scales = t[..., : 2 * TILE_ROWS].reshape(*lead, nt, nb, TILE_ROWS, 2)
    body = t[..., 2 * TILE_ROWS :]
    if q4:
        chunks = body.reshape(*lead, nt, nb, 4, TILE_ROWS, 4).transpose(-3, -2)  # [..., R, j, 4]
        codes = torch.stack([chunks & 0x0F, chunks >> 4], dim=-2).reshape(*lead, nt, nb, TILE_ROWS, 32)
        gg = codes[..., :16] | (codes[..., 16:] << 4)
    else:
        gg = body.reshape(*lead, nt, nb, 8, TILE_ROWS, 4).transpose(-3, -2).reshape(*lead, nt, nb, TILE_ROWS, 32)
    blocks = torch.cat([scales, gg], dim=-1).transpose(-3, -2)  # [..., nt, R, nb, P]
    return blocks.reshape(*lead, nt * TILE_ROWS, nb, p)[..., :n, :, :].contiguous()
