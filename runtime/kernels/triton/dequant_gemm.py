"""Triton dequant-GEMM for Q8_0 / Q4_0 weights: ``y [M, N] = x [M, K] @ dequant(W [N, K])^T``.

Legend: ``M`` tokens, ``N`` weight rows, ``K`` reduction dim (a multiple of 32), ``G = K / 32`` scale groups.

GPU weight layout (``TritonQuantWeight``), split from GGUF blocks so both loads are plain strided reads:
- ``codes``: q8 int8 ``[N, K]``; q4 uint8 ``[N, K / 2]`` in GGUF order (within each group of 32 values, byte ``j``
  holds value ``j`` in its low nibble and value ``j + 16`` in its high nibble);
- ``scales``: fp16 ``[N, G]``; value = ``scale * code`` (q8) or ``scale * (nibble - 8)`` (q4).

Two kernels share one dequantizing load: a split-K GEMV for small ``M`` (decode: each program reduces one K slice
of a block of rows for one token and adds its partial sums atomically) and a tiled GEMM (``tl.dot``) for large ``M``.
Imports ``triton`` lazily: importing this module never needs a GPU or triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import FreeTokenError
from ...quant.blocks import BLOCK, BlockQuantized
from ...quant.blocks import dequantize as dequantize_blocks

GEMV_MAX_M = 8


@dataclass(frozen=True)
class TritonQuantWeight:
    """A ``[N, K]`` weight as ``codes`` + fp16 ``scales`` (see the module docstring); ``is_q4`` picks the format."""

    codes: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int
    is_q4: bool

    @classmethod
    def from_blocks(cls, qw: BlockQuantized, device: torch.device | str | None = None) -> TritonQuantWeight:
        n, k = qw.shape
        if k % BLOCK:
            raise FreeTokenError(f"the Triton kernels need K to be a multiple of {BLOCK}, got {k}")
        scales = qw.blocks[..., :2].contiguous().view(torch.float16).reshape(n, k // BLOCK)
        codes = qw.blocks[..., 2:].reshape(n, -1)
        if qw.fmt == "q8_0":
            codes = codes.contiguous().view(torch.int8)
        return cls(codes.contiguous().to(device), scales.contiguous().to(device), n, k, qw.fmt == "q4_0")

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[N, K]`` on the weight's device: the values both kernels must reproduce."""
        return reference_dequantize(self)


def reference_dequantize(w: TritonQuantWeight) -> torch.Tensor:
    """Plain-torch dequantize of the split layout (the kernels' reference)."""
    fmt = "q4_0" if w.is_q4 else "q8_0"
    g = w.k // BLOCK
    body = w.codes.view(torch.uint8).reshape(w.n, g, -1).cpu()
    scale_bytes = w.scales.contiguous().view(torch.uint8).reshape(w.n, g, 2).cpu()
    blocks = torch.cat([scale_bytes, body], dim=-1)
    return dequantize_blocks(BlockQuantized(fmt, (w.n, w.k), blocks)).to(w.codes.device)


def reference_matmul(x: torch.Tensor, w: TritonQuantWeight) -> torch.Tensor:
    """``x @ dequant(W)^T`` in fp32 with plain torch."""
    return x.float() @ reference_dequantize(w).T


def _kernels() -> Any:
    from . import jit_kernels  # imports triton: only when a kernel actually runs

    return jit_kernels


def check_inputs(x: torch.Tensor, w: TritonQuantWeight) -> None:
    """Shape/dtype/stride checks with one clear message each (shared by the launchers)."""
    if x.dim() != 2 or x.shape[1] != w.k:
        raise FreeTokenError(f"dequant_matmul: x must be [M, {w.k}], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        raise FreeTokenError("dequant_matmul: x must be contiguous in its last dim")
    if x.device != w.codes.device:
        raise FreeTokenError(f"dequant_matmul: x is on {x.device} but the weight is on {w.codes.device}")
    if w.k % BLOCK or tuple(w.scales.shape) != (w.n, w.k // BLOCK):
        raise FreeTokenError(f"dequant_matmul: scales must be [{w.n}, {w.k // BLOCK}], got {tuple(w.scales.shape)}")
    want = (w.n, w.k // 2) if w.is_q4 else (w.n, w.k)
    if tuple(w.codes.shape) != want or not w.codes.is_contiguous() or not w.scales.is_contiguous():
        raise FreeTokenError(f"dequant_matmul: codes must be contiguous {want}, got {tuple(w.codes.shape)}")


def dequant_matmul(x: torch.Tensor, w: TritonQuantWeight, split_k: int | None = None) -> torch.Tensor:
    """``x [M, K]`` (fp16/bf16/fp32) → fp32 ``[M, N]``; split-K GEMV for ``M <= 8``, tiled GEMM above."""
    check_inputs(x, w)
    k = _kernels()
    m = x.shape[0]
    if m <= GEMV_MAX_M:
        block_n, block_k = 32, 128
        splits = split_k or max(1, min(16, w.k // 512))
        k_per_split = -(-w.k // (splits * block_k)) * block_k
        splits = -(-w.k // k_per_split)
        y = torch.zeros(m, w.n, dtype=torch.float32, device=x.device)
        grid = (-(-w.n // block_n), splits, m)
        k.gemv_splitk[grid](x, w.codes, w.scales, y, m, w.n, w.k, x.stride(0), y.stride(0), k_per_split,
                        IS_Q4=w.is_q4, BLOCK_N=block_n, BLOCK_K=block_k)  # fmt: skip
        return y
    block_m, block_n, block_k = 32, 64, 64
    y = torch.empty(m, w.n, dtype=torch.float32, device=x.device)
    grid = (-(-m // block_m), -(-w.n // block_n))
    k.gemm_tiled[grid](x, w.codes, w.scales, y, m, w.n, w.k, x.stride(0), y.stride(0),
                    IS_Q4=w.is_q4, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)  # fmt: skip
    return y
