"""The kernels' repacked weight layout, as pure torch reshapes of GGUF Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K / MXFP4 blocks.

Legend: ``N`` rows, ``nb`` blocks per row, ``P`` bytes per GGUF block (34 or 18), ``R`` = 8 rows per tile,
``J`` chunks per tile-block (q8: 8, q4: 4).

GGUF blocks ``[N, nb, P]`` become tiles ``[ceil(N/R), nb, 2R + 32J]``: per tile-block the eight rows' fp16 scales,
then ``J`` chunks of 32 bytes holding 4 bytes of each row (see ``csrc/ft_tiles.h``: q8 chunk ``j`` holds values
``4j..4j+3``; q4 chunk ``j`` byte ``p`` holds value ``8j+p`` in its low nibble and ``8j+4+p`` in its high one).
Padding rows are all-zero blocks (scale 0) and never reach the output. The same bytes, reordered: a tile-block
is exactly ``R`` GGUF blocks long.

K-quant super-blocks (``P`` = 144 for Q4_K, 176 for Q5_K, 210 for Q6_K; 256 values each) are tiled the same way, 8
rows at a time, each field's bytes interleaved by row (``csrc/ft_kquant.h``): Q4_K ``d[8] | dmin[8] | scales [12, 8]
| qs [32, 8, 4]``, Q5_K ``d[8] | dmin[8] | scales [12, 8] | [8, 5, 8, 4]``, Q6_K ``d[8] | scales [16, 8] |
[16, 3, 8, 4]`` (``[i, r]``: byte ``i`` of row ``r``; ``[m, r, 4]``: bytes ``4m..4m+3`` of row ``r``). The code
chunks go in the order the kernel reads them (``CODE_CHUNKS``): Q5_K in groups ``q`` of qh chunk ``q`` and qs chunks
``q``, ``8 + q``, ``16 + q``, ``24 + q``; Q6_K in groups ``(n, q)`` of ql chunk ``16n + q``, ql chunk ``16n + 8 + q``
and qh chunk ``8n + q``. MXFP4 blocks (``P`` = 17, 32 values) are tiled by fields too (``csrc/ft_mxfp4.h``): per
tile-block ``e[8] | qs [4, 8, 4]``. Which layout a block tensor gets follows from ``P``.
"""

from __future__ import annotations

import torch

TILE_ROWS = 4 * 2
FIELDS = {
    144: ((0, 2), (2, 4), (4, 16), (16, 144)),
    176: ((0, 2), (2, 4), (4, 16), (16, 176)),
    210: ((208, 210), (192, 208), (0, 192)),
    17: ((0, 1), (1, 17)),
}
"""Block size of a format tiled field by field → its fields' byte ranges in tile order (Q4_K / Q5_K: d, dmin, scales,
codes; Q6_K: d, scales, codes; MXFP4: exponent, codes); the last field holds the codes, 4 bytes per row at a time."""
CODE_CHUNKS: dict[int, tuple[int, ...]] = {
    176: tuple(c for q in range(8) for c in (q, 8 + q, 16 + q, 24 + q, 32 + q)),  # qh chunk q, then 4 qs chunks
    210: tuple(c for n in range(2) for q in range(8) for c in (16 * n + q, 16 * n + 8 + q, 32 + 8 * n + q)),
}
"""Block size → the order its code field's 4-byte chunks take in a tile (chunk ``m``: the field's bytes
``4m..4m+3``; Q4_K and MXFP4 keep them in order). Q5_K's field is ``qh | qs`` (chunks 0-7, 8-39), Q6_K's
``ql | qh`` (0-31, 32-47)."""


def _regroup(codes: torch.Tensor, order: tuple[int, ...] | None, inverse: bool = False) -> torch.Tensor:
    """A code field ``[..., F]`` with its 4-byte chunks put in ``order`` (or back, ``inverse``)."""
    if order is None:
        return codes
    *lead, width = codes.shape
    index = torch.tensor(order)
    if inverse:
        index = torch.argsort(index)
    return codes.reshape(*lead, width // 4, 4)[..., index, :].reshape(*lead, width)


def _field_tiles(f: torch.Tensor, four: bool) -> torch.Tensor:
    """One field ``[..., nt, ns, R, F]`` → its tile bytes ``[..., nt, ns, R * F]``: 4-byte groups or fp16 pairs of
    the rows side by side (``four``: code bytes; else ``F`` = 2 stays per row for fp16, single bytes interleave)."""
    *lead, r, width = f.shape
    if four:
        return f.reshape(*lead, r, width // 4, 4).transpose(-3, -2).reshape(*lead, r * width)
    if width == 2:  # an fp16 per row: rows in order
        return f.reshape(*lead, r * width)
    return f.transpose(-2, -1).reshape(*lead, r * width)


def _field_rows(t: torch.Tensor, r: int, width: int, four: bool) -> torch.Tensor:
    """The inverse of ``_field_tiles``: ``[..., R * F]`` → ``[..., R, F]``."""
    *lead, _ = t.shape
    if four:
        return t.reshape(*lead, width // 4, r, 4).transpose(-3, -2).reshape(*lead, r, width)
    if width == 2:
        return t.reshape(*lead, r, width)
    return t.reshape(*lead, width, r).transpose(-2, -1)


def _pad_rows(blocks: torch.Tensor) -> torch.Tensor:
    *lead, n, nb, p = blocks.shape
    nt = -(-n // TILE_ROWS)
    if nt * TILE_ROWS == n:
        return blocks
    pad = torch.zeros(*lead, nt * TILE_ROWS - n, nb, p, dtype=torch.uint8)
    return torch.cat([blocks, pad], dim=-3)


def _pack_fields(blocks: torch.Tensor) -> torch.Tensor:
    *lead, n, ns, p = blocks.shape
    nt = -(-n // TILE_ROWS)
    t = _pad_rows(blocks).reshape(*lead, nt, TILE_ROWS, ns, p).transpose(-3, -2)  # [..., nt, ns, R, P]
    fields = FIELDS[p]
    parts = [_field_tiles(t[..., a:b], four=False) for a, b in fields[:-1]]
    a, b = fields[-1]
    parts.append(_field_tiles(_regroup(t[..., a:b], CODE_CHUNKS.get(p)), four=True))
    return torch.cat(parts, dim=-1).reshape(*lead, -1).contiguous()


def _unpack_fields(packed: torch.Tensor, n: int, ns: int, p: int) -> torch.Tensor:
    *lead, _ = packed.shape
    nt = -(-n // TILE_ROWS)
    t = packed.reshape(*lead, nt, ns, TILE_ROWS * p)
    out = torch.empty(*lead, nt, ns, TILE_ROWS, p, dtype=torch.uint8)
    at = 0
    fields = FIELDS[p]
    for i, (a, b) in enumerate(fields):
        width, codes = b - a, i == len(fields) - 1
        rows = _field_rows(t[..., at : at + TILE_ROWS * width], TILE_ROWS, width, four=codes)
        out[..., a:b] = _regroup(rows, CODE_CHUNKS.get(p), inverse=True) if codes else rows
        at += TILE_ROWS * width
    return out.transpose(-3, -2).reshape(*lead, nt * TILE_ROWS, ns, p)[..., :n, :, :].contiguous()


def _codes(body: torch.Tensor, q4: bool) -> torch.Tensor:
    """GGUF block bodies ``[..., P-2]`` → one uint8 code per value ``[..., 32]`` (q4: 0..15; q8: int8 bits)."""
    if not q4:
        return body
    return torch.cat([body & 0x0F, body >> 4], dim=-1)


def pack_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF blocks ``[..., N, nb, P]`` → flat tiles ``[..., ceil(N/8) * nb * 8P]`` (uint8)."""
    *lead, n, nb, p = blocks.shape
    if p in FIELDS:
        return _pack_fields(blocks)
    q4 = p == 18
    nt = -(-n // TILE_ROWS)
    blocks = _pad_rows(blocks)
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
    if p in FIELDS:
        return _unpack_fields(packed, n, nb, p)
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
