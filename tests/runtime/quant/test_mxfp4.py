"""GGUF MXFP4 blocks: byte layout, bitwise agreement with the ``gguf`` package's dequantizer (every exponent byte,
subnormal scales included), and our quantizer writing ggml's bytes (the checkpoint layout: ``test_native_formats``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.quant import dequantize_mxfp4, quantize_mxfp4
from freetoken_agent.runtime.quant.mxfp4 import MXFP4_BYTES, dequantize_mxfp4_blocks, quantize_mxfp4_blocks

from tests.runtime.quant.ggml import ggml_quantize

KVALUES = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]  # ggml's kvalues_mxfp4: e2m1 values doubled


def test_dequantize_follows_the_layout() -> None:
    codes = torch.randint(0, 16, (32,), generator=torch.Generator().manual_seed(1))
    qs = (codes[:16] | (codes[16:] << 4)).to(torch.uint8)  # byte j: value j (low nibble), j + 16 (high)
    block = torch.cat([torch.tensor([130], dtype=torch.uint8), qs]).reshape(1, 1, MXFP4_BYTES)
    want = torch.tensor([KVALUES[c] for c in codes.tolist()], dtype=torch.float32) * 2.0 ** (130 - 128)
    assert torch.equal(dequantize_mxfp4_blocks(block)[0], want)


def test_dequantize_equals_gguf_py_bitwise() -> None:
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    gen = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (16, 16, MXFP4_BYTES), dtype=torch.uint8, generator=gen)
    blocks[..., 0] = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # every exponent byte: 0 and 1 subnormal
    with np.errstate(over="ignore"):  # 12 * 2**127 overflows to inf, in both
        ref = torch.from_numpy(quants.dequantize(blocks.reshape(16, -1).numpy(), GGMLQuantizationType.MXFP4))
    ours = dequantize_mxfp4_blocks(blocks)
    assert bool(torch.isinf(ref).any()) and torch.equal(ours, ref)
    assert torch.equal(dequantize_mxfp4_blocks(blocks, 500), ours[:, :500])


@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])
def test_quantizer_writes_ggml_bytes(scale: float) -> None:
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    w = torch.randn(16, 512) * scale
    w[0, :32] = 0.0  # an all-zero block: exponent byte 0
    ours = quantize_mxfp4_blocks(w)
    assert ours.shape == (16, 16, MXFP4_BYTES) and ours.dtype == torch.uint8
    assert torch.equal(ours, ggml_quantize(w, "mxfp4", MXFP4_BYTES, 32))
    theirs = quants.quantize(w.numpy(), GGMLQuantizationType.MXFP4)
    assert torch.equal(ours.reshape(16, -1), torch.from_numpy(theirs))


def test_round_trip_and_padding() -> None:
    w = torch.randn(8, 300)  # a ragged last block: zero-padded (valid for us, not for a GGUF file)
    blocks = quantize_mxfp4_blocks(w)
    assert blocks.shape == (8, 10, MXFP4_BYTES)
    back = dequantize_mxfp4_blocks(blocks, 300)
    assert back.shape == (8, 300)
    assert float((back - w).norm() / w.norm()) < 0.13  # Gaussian weights: ~0.115 (e2m1: 8 magnitudes per block)


def test_checkpoint_and_gguf_layouts_hold_the_same_values() -> None:
    w = torch.randn(4, 128)
    blocks, scales = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(blocks, scales), dequantize_mxfp4_blocks(quantize_mxfp4_blocks(w)))
    assert torch.equal(scales, quantize_mxfp4_blocks(w)[..., 0])


def test_bad_input_is_one_clear_error() -> None:
    with pytest.raises(FreeTokenError, match="2-D"):
        quantize_mxfp4_blocks(torch.randn(32))
    with pytest.raises(FreeTokenError, match="nan"):
        quantize_mxfp4_blocks(torch.full((1, 32), float("nan")))
    with pytest.raises(FreeTokenError, match=r"uint8 \[N, nb, 17\]"):
        dequantize_mxfp4_blocks(torch.zeros(1, 1, 18, dtype=torch.uint8))
