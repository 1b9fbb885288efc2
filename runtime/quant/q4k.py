"""Q4_K: GGUF's 4-bit k-quant, byte for byte (quantize and dequantize; the kernels: ``kernels/csrc/ft_kquant.h``).

Legend: ``N`` rows, ``K`` columns, ``S`` = 256 values per super-block, ``ns = ceil(K / S)`` super-blocks per row,
8 sub-blocks of 32 values per super-block.

A super-block is 144 bytes, as GGUF stores ``block_q4_K``:

- ``d`` fp16, ``dmin`` fp16: scales of the sub-blocks' scales and mins;
- ``scales[12]``: eight 6-bit scales ``sc_j`` and eight 6-bit mins ``m_j``, packed: bytes 0-3 hold ``sc_0..3`` in
  their low 6 bits, bytes 4-7 ``m_0..3``; bytes 8-11 hold ``sc_4..7`` (low nibble) and ``m_4..7`` (high nibble),
  whose top 2 bits sit in the top 2 bits of bytes 0-3 (scales) and 4-7 (mins);
- ``qs[128]``: 4-bit codes; byte ``32c + l`` holds value ``64c + l`` in its low nibble, ``64c + 32 + l`` in its high.

Value ``i`` of sub-block ``j`` = ``d * sc_j * q_i - dmin * m_j`` (an asymmetric 4-bit grid per 32 values).

The quantizer follows ggml's reference (``quantize_row_q4_K_ref``): per sub-block a weighted least-squares search
over 20 candidate grids for scale and min (weights ``rms(x) + |x|``, min clamped to ≤ 0), then the 8 scales and 8
mins are quantized to 6 bits against the super-block's largest, and the codes recomputed for the rounded scales.
Rows whose ``K`` is not a multiple of 256 are zero-padded (valid for us, not for a GGUF file). Q5_K (``q5k.py``)
shares the head, the fit and the scale packing (``quantize_super_blocks``, ``super_block_scales``).
"""

from __future__ import annotations

import torch

from ..errors import FreeTokenError

SUPER = 256
SUB = 32
Q4_K_BYTES = 144


def _round(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)  # half to even, like ggml's nearest_int


def fit_scale_min(x: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sub-block ``x [B, 32]`` → (scale ``[B]``, min ``[B]`` ≥ 0) so that ``x ≈ scale * q - min``, q in 0..nmax.

    ggml's ``make_qkx2_quants(32, nmax, rmin, rdelta=0.1, nstep)`` (Q4_K: 15, -1, 20; Q5_K: 31, -0.5, 15),
    vectorized over sub-blocks; like it, a better fit also moves the grid's origin for the candidates after it.
    """
    w = x.square().mean(-1, keepdim=True).sqrt() + x.abs()  # [B, 32] importance weights
    lo = x.amin(-1).clamp(max=0.0)  # [B]
    hi = x.amax(-1)
    flat = hi <= lo
    sum_w, sum_x = w.sum(-1), (w * x).sum(-1)

    def codes(iscale: torch.Tensor, origin: torch.Tensor) -> torch.Tensor:
        return _round(iscale[:, None] * (x - origin[:, None])).clamp_(0, nmax)

    def span(origin: torch.Tensor) -> torch.Tensor:
        d = hi - origin
        return torch.where(d > 0, d, torch.ones_like(d))

    scale = span(lo) / nmax
    best_min = lo
    q = codes(1.0 / scale, lo)
    best_err = (w * (scale[:, None] * q + lo[:, None] - x).square()).sum(-1)
    for step in range(nstep + 1):
        qs = codes((rmin + 0.1 * step + nmax) / span(best_min), best_min)
        sum_l, sum_l2, sum_xl = (w * qs).sum(-1), (w * qs * qs).sum(-1), (w * qs * x).sum(-1)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = torch.where(ok, det, torch.ones_like(det))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        pos = this_min > 0  # the grid must reach down to 0 or below: refit the scale alone
        this_scale = torch.where(pos, sum_xl / sum_l2.clamp_min(1e-30), this_scale)
        this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
        err = (w * (this_scale[:, None] * qs + this_min[:, None] - x).square()).sum(-1)
        better = ok & (err < best_err)
        scale = torch.where(better, this_scale, scale)
        best_min = torch.where(better, this_min, best_min)
        best_err = torch.where(better, err, best_err)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return scale, -torch.where(flat, lo, best_min)


def quantize_super_blocks(w: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` → the asymmetric k-quants' super-blocks before their codes are packed (Q4_K, Q5_K):
    (head ``[N * ns, 16]`` uint8: fp16 ``d``, fp16 ``dmin``, the 12 packed scale/min bytes; codes ``[N * ns, 8, 32]``
    uint8 in 0..nmax), ``fit_scale_min``'s parameters as for that format."""
    if w.dim() != 2:
        raise FreeTokenError(f"quantize expects a 2-D weight, got shape {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise FreeTokenError("cannot quantize a weight that holds inf or nan")
    n, k = w.shape
    ns = -(-k // SUPER)
    x = torch.nn.functional.pad(w.float(), (0, ns * SUPER - k)).reshape(n * ns, 8, SUB)  # [B, 8, 32]
    scale, mins = fit_scale_min(x.reshape(-1, SUB), nmax, rmin, nstep)
    scale, mins = scale.reshape(-1, 8), mins.reshape(-1, 8)  # [B, 8]
    max_scale, max_min = scale.amax(-1), mins.amax(-1)  # [B]
    inv_s = torch.where(max_scale > 0, 63.0 / max_scale, torch.zeros_like(max_scale))
    inv_m = torch.where(max_min > 0, 63.0 / max_min, torch.zeros_like(max_min))
    ls = _round(inv_s[:, None] * scale).clamp_(0, 63).to(torch.uint8)  # [B, 8] 6-bit
    lm = _round(inv_m[:, None] * mins).clamp_(0, 63).to(torch.uint8)
    d = (max_scale / 63.0).to(torch.float16)
    dmin = (max_min / 63.0).to(torch.float16)
    sub_d = d.float()[:, None] * ls.float()  # [B, 8] the scales the decoder will use
    sub_m = dmin.float()[:, None] * lm.float()
    safe = torch.where(sub_d != 0, sub_d, torch.ones_like(sub_d))
    q = _round((x + sub_m[..., None]) / safe[..., None]).clamp_(0, nmax)
    q = torch.where(sub_d[..., None] != 0, q, torch.zeros_like(q)).to(torch.uint8)  # [B, 8, 32]
    packed = torch.cat([
        ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
        lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
        (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4),
    ], dim=-1)  # fmt: skip
    head = torch.stack([d, dmin], dim=-1).contiguous().view(torch.uint8)  # [B, 4]
    return torch.cat([head, packed], dim=-1), q


def super_block_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Super-blocks ``[B, P]`` that start with Q4_K's 16-byte head → (``d * sc_j``, ``dmin * m_j``), fp32 ``[B, 8]``."""
    d = b[:, 0:2].contiguous().view(torch.float16).float()  # [B, 1]
    dmin = b[:, 2:4].contiguous().view(torch.float16).float()
    s = b[:, 4:16].long()
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], dim=-1)  # [B, 8]
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=-1)
    return d * sc, dmin * mn


def quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` → Q4_K super-blocks, uint8 ``[N, ns, 144]``."""
    head, q = quantize_super_blocks(w, nmax=15, rmin=-1.0, nstep=20)
    q = q.reshape(-1, 4, 2, SUB)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)  # [B, 128]
    return torch.cat([head, qs], dim=-1).reshape(w.shape[0], -1, Q4_K_BYTES).contiguous()


def dequantize_q4_k(blocks: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Q4_K super-blocks uint8 ``[N, ns, 144]`` → fp32 ``[N, K]`` (``K`` defaults to ``ns * 256``)."""
    if blocks.dim() != 3 or blocks.shape[-1] != Q4_K_BYTES or blocks.dtype != torch.uint8:
        raise FreeTokenError(f"Q4_K blocks must be uint8 [N, ns, {Q4_K_BYTES}], got {tuple(blocks.shape)}")
    n, ns, _ = blocks.shape
    b = blocks.reshape(-1, Q4_K_BYTES)
    dsc, dm = super_block_scales(b)  # [B, 8]
    qs = b[:, 16:].reshape(-1, 4, 1, SUB)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, SUB).float()  # [B, 8, 32]
    vals = dsc[..., None] * q - dm[..., None]
    return vals.reshape(n, ns * SUPER)[:, : ns * SUPER if k is None else k].contiguous()
