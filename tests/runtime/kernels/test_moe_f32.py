"""``ops.moe_f32`` (``ft_moe_f32``): fp32 SiLU-gated experts in one kernel call, against the plain-torch formula;
batch invariant; bad ids refused; ``TorchExperts`` takes it only where its experts are exactly that."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.kernels import build, ops
from freetoken_agent.runtime.model.moe import TorchExperts
from freetoken_agent.runtime.model.spec import MoESpec, RouterSpec

pytestmark = pytest.mark.skipif(build.load() is None, reason="C kernels unavailable (no compiler)")


def reference(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x, dtype=torch.float64)
    inter = down.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = gate_up[e].double() @ x[t].double()
            a = F.silu(h[:inter]) * h[inter:]
            out[t] += weights[t, j].double() * (down[e].double() @ a)
    return out.float()


def case(t: int, e: int = 7, d: int = 48, inter: int = 20, k: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate_up, down = torch.randn(e, 2 * inter, d, generator=g) / 4, torch.randn(e, d, inter, generator=g) / 4
    x = torch.randn(t, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.empty(0, k).long()
    if t > 2:
        ids[1, 0] = -1  # a skipped slot
    weights = torch.rand(t, k, generator=g)
    return gate_up, down, x, ids, weights


@pytest.mark.parametrize("t", [1, 2, 5, 8, 9, 37, 600])  # 600 x 3 slots: two passes of ft_moe_f32
@pytest.mark.parametrize("isa", ["best", "portable", "avx2"])
def test_equals_the_torch_formula(t: int, isa: str) -> None:
    if isa not in ops.available_isas() and isa != "best":
        pytest.skip(f"{isa} not on this CPU")
    before = ops.current_isa()
    ops.set_isa(isa)
    try:
        gate_up, down, x, ids, weights = case(t)
        got = ops.moe_f32(gate_up, down, x, ids, weights)
        torch.testing.assert_close(got, reference(gate_up, down, x, ids, weights), rtol=0, atol=1e-5)
    finally:
        ops.set_isa(before)


@pytest.mark.parametrize("t", [23, 400])  # 400 x 3 slots: the call makes two passes
def test_rows_are_batch_invariant(t: int) -> None:
    gate_up, down, x, ids, weights = case(t, seed=3)
    full = ops.moe_f32(gate_up, down, x, ids, weights)
    for r in range(0, t, 1 if t < 50 else 19):
        alone = ops.moe_f32(gate_up, down, x[r : r + 1], ids[r : r + 1], weights[r : r + 1])
        assert torch.equal(alone[0], full[r])
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ops.moe_f32(gate_up, down, x[perm], ids[perm], weights[perm]), full[perm])


def test_bad_inputs_are_refused() -> None:
    gate_up, down, x, ids, weights = case(4)
    with pytest.raises(FreeTokenError, match="expert id"):
        ops.moe_f32(gate_up, down, x, torch.full_like(ids, 7), weights)
    with pytest.raises(FreeTokenError, match="want fp32"):
        ops.moe_f32(gate_up, down[:, :, :5].contiguous(), x, ids, weights)
    assert ops.moe_f32(gate_up, down, x[:0], ids[:0], weights[:0]).shape == (0, 48)
    none = torch.full_like(ids, -1)
    assert torch.equal(ops.moe_f32(gate_up, down, x, none, weights), torch.zeros_like(x))


def test_torch_experts_take_the_kernel_only_for_plain_silu_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    gate_up, down, x, ids, weights = case(6, e=5, k=2)
    ids = ids.clamp(min=0)  # the torch path takes no skipped slots
    calls = []
    real = ops.moe_f32
    monkeypatch.setattr(ops, "moe_f32", lambda *a: calls.append(1) or real(*a))
    spec = MoESpec(num_experts=5, top_k=2, intermediate=20, router=RouterSpec())
    plain = TorchExperts(spec, gate_up, down)
    assert plain.kernel_call(x)
    got = plain.forward(x, ids, weights)
    assert calls == [1]  # one kernel call for every hit expert
    assert torch.equal(got, ops.moe_f32(gate_up, down, x, ids, weights))
    torch.testing.assert_close(got, reference(gate_up, down, x, ids, weights), rtol=0, atol=1e-5)
    biased = TorchExperts(spec, gate_up, down, gate_up_bias=torch.zeros(5, 40))
    assert not biased.kernel_call(x)  # the torch path, same result with a zero bias
    calls.clear()
    torch.testing.assert_close(biased.forward(x, ids, weights), reference(gate_up, down, x, ids, weights), rtol=0,
                               atol=1e-5)
    assert calls == []
    gelu = TorchExperts(MoESpec(num_experts=5, top_k=2, intermediate=20, router=RouterSpec(), activation="gelu"),
                        gate_up, down)
    assert not gelu.kernel_call(x)
    stored16 = TorchExperts(spec, gate_up.bfloat16(), down.bfloat16())  # a bf16 checkpoint's experts kept as stored
    assert stored16.kernel_call(x) and not stored16.kernel_call(x.bfloat16())  # bf16 compute: torch's


@pytest.mark.parametrize("t", [1, 3, 8, 9, 600])
@pytest.mark.parametrize("isa", ["best", "portable", "avx2"])
def test_bf16_weights_give_the_bits_of_their_fp32_copies(t: int, isa: str) -> None:
    """bf16 experts are widened exactly in registers (the portable path per item): the same products as fp32
    copies of them, bit for bit, whatever the row count."""
    if isa not in ops.available_isas() and isa != "best":
        pytest.skip(f"{isa} not on this CPU")
    before = ops.current_isa()
    ops.set_isa(isa)
    try:
        gate_up, down, x, ids, weights = case(t, seed=5)
        g16, d16 = gate_up.bfloat16(), down.bfloat16()
        assert torch.equal(ops.moe_f32(g16, d16, x, ids, weights), ops.moe_f32(g16.float(), d16.float(), x, ids,
                                                                                 weights))
    finally:
        ops.set_isa(before)
    with pytest.raises(FreeTokenError, match="want fp32"):  # one bf16 and one fp32 weight: refused
        ops.moe_f32(gate_up.bfloat16(), down, x, ids, weights)


def test_the_torch_path_widens_16bit_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel does not run, 16-bit experts kept as stored are widened per expert: torch's fp32 result
    over the same values."""
    gate_up, down, x, ids, weights = case(6, e=5, k=2)
    ids = ids.clamp(min=0)
    spec = MoESpec(num_experts=5, top_k=2, intermediate=20, router=RouterSpec())
    g16, d16 = gate_up.bfloat16(), down.bfloat16()
    monkeypatch.setattr(ops, "moe_f32_takes", lambda *a: False)
    stored, wide = TorchExperts(spec, g16, d16), TorchExperts(spec, g16.float(), d16.float())
    assert not stored.kernel_call(x)
    got = stored.forward(x, ids, weights)
    assert got.dtype is torch.float32 and torch.equal(got, wide.forward(x, ids, weights))
