"""QuantizedExperts: every path (fused C call, per-expert C calls, dequantize + mm, no kernels) against the
plain-torch reference over the dequantized weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.kernels import build, ops
from freetoken_agent.runtime.kernels.experts import QuantizedExperts

needs_kernels = pytest.mark.skipif(build.load() is None, reason="C kernels unavailable (no compiler)")


def reference(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
              wts: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The definition, token by token: sum_k w_k * down_e(silu(gate_e x) * up_e x)."""
    i = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = gate_up[e] @ x[t]
            out[t] += wts[t, k] * (down[e] @ (F.silu(h[:i]) * h[i:]))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _layer(e: int, d: int, i: int, t: int, k: int) -> tuple[torch.Tensor, ...]:
    gate_up = torch.randn(e, 2 * i, d) / d**0.5
    down = torch.randn(e, d, i) / i**0.5
    x = torch.randn(t, d)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, k), dim=-1)
    return gate_up, down, x, ids, wts


@needs_kernels
@pytest.mark.parametrize("fmt", ["q8", "q4"])
@pytest.mark.parametrize("dims", [(8, 64, 48), (6, 100, 40)])  # (E, D, I); D=100, I=40 are not block multiples
def test_fused_decode_matches_reference(fmt: str, dims: tuple[int, int, int]) -> None:
    e, d, i = dims
    gate_up, down, x, ids, wts = _layer(e, d, i, t=5, k=2)
    qe = QuantizedExperts.from_float(gate_up, down, fmt)
    assert qe.packed and qe.fused
    g, w = qe.dequantize()
    ref = reference(g, w, x, ids, wts)
    assert _rel(qe.forward(x, ids, wts), ref) < 0.03  # two int8 activation quantizations (~0.5-1% each)
    qe.dequant_threshold = 1  # every expert through dequantize + torch.mm: exact up to fp32 rounding
    torch.testing.assert_close(qe.forward(x, ids, wts), ref, rtol=1e-4, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_fused_call_equals_per_expert_path(fmt: str) -> None:
    gate_up, down, x, ids, wts = _layer(16, 96, 64, t=7, k=4)
    qe = QuantizedExperts.from_float(gate_up, down, fmt)
    fused = qe.forward(x, ids, wts)
    qe.activation = lambda h: F.silu(h[:, :64]) * h[:, 64:]  # same math, but forces one C call per expert
    assert not qe.fused
    per_expert = qe.forward(x, ids, wts)
    torch.testing.assert_close(fused, per_expert, rtol=2e-3, atol=2e-3 * float(fused.abs().max()))


@needs_kernels
def test_mixed_prefill_and_decode_experts() -> None:
    # expert 0 gets every token (dequantize + mm), the rest a few each (fused call)
    gate_up, down, x, ids, wts = _layer(8, 64, 32, t=40, k=2)
    ids[:, 0] = 0
    ids[:, 1] = torch.randint(1, 8, (40,))
    qe = QuantizedExperts.from_float(gate_up, down, "q4")
    qe.dequant_threshold = 32
    g, w = qe.dequantize()
    ref = reference(g, w, x, ids, wts)
    out = qe.forward(x, ids, wts)
    assert _rel(out, ref) < 0.03
    qe.dequant_threshold = 10_000
    all_fused = qe.forward(x, ids, wts)
    assert _rel(out, all_fused) < 0.03 and not torch.equal(out, all_fused)


@needs_kernels
def test_biases_and_custom_activation() -> None:
    gate_up, down, x, ids, wts = _layer(4, 64, 32, t=3, k=2)
    qe = QuantizedExperts.from_float(gate_up, down, "q8")
    g, w = qe.dequantize()
    qe.gate_up_bias, qe.down_bias = torch.randn(4, 64), torch.randn(4, 64)
    qe.activation = lambda h: F.gelu(h[:, :32]) * h[:, 32:]
    ref = torch.zeros_like(x)
    for t in range(3):
        for k in range(2):
            e = int(ids[t, k])
            h = g[e] @ x[t] + qe.gate_up_bias[e]
            ref[t] += wts[t, k] * (w[e] @ (F.gelu(h[:32]) * h[32:]) + qe.down_bias[e])
    assert _rel(qe.forward(x, ids, wts), ref) < 0.03


@needs_kernels
def test_thread_count_does_not_change_results() -> None:
    gate_up, down, x, ids, wts = _layer(8, 128, 64, t=4, k=3)
    qe = QuantizedExperts.from_float(gate_up, down, "q4")
    before = ops.get_threads()
    try:
        ops.set_threads(1)
        one = qe.forward(x, ids, wts)
        ops.set_threads(2)
        for _ in range(10):
            assert torch.equal(qe.forward(x, ids, wts), one)
    finally:
        ops.set_threads(before)


@needs_kernels
@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_a_long_step_in_many_passes_equals_one_pass_bit_for_bit(fmt: str) -> None:
    """A prefill step's slots run in passes of whole experts (bounded working memory): the result must not depend
    on where the passes split, down to the last bit, with uneven experts (one takes every token)."""
    e, d, i, t, k = 12, 96, 64, 37, 3
    gate_up, down, x, ids, wts = _layer(e, d, i, t=t, k=k)
    ids[:, 0] = 5  # expert 5 in every token: one group as big as T
    ids[:, 1:] = torch.where(ids[:, 1:] == 5, (ids[:, 1:] + 1) % e, ids[:, 1:])
    ids[3, 2] = -1  # a skipped slot
    qe = QuantizedExperts.from_float(gate_up, down, fmt)
    old = ops.set_moe_pass_bytes(1 << 40)  # one pass
    try:
        one = ops.moe(qe.fmt, qe.w13, qe.w2, (d, i), x, ids, wts)
        for nbytes in (1, 4096, 3 * 4096, 40_000):  # a pass per expert, ..., a few experts per pass
            ops.set_moe_pass_bytes(nbytes)
            assert torch.equal(ops.moe(qe.fmt, qe.w13, qe.w2, (d, i), x, ids, wts), one), nbytes
    finally:
        ops.set_moe_pass_bytes(old)
    assert ops.set_moe_pass_bytes(0) == old


@needs_kernels
def test_crossover_is_measured_once_and_can_be_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    from freetoken_agent.runtime.kernels import experts as mod

    first = mod.crossover_tokens()
    assert 1 <= first <= mod.MAX_DEQUANT_THRESHOLD and mod.crossover_tokens() == first
    monkeypatch.setenv("FREETOKEN_DEQUANT_THRESHOLD", "7")
    qe = QuantizedExperts.from_float(torch.randn(2, 8, 32), torch.randn(2, 32, 4), "q8")
    assert qe.dequant_threshold == 7


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_without_kernels_the_torch_path_matches_reference(fmt: str) -> None:
    gate_up, down, x, ids, wts = _layer(4, 64, 32, t=3, k=2)
    qe = QuantizedExperts.from_float(gate_up, down, fmt, use_kernels=False)
    assert not qe.packed
    g, w = qe.dequantize()
    ref = reference(g, w, x, ids, wts)
    if fmt == "q4" and qe.int4 is not None:  # torch's int4 op with bf16 activations and bf16 scales
        assert _rel(qe.forward(x, ids, wts), ref) < 0.02
        qe.int4 = None
    torch.testing.assert_close(qe.forward(x, ids, wts), ref, rtol=1e-4, atol=1e-5)
    # quantization error itself stays within the format's bound
    assert _rel(g, gate_up) < (0.01 if fmt == "q8" else 0.11)


@needs_kernels
def test_out_of_range_expert_id_is_one_clear_error() -> None:
    qe = QuantizedExperts.from_float(torch.randn(2, 8, 32), torch.randn(2, 32, 4), "q8")
    with pytest.raises(FreeTokenError, match="expert id"):
        ops.moe(qe.fmt, qe.w13, qe.w2, (32, 4), torch.randn(1, 32), torch.tensor([[0, 2]]), torch.ones(1, 2))


def test_bad_shapes_are_one_clear_error() -> None:
    with pytest.raises(FreeTokenError, match="down must be"):
        QuantizedExperts.from_float(torch.randn(2, 8, 32), torch.randn(2, 32, 5), "q4")
    qe = QuantizedExperts.from_float(torch.randn(2, 8, 32), torch.randn(2, 32, 4), "q8")
    with pytest.raises(FreeTokenError, match="want x"):
        qe.forward(torch.randn(3, 31), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))


def test_kernels_off_falls_back_to_torch_and_says_why(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from freetoken_agent.runtime.kernels import build, QuantizedExperts\n"
        "st = build.status(); assert not st.available and 'FREETOKEN_KERNELS' in st.reason, st\n"
        "qe = QuantizedExperts.from_float(torch.randn(4, 64, 64) / 8, torch.randn(4, 64, 32) / 6, 'q4')\n"
        "assert not qe.packed and qe.int4 is not None\n"
        "x = torch.randn(3, 64); ids = torch.tensor([[0, 1], [2, 3], [1, 2]]); w = torch.rand(3, 2)\n"
        "y = qe.forward(x, ids, w); qe.int4 = None; ref = qe.forward(x, ids, w)\n"
        "assert float((y - ref).norm() / ref.norm()) < 0.02\n"
        "print('ok')\n"
    )
    env = {**os.environ, "FREETOKEN_KERNELS": "off"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
