"""FP8 e4m3 128x128 block scales and MXFP4 (GPT-OSS): decoding matches the reference definition."""

from __future__ import annotations

import pytest
import torch

from freetoken_agent.runtime.errors import CheckpointError
from freetoken_agent.runtime.quant import dequantize_fp8_block, dequantize_mxfp4, quantize_fp8_block, quantize_mxfp4


@pytest.mark.parametrize("shape", [(256, 384), (200, 130)])
def test_fp8_block_dequant_applies_each_blocks_scale(shape: tuple[int, int]) -> None:
    w = torch.randn(*shape)
    q, scale = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    out = dequantize_fp8_block(q, scale)
    # reference: element (r, c) times the scale of block (r // 128, c // 128)
    r, c = shape[0] - 1, shape[1] - 1
    assert float(out[r, c]) == float(q[r, c].float() * scale[r // 128, c // 128])
    assert float((out - w).norm() / w.norm()) < 0.05
    assert torch.equal(dequantize_fp8_block(q.view(torch.uint8), scale), out)


def test_fp8_rejects_wrong_scale_shape() -> None:
    q, scale = quantize_fp8_block(torch.randn(256, 256))
    with pytest.raises(CheckpointError, match="needs scales of shape"):
        dequantize_fp8_block(q, scale[:1])


def test_mxfp4_decodes_the_e2m1_table_and_e8m0_scales() -> None:
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x2F  # element 0: code 0xF = -6.0, element 1: code 0x2 = 1.0
    blocks[0, 0, 15] = 0x70  # element 30: 0.0, element 31: code 7 = 6.0
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2 ** (128 - 127) = 2
    out = dequantize_mxfp4(blocks, scales)
    assert out.shape == (1, 32)
    assert out[0, 0] == -12.0 and out[0, 1] == 2.0 and out[0, 31] == 12.0 and out[0, 30] == 0.0


def test_mxfp4_round_trip_on_expert_shaped_tensors() -> None:
    w = torch.randn(3, 8, 64)  # [E, rows, K]
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 8, 2, 16) and scales.shape == (3, 8, 2)
    out = dequantize_mxfp4(blocks, scales)
    assert out.shape == w.shape
    assert float((out - w).norm() / w.norm()) < 0.2
    with pytest.raises(CheckpointError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :1])
