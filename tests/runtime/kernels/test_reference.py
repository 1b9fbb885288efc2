"""The int8-activation reference (plain torch) against the C kernels on fresh random inputs, every ISA path here."""

from __future__ import annotations

import pytest
import torch
from freetoken_agent.runtime.kernels import build, ops
from freetoken_agent.runtime.kernels.reference import fake_quant_int8, near_ties
from freetoken_agent.runtime.quant.blocks import dequantize, quantize

needs_kernels = pytest.mark.skipif(build.load() is None, reason="C kernels unavailable")


def test_fake_quant_rounds_per_block_like_q8_activations() -> None:
    x = torch.randn(3, 70)  # 70: the last block is partial (zero-padded)
    y = fake_quant_int8(x)
    assert y.shape == x.shape
    for b in range(3):
        blk = slice(32 * b, min(32 * (b + 1), 70))
        step = x[:, blk].abs().amax(dim=-1, keepdim=True) / 127
        codes = y[:, blk] / step
        assert torch.allclose(codes, codes.round(), atol=1e-3)  # whole numbers of the block's step
        assert float(((y[:, blk] - x[:, blk]).abs() / step).max()) <= 0.5 + 1e-4
    assert torch.equal(fake_quant_int8(torch.zeros(2, 32)), torch.zeros(2, 32))


def test_near_ties_flags_values_half_a_step_off() -> None:
    x = torch.zeros(1, 32)
    x[0, 0] = 127.0  # amax 127: step 1, so x is measured in steps
    x[0, 1], x[0, 2], x[0, 3] = 3.5, 3.4, -2.5002
    steps = near_ties(x, 1e-3)
    assert steps[0, 1] == 1.0 and steps[0, 2] == 0.0 and steps[0, 3] == 1.0 and steps[0, 0] == 0.0


@needs_kernels
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("shape", [(24, 80), (136, 256)])
def test_kernel_equals_int8_reference_on_every_isa(fmt: str, shape: tuple[int, int]) -> None:
    n, k = shape
    qw = quantize(torch.randn(n, k), fmt)
    w = dequantize(qw)
    packed = ops.PackedWeight.from_blocks(qw)
    x = torch.randn(5, k)
    want = fake_quant_int8(x) @ w.T
    plain = x @ w.T
    try:
        for isa in ops.available_isas():
            ops.set_isa(isa)
            got = ops.linear(packed, x)
            scale = float(want.abs().max())
            assert float((got - want).abs().max()) <= 2e-6 * scale * k**0.5, isa
            assert float((got - plain).abs().max()) > 1e-4 * scale  # the reference is the rounding, not fp32
    finally:
        ops.set_isa("best")
