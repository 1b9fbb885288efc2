"""Triton grouped MoE GEMM over experts held in slots, and a full MoE step built from it.

Legend: ``T`` tokens, ``K`` experts per token (``top_k``), ``P = T * K`` (token, expert) pairs, ``S`` slots,
``N`` output rows of a projection, ``C`` its reduction dim, ``BM`` rows per program.

The fast tier holds quantized experts in ``S`` equal slots: ``codes [S, N, C or C/2]`` and ``scales [S, N, C/32]``
(``TritonQuantExperts``, layout as in ``dequant_gemm``). Pairs are sorted by slot and each slot's run is padded to
a multiple of ``BM`` (``align_by_slot``), so every program multiplies ``BM`` rows by one slot's weight; padding
rows carry the sentinel ``P`` and are neither read nor written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import FreeTokenError
from ...quant.blocks import BLOCK, quantize
from .dequant_gemm import TritonQuantWeight, _kernels, reference_dequantize


@dataclass(frozen=True)
class TritonQuantExperts:
    """One projection of ``S`` slotted experts: ``codes [S, N, ...]``, fp16 ``scales [S, N, C/32]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int
    is_q4: bool

    @classmethod
    def from_float(cls, w: torch.Tensor, fmt: str, device: torch.device | str | None = None) -> TritonQuantExperts:
        """Quantize ``w [S, N, C]`` (C a multiple of 32) into slots."""
        s, n, c = w.shape
        if c % BLOCK:
            raise FreeTokenError(f"the Triton kernels need the reduction dim to be a multiple of {BLOCK}, got {c}")
        qw = TritonQuantWeight.from_blocks(quantize(w.reshape(s * n, c), fmt), device)
        return cls(qw.codes.reshape(s, n, -1), qw.scales.reshape(s, n, -1), n, c, qw.is_q4)

    def slot(self, i: int) -> TritonQuantWeight:
        return TritonQuantWeight(self.codes[i], self.scales[i], self.n, self.k, self.is_q4)

    @property
    def num_slots(self) -> int:
        return self.codes.shape[0]


def align_by_slot(pair_slot: torch.Tensor, num_slots: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pair_slot [P]`` → (``sorted_pair [nblocks * BM]`` padded with ``P``, ``block_slot [nblocks]``)."""
    p = pair_slot.numel()
    flat = pair_slot.reshape(-1).to(torch.int64)
    if p and (int(flat.min()) < 0 or int(flat.max()) >= num_slots):
        raise FreeTokenError(f"slot ids must be in [0, {num_slots}), got {int(flat.min())}..{int(flat.max())}")
    counts = torch.bincount(flat, minlength=num_slots)  # [S]
    padded = (counts + block_m - 1) // block_m * block_m  # [S]
    order = torch.argsort(flat, stable=True)  # [P] pairs grouped by slot
    starts = torch.cumsum(padded, 0) - padded  # [S] first padded row of each slot
    first_sorted = torch.cumsum(counts, 0) - counts  # [S] first sorted position of each slot
    rank = torch.arange(p, device=flat.device) - first_sorted[flat[order]]
    sorted_pair = torch.full((int(padded.sum()),), p, dtype=torch.int64, device=flat.device)
    sorted_pair[starts[flat[order]] + rank] = order
    block_slot = torch.repeat_interleave(torch.arange(num_slots, device=flat.device), padded // block_m)
    return sorted_pair, block_slot.to(torch.int64)


def grouped_matmul(
    x: torch.Tensor, experts: TritonQuantExperts, pair_slot: torch.Tensor, token_div: int,
    block_m: int = 16, block_n: int = 32, block_k: int = 32,
) -> torch.Tensor:  # fmt: skip
    """``y [P, N]``: pair ``p`` uses row ``p // token_div`` of ``x [*, C]`` and the expert in slot ``pair_slot[p]``."""
    p = pair_slot.numel()
    if x.dim() != 2 or x.shape[1] != experts.k or x.stride(1) != 1:
        raise FreeTokenError(
            f"grouped_matmul: x must be [rows, {experts.k}] with unit last stride, got {tuple(x.shape)}"
        )
    if p and (p - 1) // token_div >= x.shape[0]:
        raise FreeTokenError(f"grouped_matmul: {p} pairs / {token_div} per row need {-(-p // token_div)} rows of x")
    if x.device != experts.codes.device:
        raise FreeTokenError(f"grouped_matmul: x is on {x.device} but the experts are on {experts.codes.device}")
    sorted_pair, block_slot = align_by_slot(pair_slot, experts.num_slots, block_m)
    y = torch.zeros(p, experts.n, dtype=torch.float32, device=x.device)
    if p == 0:
        return y
    grid = (block_slot.numel(), -(-experts.n // block_n))
    _kernels().grouped_gemm[grid](
        x, experts.codes, experts.scales, y, sorted_pair, block_slot, p, token_div, experts.n, experts.k,
        x.stride(0), y.stride(0), experts.codes.stride(0), experts.scales.stride(0),
        IS_Q4=experts.is_q4, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, LAYOUT=0, IEEE=False,
    )  # fmt: skip
    return y


def moe_forward(
    x: torch.Tensor, w13: TritonQuantExperts, w2: TritonQuantExperts, topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """One MoE step on slotted experts: ``x [T, D]``, ``topk_slots/weights [T, K]`` → ``[T, D]`` fp32."""
    t, k = topk_slots.shape
    i = w2.k
    h = grouped_matmul(x, w13, topk_slots.reshape(-1), token_div=k)  # [P, 2I]
    a = (F.silu(h[:, :i]) * h[:, i:]).contiguous()  # [P, I]
    y = grouped_matmul(a, w2, topk_slots.reshape(-1), token_div=1)  # [P, D]
    return (y.view(t, k, -1) * topk_weights.float()[..., None]).sum(1)


def reference_moe_forward(
    x: torch.Tensor, w13: TritonQuantExperts, w2: TritonQuantExperts, topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The same step in plain torch over dequantized slots."""
    out = torch.zeros(x.shape[0], w2.n, dtype=torch.float32, device=x.device)
    i = w2.k
    for s in topk_slots.unique().tolist():
        tok, kk = (topk_slots == s).nonzero(as_tuple=True)
        h = x[tok].float() @ reference_dequantize(w13.slot(s)).T
        y = (F.silu(h[:, :i]) * h[:, i:]) @ reference_dequantize(w2.slot(s)).T
        out.index_add_(0, tok, y * topk_weights[tok, kk, None].float())
    return out


SLOT_FORMATS = ("q4_0", "q8_0")
"""Block formats the slot kernels read as a pool stores them."""
GEMV_MAX_PAIRS = 32
"""Up to this many (token, expert) pairs ``slots_matmul`` runs one program per pair (no sort, no host read)."""


@dataclass(frozen=True)
class SlotWeights:
    """One projection of the experts in a slot pool, read where and as the pool keeps them.

    ``data [S, bytes]`` uint8 (a view of the pool: any row stride, unit column stride); slot ``s`` holds an
    ``[n, k]`` matrix from its first byte: GGUF Q8_0 / Q4_0 blocks ``[n, k/32, P]``, or the C kernels' tiles of 8 rows
    (``packed``; ``runtime/kernels/layout.py``), so a GPU slot is computed from the bytes the host slot holds.
    """

    data: torch.Tensor
    n: int
    k: int
    fmt: str
    packed: bool

    def __post_init__(self) -> None:
        if self.fmt not in SLOT_FORMATS:
            raise FreeTokenError(f"the slot kernels read {', '.join(SLOT_FORMATS)}, not {self.fmt!r}")
        if self.k % BLOCK:
            raise FreeTokenError(f"the slot kernels need k to be a multiple of {BLOCK}, got {self.k}")
        rows = -(-self.n // 8) * 8 if self.packed else self.n
        need = rows * (self.k // BLOCK) * (18 if self.fmt == "q4_0" else 34)
        d = self.data
        if d.dtype != torch.uint8 or d.dim() != 2 or d.shape[1] < need or (d.shape[1] > 1 and d.stride(1) != 1):
            raise FreeTokenError(
                f"slot weights must be uint8 [slots, >= {need}] with unit column stride, got {d.dtype} {tuple(d.shape)}"
            )

    @property
    def layout(self) -> int:
        return 2 if self.packed else 1


def slots_matmul(
    x: torch.Tensor, w: SlotWeights, pair_row: torch.Tensor, pair_slot: torch.Tensor,
    gemv_max: int = GEMV_MAX_PAIRS,
) -> torch.Tensor:  # fmt: skip
    """``y [P, n]`` fp32: pair ``p`` multiplies row ``pair_row[p]`` of ``x [*, k]`` by the matrix in slot
    ``pair_slot[p]``. Up to ``gemv_max`` pairs: one program per pair and block of rows, fp32 FMAs; more: pairs
    grouped by slot (a host read to size the grid) through ``tl.dot`` at IEEE fp32 precision."""
    p = pair_slot.numel()
    if x.dim() != 2 or x.shape[1] != w.k or x.stride(1) != 1:
        raise FreeTokenError(f"slots_matmul: x must be [rows, {w.k}] with unit last stride, got {tuple(x.shape)}")
    if pair_row.shape != pair_slot.shape or pair_row.dim() != 1:
        raise FreeTokenError("slots_matmul: pair_row and pair_slot must be 1-D and of one length")
    if x.device != w.data.device or pair_slot.device != x.device or pair_row.device != x.device:
        raise FreeTokenError(f"slots_matmul: x, pairs and weights must share a device (x on {x.device}, "
                             f"weights on {w.data.device})")
    is_q4 = w.fmt == "q4_0"
    if p <= gemv_max:
        y = torch.empty(p, w.n, dtype=torch.float32, device=x.device)
        if p:
            block_n, block_k = 32, 128
            _kernels().pairs_gemv[(p, -(-w.n // block_n))](
                x, w.data, y, pair_row, pair_slot, w.n, w.k, x.stride(0), y.stride(0), w.data.stride(0),
                IS_Q4=is_q4, BLOCK_N=block_n, BLOCK_K=block_k, LAYOUT=w.layout,
            )  # fmt: skip
        return y
    block_m, block_n, block_k = 16, 64, 32
    rows = x[pair_row].float().contiguous()  # [P, k]: the kernel reads row p for pair p
    sorted_pair, block_slot = align_by_slot(pair_slot, w.data.shape[0], block_m)
    y = torch.zeros(p, w.n, dtype=torch.float32, device=x.device)
    grid = (block_slot.numel(), -(-w.n // block_n))
    _kernels().grouped_gemm[grid](
        rows, w.data, w.data, y, sorted_pair, block_slot, p, 1, w.n, w.k,
        rows.stride(0), y.stride(0), w.data.stride(0), w.data.stride(0),
        IS_Q4=is_q4, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, LAYOUT=w.layout, IEEE=True,
    )  # fmt: skip
    return y
