"""MXFP4: GPT-OSS checkpoints' expert weights (read without conversion), and GGUF's ``block_mxfp4`` blocks.

Legend: ``N`` rows, ``K`` columns, ``G`` 32-value groups per row (``nb`` in a GGUF block tensor).

Both hold 32 FP4 e2m1 values per group (0, ±0.5 … ±6) and one E8M0 exponent byte ``s`` per group: value =
``e2m1 * 2 ** (s - 127)``, computed as ggml computes it, ``KVALUES[code] * 2 ** (s - 128)`` (the doubled e2m1 values
times half the scale: exact for every ``s``, the subnormal scales of ``s`` = 0 and 1 and the largest one, 2 ** 127,
included). They differ in where the bytes go:

- **checkpoint** (safetensors): ``*_blocks`` uint8 ``[..., G, 16]`` (two values per byte: the low nibble is the even
  element, the high nibble the odd one) and ``*_scales`` uint8 ``[..., G]``. GPT-OSS stores experts as
  ``gate_up_proj_blocks [E, 2I, D/32, 16]`` (rows interleaved gate/up) and ``down_proj_blocks [E, D, I/32, 16]``;
- **GGUF** (``block_mxfp4``, 17 bytes): the exponent byte, then ``qs[16]``: byte ``j`` holds value ``j`` in its low
  nibble and value ``j + 16`` in its high one (Q4_0's order). The C kernels compute in these blocks
  (``kernels/csrc/ft_mxfp4.h``).

The quantizers follow ggml's (``quantize_row_mxfp4_ref``): the group's exponent puts its largest magnitude in
``[4, 8)`` times the scale (``s = floor(log2(amax)) + 125``; e2m1 reaches 6, so the largest values of a group may
clip to 6), then each value takes the nearest e2m1 code (ties to the lower code index).
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError, FreeTokenError

KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
"""ggml's ``kvalues_mxfp4``: the e2m1 value of each 4-bit code, doubled."""
GROUP = 32
MXFP4_BYTES = 17


def _encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups ``x [..., G, 32]`` fp32 → (codes ``[..., G, 32]`` uint8 0..15, exponent bytes ``[..., G]`` uint8)."""
    amax = x.abs().amax(-1)
    _, ex = torch.frexp(amax)  # amax = m * 2**ex, m in [0.5, 1): floor(log2(amax)) = ex - 1, exactly
    e = torch.where(amax > 0, (ex - 1 + 125).clamp(0, 255), torch.zeros_like(ex))
    scaled = x / torch.ldexp(torch.ones_like(amax), (e - 128).float())[..., None]  # a power of two: exact
    lut = torch.tensor(KVALUES, dtype=torch.float32)
    codes = (scaled[..., None] - lut).abs().argmin(-1)  # the first of equally near codes, as ggml's loop
    return codes.to(torch.uint8), e.to(torch.uint8)


def _decode(codes: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., G, 32]`` and exponent bytes ``[..., G]`` → fp32 values ``[..., G, 32]``."""
    vals = torch.tensor(KVALUES, dtype=torch.float32)[codes.long()]
    return torch.ldexp(vals, (e.to(torch.int32) - 128)[..., None].to(torch.float32))


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., G * 32]`` from checkpoint MXFP4 ``blocks [..., G, 16]`` and E8M0 ``scales [..., G]``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
            "(want [..., G, 16] / [..., G])"
        )
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], GROUP)  # [..., G, 32]
    return _decode(codes, scales).reshape(*blocks.shape[:-2], blocks.shape[-2] * GROUP)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse (for building test checkpoints): ``w [..., K]`` with ``K % 32 == 0`` → ``(blocks, scales)``."""
    if w.shape[-1] % GROUP:
        raise CheckpointError(f"MXFP4 needs the last dim to be a multiple of 32, got {w.shape[-1]}")
    codes, e = _encode(w.float().reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP))
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), e


def quantize_mxfp4_blocks(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` → GGUF MXFP4 blocks, uint8 ``[N, nb, 17]`` (rows zero-padded to whole blocks)."""
    if w.dim() != 2:
        raise FreeTokenError(f"quantize expects a 2-D weight, got shape {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise FreeTokenError("cannot quantize a weight that holds inf or nan")
    n, k = w.shape
    nb = -(-k // GROUP)
    codes, e = _encode(torch.nn.functional.pad(w.float(), (0, nb * GROUP - k)).reshape(n, nb, GROUP))
    qs = codes[..., :16] | (codes[..., 16:] << 4)  # [N, nb, 16]
    return torch.cat([e[..., None], qs], dim=-1).contiguous()


def dequantize_mxfp4_blocks(blocks: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """GGUF MXFP4 blocks uint8 ``[N, nb, 17]`` → fp32 ``[N, K]`` (``K`` defaults to ``nb * 32``)."""
    if blocks.dim() != 3 or blocks.shape[-1] != MXFP4_BYTES or blocks.dtype != torch.uint8:
        raise FreeTokenError(f"MXFP4 blocks must be uint8 [N, nb, {MXFP4_BYTES}], got {tuple(blocks.shape)}")
    n, nb, _ = blocks.shape
    qs = blocks[..., 1:]
    vals = _decode(torch.cat([qs & 0x0F, qs >> 4], dim=-1), blocks[..., 0])  # [N, nb, 32]
    return vals.reshape(n, nb * GROUP)[:, : nb * GROUP if k is None else k].contiguous()
