"""Q5_K (GGUF k-quant super-blocks): byte layout, bitwise agreement with the ``gguf`` package's dequantizer, the
round-trip error of our quantizer, and agreement with ggml's own quantizer."""

from __future__ import annotations

import pytest
import torch
from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.quant.q4k import dequantize_q4_k, quantize_q4_k
from freetoken_agent.runtime.quant.q5k import Q5_K_BYTES, dequantize_q5_k, quantize_q5_k

from tests.runtime.quant.ggml import ggml_quantize

SC = [1, 17, 33, 63, 5, 20, 40, 62]  # 6-bit scales and mins whose top bits live in the packed high bits
MN = [0, 63, 2, 31, 16, 47, 1, 60]


def _block(d: float, dmin: float, codes: torch.Tensor) -> torch.Tensor:
    """One super-block packed by hand from ggml's ``dequantize_row_q5_K`` (``codes`` [8, 32] in 0..31)."""
    s = [0] * 12
    for j in range(4):
        s[j] = SC[j] | ((SC[j + 4] >> 4) << 6)
        s[j + 4] = MN[j] | ((MN[j + 4] >> 4) << 6)
        s[j + 8] = (SC[j + 4] & 0x0F) | ((MN[j + 4] & 0x0F) << 4)
    head = torch.tensor([d, dmin], dtype=torch.float16).view(torch.uint8)
    qh = torch.zeros(32, dtype=torch.long)
    qs = torch.zeros(128, dtype=torch.long)
    for c in range(4):  # ggml walks 64 values at a time: qs bytes 32c + l, qh bits 2c (low half) and 2c + 1 (high)
        for l in range(32):
            lo, hi = int(codes[2 * c, l]), int(codes[2 * c + 1, l])
            qs[32 * c + l] = (lo & 15) | ((hi & 15) << 4)
            qh[l] |= ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1))
    body = torch.cat([torch.tensor(s), qh, qs]).to(torch.uint8)
    return torch.cat([head, body]).reshape(1, 1, Q5_K_BYTES)


def _random_blocks(n: int, ns: int, seed: int) -> torch.Tensor:
    """Random super-blocks ``[n, ns, 176]`` whose fp16 ``d`` and ``dmin`` are finite."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, ns, Q5_K_BYTES), dtype=torch.uint8, generator=gen)
    head = ((torch.rand(n, ns, 2, generator=gen) * 2 - 1) * 0.1).to(torch.float16)
    raw[..., :4] = head.view(torch.uint8).reshape(n, ns, 4)
    return raw


def test_dequantize_follows_the_layout() -> None:
    codes = torch.randint(0, 32, (8, 32), generator=torch.Generator().manual_seed(1))
    out = dequantize_q5_k(_block(0.5, 0.25, codes))
    want = torch.cat([0.5 * SC[j] * codes[j].float() - 0.25 * MN[j] for j in range(8)])
    assert torch.equal(out[0], want)


def test_dequantize_equals_gguf_py_bitwise() -> None:
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    blocks = _random_blocks(40, 3, seed=2)
    ref = torch.from_numpy(quants.dequantize(blocks.reshape(40, -1).numpy(), GGMLQuantizationType.Q5_K))
    assert torch.equal(dequantize_q5_k(blocks), ref)
    assert torch.equal(dequantize_q5_k(blocks, 700), ref[:, :700])
    w = torch.randn(12, 512)  # and what our quantizer writes
    blocks = quantize_q5_k(w)
    ref = quants.dequantize(blocks.reshape(12, -1).numpy(), GGMLQuantizationType.Q5_K)
    assert torch.equal(dequantize_q5_k(blocks), torch.from_numpy(ref))


@pytest.mark.parametrize("shape", [(16, 512), (5, 300)])
def test_round_trip_error_beats_q4_k(shape: tuple[int, int]) -> None:
    w = torch.randn(shape)
    blocks = quantize_q5_k(w)
    assert blocks.shape == (shape[0], -(-shape[1] // 256), Q5_K_BYTES) and blocks.dtype == torch.uint8
    back = dequantize_q5_k(blocks, shape[1])
    rel = float((back - w).norm() / w.norm())
    rel_q4_k = float((dequantize_q4_k(quantize_q4_k(w), shape[1]) - w).norm() / w.norm())
    assert rel <= 0.04 and rel < rel_q4_k * 0.6  # Gaussian weights: ~0.036 (ggml's quantizer: the same), Q4_K ~0.072
    assert float((back - w).abs().max()) < 0.25  # no value falls off its sub-block's grid


def test_special_rows() -> None:
    w = torch.zeros(3, 256)
    w[1] = -0.75  # constant negative: the min alone represents it
    w[2, :32] = torch.linspace(0, 1, 32)  # one busy sub-block, seven empty ones
    back = dequantize_q5_k(quantize_q5_k(w))
    assert torch.equal(back[0], w[0])
    assert float((back[1] - w[1]).abs().max()) < 1e-3
    assert float((back[2] - w[2]).abs().max()) < 0.02 and torch.equal(back[2, 32:], w[2, 32:])


def test_bad_input_is_one_clear_error() -> None:
    with pytest.raises(FreeTokenError, match="2-D"):
        quantize_q5_k(torch.randn(256))
    with pytest.raises(FreeTokenError, match="nan"):
        quantize_q5_k(torch.full((1, 256), float("nan")))
    with pytest.raises(FreeTokenError, match=r"uint8 \[N, ns, 176\]"):
        dequantize_q5_k(torch.zeros(1, 1, 144, dtype=torch.uint8))


def test_matches_ggml_quantizer() -> None:
    w = torch.randn(32, 1024)
    theirs = ggml_quantize(w, "q5_k", Q5_K_BYTES, 256)
    ours = quantize_q5_k(w)
    same = (ours == theirs).all(-1)
    err = lambda b: float((dequantize_q5_k(b) - w).norm() / w.norm())
    # byte-identical super-blocks (~85%); the rest differ in a sub-block's fitted scale or min (fp32 summation order
    # in the fit picks another of two near-equal candidates), and where the head agrees the codes do too
    assert float(same.float().mean()) >= 0.7
    assert torch.equal(same, (ours[..., :16] == theirs[..., :16]).all(-1))
    assert err(ours) <= 1.01 * err(theirs)
