"""Q4_K (GGUF k-quant super-blocks): byte layout, round-trip error, and agreement with ggml's own quantizer."""

from __future__ import annotations

import pytest
import torch
from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.quant import dequantize, quantize
from freetoken_agent.runtime.quant.q4k import Q4_K_BYTES, dequantize_q4_k, quantize_q4_k

from tests.runtime.quant.ggml import ggml_quantize

SC = [1, 17, 33, 63, 5, 20, 40, 62]  # 6-bit scales and mins whose top bits live in the packed high bits
MN = [0, 63, 2, 31, 16, 47, 1, 60]


def _block(d: float, dmin: float, codes: torch.Tensor) -> torch.Tensor:
    """One super-block packed by hand from the GGUF description (``codes`` [8, 32] in 0..15)."""
    s = [0] * 12
    for j in range(4):
        s[j] = SC[j] | ((SC[j + 4] >> 4) << 6)
        s[j + 4] = MN[j] | ((MN[j + 4] >> 4) << 6)
        s[j + 8] = (SC[j + 4] & 0x0F) | ((MN[j + 4] & 0x0F) << 4)
    head = torch.tensor([d, dmin], dtype=torch.float16).view(torch.uint8)
    qs = torch.zeros(128, dtype=torch.uint8)
    for c in range(4):  # chunk c: low nibbles = sub-block 2c, high nibbles = sub-block 2c + 1
        qs[32 * c : 32 * c + 32] = codes[2 * c].to(torch.uint8) | (codes[2 * c + 1].to(torch.uint8) << 4)
    return torch.cat([head, torch.tensor(s, dtype=torch.uint8), qs]).reshape(1, 1, Q4_K_BYTES)


def test_dequantize_follows_the_layout() -> None:
    codes = torch.randint(0, 16, (8, 32), generator=torch.Generator().manual_seed(1))
    out = dequantize_q4_k(_block(0.5, 0.25, codes))
    want = torch.cat([0.5 * SC[j] * codes[j].float() - 0.25 * MN[j] for j in range(8)])
    assert torch.equal(out[0], want)


@pytest.mark.parametrize("shape", [(16, 512), (5, 300)])
def test_round_trip_error_beats_q4_0(shape: tuple[int, int]) -> None:
    w = torch.randn(shape)
    blocks = quantize_q4_k(w)
    assert blocks.shape == (shape[0], -(-shape[1] // 256), Q4_K_BYTES) and blocks.dtype == torch.uint8
    back = dequantize_q4_k(blocks, shape[1])
    rel = float((back - w).norm() / w.norm())
    rel_q4_0 = float((dequantize(quantize(w, "q4")) - w).norm() / w.norm())
    assert rel <= 0.075 and rel < rel_q4_0  # Gaussian weights: ~0.072 (ggml's quantizer: the same), Q4_0 ~0.083
    assert float((back - w).abs().max()) < 0.5  # no value falls off its sub-block's grid


def test_special_rows() -> None:
    w = torch.zeros(3, 256)
    w[1] = -0.75  # constant negative: the min alone represents it
    w[2, :32] = torch.linspace(0, 1, 32)  # one busy sub-block, seven empty ones
    back = dequantize_q4_k(quantize_q4_k(w))
    assert torch.equal(back[0], w[0])
    assert float((back[1] - w[1]).abs().max()) < 1e-3
    assert float((back[2] - w[2]).abs().max()) < 0.05 and torch.equal(back[2, 32:], w[2, 32:])


def test_bad_input_is_one_clear_error() -> None:
    with pytest.raises(FreeTokenError, match="2-D"):
        quantize_q4_k(torch.randn(256))
    with pytest.raises(FreeTokenError, match="nan"):
        quantize_q4_k(torch.full((1, 256), float("nan")))
    with pytest.raises(FreeTokenError, match="Q4_K blocks"):
        dequantize_q4_k(torch.zeros(1, 1, 18, dtype=torch.uint8))


def test_dequantize_equals_gguf_py() -> None:
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    w = torch.randn(8, 768)
    blocks = quantize_q4_k(w)
    theirs = quants.dequantize(blocks.reshape(8, -1).numpy(), GGMLQuantizationType.Q4_K)
    assert torch.equal(dequantize_q4_k(blocks), torch.from_numpy(theirs).float())


def test_matches_ggml_quantizer() -> None:
    w = torch.randn(32, 1024)
    theirs = ggml_quantize(w, "q4_k", Q4_K_BYTES, 256)
    ours = quantize_q4_k(w)
    same = float((ours == theirs).all(-1).float().mean())
    err = lambda b: float((dequantize_q4_k(b) - w).norm() / w.norm())
    assert same >= 0.9  # byte-identical super-blocks; the rest differ by fp32 summation order in the fit
    assert err(ours) <= 1.01 * err(theirs)
