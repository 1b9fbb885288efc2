"""The kernels of GGUF's K-quants (Q4_K, Q5_K, Q6_K tiles: ``csrc/ft_kquant.h``) and MXFP4 (``csrc/ft_mxfp4.h``)
against the plain-torch reference (dequantize, fp32 matmul), on every ISA path this CPU has, the portable one included:
the tile layout round-trips, the C dequantizer gives the torch dequantizer's values bit for bit, and the
int8-activation GEMV / small-M products and the fused MoE step (Q4_K gate/up with Q6_K down, as a Q4_K_M file holds
them, and the other formats) agree with the reference to fp32 rounding (1-token and 4-token kernels: M = 1..16)."""

from __future__ import annotations

import pytest
import torch
from freetoken_agent.runtime.kernels import build, ops
from freetoken_agent.runtime.kernels.experts import QuantizedExperts
from freetoken_agent.runtime.kernels.layout import unpack_blocks
from freetoken_agent.runtime.kernels.reference import fake_quant_int8, near_ties
from freetoken_agent.runtime.quant.formats import block_format

KQUANTS = ["q4_k", "q5_k", "q6_k", "mxfp4"]  # the GGUF formats the kernels run as stored, besides Q8_0 / Q4_0
SHAPES = [(64, 256), (37, 768), (5, 1280), (24, 2048)]  # ragged N (padded tiles) and K = 1, 3, 5, 8 super-blocks
RAGGED_K = [(13, 352), (8, 300)]  # MXFP4's 32-value blocks: K no multiple of 256, and a zero-padded last block


@pytest.fixture(scope="module")
def isas() -> list[str]:
    if build.load() is None:
        pytest.skip(f"C kernels unavailable here: {build.status().reason}")
    yield ops.available_isas()
    ops.set_isa("best")


def _weight(fmt: str, n: int, k: int, seed: int) -> tuple[ops.PackedWeight, torch.Tensor, torch.Tensor]:
    """(packed weight, its GGUF blocks, their dequantized values) of a fresh random ``[n, k]`` weight."""
    f = block_format(fmt)
    blocks = f.quantize_rows(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return ops.PackedWeight.from_rows(fmt, blocks, k), blocks, f.dequantize_rows(blocks, k)


CASES = [(f, s) for f in KQUANTS for s in SHAPES] + [("mxfp4", s) for s in RAGGED_K]


@pytest.mark.parametrize(("fmt", "shape"), CASES)
def test_tiles_round_trip_and_dequantize_exactly(fmt: str, shape: tuple[int, int], isas: list[str]) -> None:
    n, k = shape
    pw, blocks, values = _weight(fmt, n, k, seed=n + k)
    assert pw.nbytes == ops.packed_bytes(fmt, n, k) == ops._lib().ft_packed_bytes(ops.FMT_CODE[fmt], n, k)
    assert pw.nbytes == -(-n // 8) * 8 * blocks.shape[1] * blocks.shape[2]  # the file's bytes, reordered
    assert values.shape == (n, k)
    assert torch.equal(unpack_blocks(pw.data, n, *blocks.shape[1:]), blocks)
    for isa in isas:
        ops.set_isa(isa)
        assert torch.equal(ops.dequantize(pw), values), isa


@pytest.mark.parametrize(("fmt", "shape"), CASES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16])
def test_linear_matches_the_reference(fmt: str, shape: tuple[int, int], m: int, isas: list[str]) -> None:
    n, k = shape
    pw, _, values = _weight(fmt, n, k, seed=7 * m + n)
    x = torch.randn(m, k)
    ref = fake_quant_int8(x) @ values.T  # the kernels' int8 activations, exact fp32 products
    # a value within 1e-3 steps of an int8 rounding tie may round the other way in the kernels (their 127 / amax is
    # a division, torch's a reciprocal times 127): one step of it times the weight's magnitude
    slack = near_ties(x, 1e-3) @ values.abs().T
    tol = 1e-5 * float(ref.abs().max()) + slack
    for isa in isas:
        ops.set_isa(isa)
        out = ops.linear(pw, x)
        # the same integer sums as the reference; only fp32 summation order differs (a wrong code, scale or
        # min is off by O(1) of the output's scale)
        assert bool(((out - ref).abs() <= tol).all()), isa
        # and against the weights' own values with fp32 activations: the int8 rounding only
        assert float((out - x @ values.T).norm() / (x @ values.T).norm()) < 0.03, isa


def test_integer_friendly_inputs_are_exact(isas: list[str]) -> None:
    # activations int8 holds exactly (absmax 127 per 32-block); small integer codes and scales: every product and sum
    # is exact in fp32, whatever the order
    k = 512
    x = torch.randint(-127, 128, (3, k)).float()
    x[:, ::32] = 127.0
    for fmt in KQUANTS:
        f = block_format(fmt)
        blocks = f.quantize_rows(torch.randint(-8, 8, (16, k)).float() / 4)
        pw = ops.PackedWeight.from_rows(fmt, blocks, k)
        want = x @ f.dequantize_rows(blocks, k).T
        for isa in isas:
            ops.set_isa(isa)
            torch.testing.assert_close(ops.linear(pw, x), want, rtol=0, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("formats", [("q4_k", "q6_k"), ("q6_k", "q4_k"), ("q4_k", "q4_k"), ("q4_k", "q8_0"),
                                     ("q5_k", "q6_k"), ("q5_k", "q5_k"), ("mxfp4", "mxfp4"),
                                     ("mxfp4", "q8_0")])
def test_fused_moe_step_with_two_formats(formats: tuple[str, str], isas: list[str]) -> None:
    fmt13, fmt2 = formats
    e, d, i, t, top = 6, 512, 256, 9, 2
    gen = torch.Generator().manual_seed(11)
    gate_up, down = torch.randn(e, 2 * i, d, generator=gen) * 0.1, torch.randn(e, d, i, generator=gen) * 0.1
    b13 = block_format(fmt13).quantize_rows(gate_up.reshape(-1, d)).reshape(e, 2 * i, -1, block_format(fmt13).block_bytes)
    b2 = block_format(fmt2).quantize_rows(down.reshape(-1, i)).reshape(e, d, -1, block_format(fmt2).block_bytes)
    qe = QuantizedExperts.from_blocks(b13, b2, fmt13, d, i, use_kernels=True, down_fmt=fmt2)
    assert qe.fused and qe.capabilities.formats == tuple(dict.fromkeys(formats))
    g, w = qe.dequantize()
    assert torch.equal(g, block_format(fmt13).dequantize_rows(b13.reshape(-1, *b13.shape[2:]), d).reshape(e, 2 * i, d))
    assert torch.equal(w, block_format(fmt2).dequantize_rows(b2.reshape(-1, *b2.shape[2:]), i).reshape(e, d, i))
    x = torch.randn(t, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top] for _ in range(t)])
    wts = torch.rand(t, top, generator=gen)
    ref = torch.zeros(t, d)
    for tok in range(t):  # plain torch over the dequantized weights, int8-rounded matmul inputs like the kernels'
        for slot in range(top):
            ex = int(ids[tok, slot])
            h = fake_quant_int8(x[tok : tok + 1]) @ g[ex].T
            a = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
            ref[tok] += wts[tok, slot] * (fake_quant_int8(a) @ w[ex].T)[0]
    exact = torch.zeros(t, d)
    for tok in range(t):
        for slot in range(top):
            ex = int(ids[tok, slot])
            h = x[tok : tok + 1] @ g[ex].T
            exact[tok] += wts[tok, slot] * ((torch.nn.functional.silu(h[:, :i]) * h[:, i:]) @ w[ex].T)[0]
    qe.set_mode("int8")
    for isa in isas:
        ops.set_isa(isa)
        out = qe(x, ids, wts)
        # the second rounding (of SiLU(gate)*up) may fall on the other side of a tie: a loose bound on the sum
        assert float((out - ref).norm() / ref.norm()) < 2e-3, isa
        assert float((out - exact).norm() / exact.norm()) < 0.03, isa
    qe.set_mode("exact")
    torch.testing.assert_close(qe(x, ids, wts), exact, rtol=1e-4, atol=1e-4 * float(exact.abs().max()))
