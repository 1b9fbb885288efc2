"""Q6_K: GGUF's 6-bit k-quant, byte for byte (quantize and dequantize).

Legend: ``N`` rows, ``K`` columns, ``S`` = 256 values per super-block, ``ns = ceil(K / S)`` super-blocks per row,
16 sub-blocks of 16 values per super-block.

A super-block is 210 bytes, as GGUF stores ``block_q6_K``:

- ``ql[128]``: low 4 bits of the codes. In half ``n`` (values ``128n .. 128n + 127``), byte ``64n + l`` (l < 32) holds
  value ``128n + l`` in its low nibble and ``128n + 64 + l`` in its high one; byte ``64n + 32 + l`` holds
  ``128n + 32 + l`` (low) and ``128n + 96 + l`` (high);
- ``qh[64]``: high 2 bits; byte ``32n + l`` holds those of values ``128n + 32k + l`` in bits ``2k, 2k + 1``;
- ``scales[16]``: int8, one per 16 values (value ``v`` uses ``scales[v // 16]``);
- ``d`` fp16.

Value ``v`` = ``d * scales[v // 16] * (q_v - 32)``, ``q_v`` the 6-bit code (0..63).

The quantizer follows ggml's reference (``quantize_row_q6_K_ref``): per sub-block ``make_qx_quants(16, 32, rmse
type 1)`` (a weighted least-squares search over 19 candidate scales, weights ``x²``), the 16 scales quantized to
int8 against the one of largest magnitude (``d = max / -128``), then the codes recomputed for the rounded scales.
Rows whose ``K`` is not a multiple of 256 are zero-padded (valid for us, not for a GGUF file).
"""

from __future__ import annotations

import torch

from ..errors import FreeTokenError

SUPER = 256
SUB = 16
Q6_K_BYTES = 210


def _round(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)  # half to even, like ggml's nearest_int


def _sub_scales(x: torch.Tensor) -> torch.Tensor:
    """Per sub-block ``x [B, 16]`` → the signed scale ``[B]`` with ``x ≈ scale * q``, ``q`` in -32..31.

    ggml's ``make_qx_quants(16, nmax=32, rmse_type=1)``: the first grid puts the value of largest magnitude at
    ``-32``; then 19 grids ``-(32 + 0.1 i) / max`` (i = -9..9) are scored by ``(Σ w x q)² / Σ w q²`` (w = x²) and
    the best one's least-squares scale returned.
    """
    nmax = 32.0
    amax, pos = x.abs().max(-1)  # [B]
    mx = x.gather(-1, pos[:, None]).squeeze(-1)  # the signed value of largest magnitude
    empty = amax < 1e-15  # ggml's GROUP_MAX_EPS
    safe_max = torch.where(empty, torch.ones_like(mx), mx)
    w = x * x

    def fit(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = _round(iscale[:, None] * x).clamp_(-nmax, nmax - 1)
        return (w * x * q).sum(-1), (w * q * q).sum(-1)

    sum_lx, sum_l2 = fit(-nmax / safe_max)
    scale = torch.where(sum_l2 > 0, sum_lx / sum_l2.clamp_min(1e-30), torch.zeros_like(sum_lx))
    best = scale * sum_lx
    for i in range(-9, 10):
        slx, sl2 = fit(-(nmax + 0.1 * i) / safe_max)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        this = slx / sl2.clamp_min(1e-30)
        scale = torch.where(better, this, scale)
        best = torch.where(better, this * slx, best)
    return torch.where(empty, torch.zeros_like(scale), scale)


def quantize_q6_k(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` → Q6_K super-blocks, uint8 ``[N, ns, 210]``."""
    if w.dim() != 2:
        raise FreeTokenError(f"quantize expects a 2-D weight, got shape {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise FreeTokenError("cannot quantize a weight that holds inf or nan")
    n, k = w.shape
    ns = -(-k // SUPER)
    x = torch.nn.functional.pad(w.float(), (0, ns * SUPER - k)).reshape(n * ns, 16, SUB)  # [B, 16, 16]
    scales = _sub_scales(x.reshape(-1, SUB)).reshape(-1, 16)  # [B, 16]
    pos = scales.abs().argmax(-1, keepdim=True)
    max_scale = scales.gather(-1, pos).squeeze(-1)  # [B] signed
    flat = max_scale.abs() < 1e-15
    iscale = torch.where(flat, torch.zeros_like(max_scale), -128.0 / torch.where(flat, torch.ones_like(max_scale),
                                                                                    max_scale))
    d = torch.where(flat, torch.zeros_like(iscale), 1.0 / torch.where(flat, torch.ones_like(iscale), iscale))
    d = d.to(torch.float16)
    ls = _round(iscale[:, None] * scales).clamp_(max=127)  # [B, 16] int8 (≥ -128 by construction)
    sub_d = d.float()[:, None] * ls  # [B, 16] the scales the decoder will use
    safe = torch.where(sub_d != 0, sub_d, torch.ones_like(sub_d))
    q = _round(x / safe[..., None]).clamp_(-32, 31) + 32
    q = torch.where(sub_d[..., None] != 0, q, torch.full_like(q, 32.0)).to(torch.uint8).reshape(-1, 2, 4, 32)
    # q [B, n, k, l] = code of value 128n + 32k + l
    lo, hi = q & 0x0F, q >> 4
    ql = torch.stack([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], dim=2)  # [B, 2, 2, 32]
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [B, 2, 32]
    head = ls.to(torch.int8).view(torch.uint8)
    tail = d[:, None].contiguous().view(torch.uint8)  # [B, 2]
    out = torch.cat([ql.reshape(-1, 128), qh.reshape(-1, 64), head, tail], dim=-1)
    return out.reshape(n, ns, Q6_K_BYTES).contiguous()


def dequantize_q6_k(blocks: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Q6_K super-blocks uint8 ``[N, ns, 210]`` → fp32 ``[N, K]`` (``K`` defaults to ``ns * 256``)."""
    if blocks.dim() != 3 or blocks.shape[-1] != Q6_K_BYTES or blocks.dtype != torch.uint8:
        raise FreeTokenError(f"Q6_K blocks must be uint8 [N, ns, {Q6_K_BYTES}], got {tuple(blocks.shape)}")
    n, ns, _ = blocks.shape
    b = blocks.reshape(-1, Q6_K_BYTES)
    ql = b[:, :128].reshape(-1, 2, 2, 32)  # [B, n, j, l]: byte 64n + 32j + l
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)  # [B, n, 1, l]
    sc = b[:, 192:208].contiguous().view(torch.int8).float()  # [B, 16]
    d = b[:, 208:210].contiguous().view(torch.float16).float()  # [B, 1]
    lo = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # [B, n, k, l]: k = 0..3 → values 128n + 32k + l
    hi = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3  # [B, n, k, l]
    q = (lo | (hi << 4)).float() - 32.0
    vals = (d * sc)[:, :, None] * q.reshape(-1, 16, SUB)  # [B, 16, 16]
    return vals.reshape(n, ns * SUPER)[:, : ns * SUPER if k is None else k].contiguous()
