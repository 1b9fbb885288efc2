"""``layers.projections``: q, k and v in one kernel call when each would run on the kernels, the same bits."""

from __future__ import annotations

import pytest
import torch

from freetoken_agent.runtime.kernels import build, ops
from freetoken_agent.runtime.model.layers import dense_linear, projections

NAMES = ("q_proj", "k_proj", "v_proj")


@pytest.mark.parametrize(("rows", "m", "fused"), [((512, 256, 256), 1, True), ((256, 128, 128), 1, True),
                                                 ((256, 128, 128), 12, True), ((64, 32, 32), 3, False)])  # fmt: skip
def test_projections_equal_separate_products(rows: tuple[int, ...], m: int, fused: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # every fp32 product runs on the kernels, so the three are one call; a weight the kernels do not take (here a
    # transposed view: not contiguous) keeps all three in torch
    if build.load() is None:
        pytest.skip("the C kernels are unavailable")
    d = 192
    w = {f"{n}.weight": torch.randn(r, d) if fused else torch.randn(d, r).t() for n, r in zip(NAMES, rows)}
    w["k_proj.bias"] = torch.randn(rows[1])
    x = torch.randn(m, d)
    calls = []
    real = ops.linear_f32_parts
    monkeypatch.setattr(ops, "linear_f32_parts", lambda *a: calls.append(1) or real(*a))
    got = projections(x, w, NAMES)
    assert bool(calls) == fused
    for g, n in zip(got, NAMES):
        assert torch.equal(g, dense_linear(x, w[f"{n}.weight"], w.get(f"{n}.bias")))
