"""Q6_K (GGUF k-quant super-blocks): byte layout, bitwise agreement with the ``gguf`` package's dequantizer, and the
round-trip error of our quantizer."""

from __future__ import annotations

import pytest
import torch
from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.quant import dequantize, quantize
from freetoken_agent.runtime.quant.q6k import Q6_K_BYTES, dequantize_q6_k, quantize_q6_k


def _random_blocks(n: int, ns: int, seed: int) -> torch.Tensor:
    """Random super-blocks ``[n, ns, 210]`` whose fp16 ``d`` is finite (random bits would often be inf or nan)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, ns, Q6_K_BYTES), dtype=torch.uint8, generator=gen)
    d = ((torch.rand(n, ns, generator=gen) * 2 - 1) * 0.1).to(torch.float16)
    raw[..., 208:] = d.view(torch.uint8).reshape(n, ns, 2)
    return raw


def test_dequantize_follows_the_layout() -> None:
    """One super-block packed by hand from ggml's ``dequantize_row_q6_K``: codes → ql / qh bytes."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 64, (256,), generator=gen)
    scales = torch.randint(-128, 128, (16,), generator=gen)
    ql = torch.zeros(128, dtype=torch.long)
    qh = torch.zeros(64, dtype=torch.long)
    for n in range(2):
        for l in range(32):
            q = [int(codes[128 * n + 32 * k + l]) for k in range(4)]
            ql[64 * n + l] = (q[0] & 15) | ((q[2] & 15) << 4)
            ql[64 * n + 32 + l] = (q[1] & 15) | ((q[3] & 15) << 4)
            qh[32 * n + l] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6)
    d = torch.tensor([0.125], dtype=torch.float16)
    block = torch.cat([ql.to(torch.uint8), qh.to(torch.uint8), scales.to(torch.int8).view(torch.uint8),
                       d.view(torch.uint8)]).reshape(1, 1, Q6_K_BYTES)
    want = 0.125 * scales.repeat_interleave(16).float() * (codes.float() - 32)
    assert torch.equal(dequantize_q6_k(block)[0], want)


def test_dequantize_equals_gguf_py_bitwise() -> None:
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    blocks = _random_blocks(40, 3, seed=1)
    ref = quants.dequantize(blocks.reshape(40, -1).numpy(), GGMLQuantizationType.Q6_K)
    assert torch.equal(dequantize_q6_k(blocks), torch.from_numpy(ref))
    assert torch.equal(dequantize_q6_k(blocks, 700), torch.from_numpy(ref)[:, :700])


def test_quantizer_writes_what_gguf_py_reads() -> None:
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    w = torch.randn(12, 512)
    blocks = quantize_q6_k(w)
    ref = quants.dequantize(blocks.reshape(12, -1).numpy(), GGMLQuantizationType.Q6_K)
    assert torch.equal(dequantize_q6_k(blocks), torch.from_numpy(ref))


@pytest.mark.parametrize("shape", [(16, 512), (5, 300)])
def test_round_trip_error_beats_q4(shape: tuple[int, int]) -> None:
    w = torch.randn(shape)
    blocks = quantize_q6_k(w)
    assert blocks.shape == (shape[0], -(-shape[1] // 256), Q6_K_BYTES) and blocks.dtype == torch.uint8
    back = dequantize_q6_k(blocks, shape[1])
    rel = float((back - w).norm() / w.norm())
    rel_q4 = float((dequantize(quantize(w, "q4")) - w).norm() / w.norm())
    assert rel <= 0.025 and rel < rel_q4 / 3  # Gaussian weights: ~0.018 (6 bits), Q4_0 ~0.083


def test_special_rows() -> None:
    w = torch.zeros(3, 256)
    w[1] = -0.75  # constant: every code at one end of the grid
    w[2, :16] = torch.linspace(0, 1, 16)  # one busy sub-block, fifteen empty ones
    back = dequantize_q6_k(quantize_q6_k(w))
    assert torch.equal(back[0], w[0])
    assert float((back[1] - w[1]).abs().max()) < 1e-3
    assert float((back[2] - w[2]).abs().max()) < 0.02 and torch.equal(back[2, 16:], w[2, 16:])


def test_bad_input_is_one_clear_error() -> None:
    with pytest.raises(FreeTokenError, match="2-D"):
        quantize_q6_k(torch.randn(4))
    with pytest.raises(FreeTokenError, match="inf or nan"):
        quantize_q6_k(torch.tensor([[float("nan")] * 256]))
    with pytest.raises(FreeTokenError, match=r"uint8 \[N, ns, 210\]"):
        dequantize_q6_k(torch.zeros(2, 1, 144, dtype=torch.uint8))
