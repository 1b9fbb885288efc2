"""Triton dequant-GEMM and grouped MoE GEMM against their plain-torch references, under TRITON_INTERPRET=1 at
tiny shapes (on the CPU; on a CUDA machine the same tests run the compiled kernels)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # a CUDA machine runs the compiled kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
try:
    import triton  # noqa: F401

    _reason = ""
except ImportError as exc:  # pragma: no cover - triton is a declared (gpu extra) dependency
    _reason = f"triton cannot be imported: {exc}"

pytestmark = pytest.mark.skipif(bool(_reason), reason=_reason or "ok")

from freetoken_agent.runtime.errors import FreeTokenError  # noqa: E402
from freetoken_agent.runtime.kernels.triton import (  # noqa: E402
    TritonQuantExperts,
    TritonQuantWeight,
    align_by_slot,
    dequant_matmul,
    grouped_matmul,
    moe_forward,
    reference_matmul,
    reference_moe_forward,
)
from freetoken_agent.runtime.quant import quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu() - b.cpu()).norm() / b.cpu().norm())


@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("m", [1, 3, 20])  # 1, 3: split-K GEMV; 20: tiled GEMM (fp16 tensor-core inputs)
def test_dequant_matmul_matches_reference(fmt: str, m: int) -> None:
    n, k = 40, 96  # N not a multiple of the row block, K not a multiple of the K block
    q = quantize(torch.randn(n, k), fmt)
    w = TritonQuantWeight.from_blocks(q, DEVICE)
    assert torch.equal(w.dequantize().cpu(), q.dequantize())
    x = torch.randn(m, k, device=DEVICE)
    y = dequant_matmul(x, w)
    assert y.shape == (m, n)
    assert _rel(y, reference_matmul(x, w)) < (1e-5 if m <= 8 else 2e-3)


def test_split_k_partial_sums_add_up() -> None:
    w = TritonQuantWeight.from_blocks(quantize(torch.randn(32, 512), "q4"), DEVICE)
    x = torch.randn(2, 512, device=DEVICE)
    one = dequant_matmul(x, w, split_k=1)
    four = dequant_matmul(x, w, split_k=4)
    assert _rel(four, one) < 1e-5 and _rel(one, reference_matmul(x, w)) < 1e-5


def test_align_by_slot_pads_each_slot_to_whole_blocks() -> None:
    slots = torch.tensor([2, 0, 2, 2, 1, 0, 2])
    sorted_pair, block_slot = align_by_slot(slots, num_slots=4, block_m=2)
    assert block_slot.tolist() == [0, 1, 2, 2]  # slot 3 has no pairs: no blocks
    blocks = sorted_pair.view(-1, 2).tolist()
    assert sorted(blocks[0]) == [1, 5] and blocks[1] == [4, 7] and sorted(blocks[2] + blocks[3]) == [0, 2, 3, 6]
    with pytest.raises(FreeTokenError, match="slot ids"):
        align_by_slot(torch.tensor([0, 5]), num_slots=4, block_m=2)


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_grouped_matmul_uses_each_pairs_slot(fmt: str) -> None:
    experts = TritonQuantExperts.from_float(torch.randn(3, 48, 64), fmt, DEVICE)
    x = torch.randn(5, 64, device=DEVICE)
    pair_slot = torch.tensor([2, 0, 1, 2, 2, 0, 1, 1, 0, 2], device=DEVICE)  # 5 tokens x top-2
    y = grouped_matmul(x, experts, pair_slot, token_div=2)
    for p, s in enumerate(pair_slot.tolist()):
        ref = reference_matmul(x[p // 2 : p // 2 + 1], experts.slot(s))
        assert _rel(y[p : p + 1], ref) < 2e-3


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_moe_forward_matches_reference(fmt: str) -> None:
    w13 = TritonQuantExperts.from_float(torch.randn(4, 64, 64) / 8, fmt, DEVICE)  # [S, 2I, D], I = 32
    w2 = TritonQuantExperts.from_float(torch.randn(4, 64, 32) / 6, fmt, DEVICE)  # [S, D, I]
    x = torch.randn(6, 64, device=DEVICE)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(6)]).to(DEVICE)
    wts = torch.softmax(torch.randn(6, 2), -1).to(DEVICE)
    assert _rel(moe_forward(x, w13, w2, ids, wts), reference_moe_forward(x, w13, w2, ids, wts)) < 3e-3


def test_launchers_check_shapes() -> None:
    w = TritonQuantWeight.from_blocks(quantize(torch.randn(8, 64), "q8"), DEVICE)
    with pytest.raises(FreeTokenError, match="x must be"):
        dequant_matmul(torch.randn(2, 63, device=DEVICE), w)
    with pytest.raises(FreeTokenError, match="multiple of 32"):
        TritonQuantWeight.from_blocks(quantize(torch.randn(8, 40), "q8"))
    experts = TritonQuantExperts.from_float(torch.randn(2, 8, 32), "q4", DEVICE)
    with pytest.raises(FreeTokenError, match="need 3 rows"):
        grouped_matmul(torch.randn(2, 32, device=DEVICE), experts, torch.zeros(6, dtype=torch.long), token_div=2)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("pairs", [3, 37])  # 3: one program per pair (GEMV); 37: grouped by slot (tl.dot, IEEE fp32)
def test_slot_kernels_read_a_pools_own_bytes(fmt: str, packed: bool, pairs: int) -> None:
    """Slots of a pool-like uint8 tensor (rows wider than a matrix, the matrix at an offset) in GGUF blocks or the C
    kernels' tiles (44 rows: the last tile padded), against fp32 matmuls over the dequantized slots."""
    from freetoken_agent.runtime.kernels.triton import SlotWeights, slots_matmul
    from freetoken_agent.runtime.quant.formats import block_format

    f = block_format(fmt)
    s, n, k = 3, 44, 96
    blocks = torch.stack([f.quantize_rows(torch.randn(n, k)) for _ in range(s)])
    raw = f.storage(blocks, packed)  # [S, bytes]
    pool = torch.zeros(s, raw.shape[1] + 48, dtype=torch.uint8)
    pool[:, 16 : 16 + raw.shape[1]] = raw
    w = SlotWeights(pool[:, 16 : 16 + raw.shape[1]].to(DEVICE), n, k, fmt, packed)
    deq = torch.stack([f.dequantize(raw[i], n, k, packed) for i in range(s)])
    x = torch.randn(5, k)
    rows, slots = torch.randint(0, 5, (pairs,)), torch.randint(0, s, (pairs,))
    y = slots_matmul(x.to(DEVICE), w, rows.to(DEVICE), slots.to(DEVICE))
    want = torch.einsum("pk,pnk->pn", x[rows], deq[slots])
    assert y.shape == (pairs, n)
    assert float((y.cpu() - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_slot_kernels_check_their_inputs() -> None:
    from freetoken_agent.runtime.kernels.triton import SlotWeights, slots_matmul

    with pytest.raises(FreeTokenError, match="not 'q4_k'"):
        SlotWeights(torch.zeros(2, 4096, dtype=torch.uint8), 8, 256, "q4_k", False)
    with pytest.raises(FreeTokenError, match=r"uint8 \[slots, >= 576\]"):
        SlotWeights(torch.zeros(2, 100, dtype=torch.uint8), 8, 128, "q4_0", False)  # 8 rows x 4 blocks x 18 bytes
    w = SlotWeights(torch.zeros(2, 576, dtype=torch.uint8, device=DEVICE), 8, 128, "q4_0", False)
    with pytest.raises(FreeTokenError, match=r"x must be \[rows, 128\]"):
        one = torch.zeros(1, dtype=torch.long)
        slots_matmul(torch.zeros(2, 64, device=DEVICE), w, one, one)
    with pytest.raises(FreeTokenError, match="one length"):
        slots_matmul(torch.zeros(2, 128, device=DEVICE), w, torch.zeros(2, dtype=torch.long, device=DEVICE),
                     torch.zeros(1, dtype=torch.long, device=DEVICE))
