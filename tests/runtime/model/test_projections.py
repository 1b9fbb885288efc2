"""``layers.projections``: q, k and v in one kernel call when each would run on the kernels, the same bits."""

from __future__ import annotations

import pytest
import torch

from freetoken_agent.runtime.kernels import build, ops
from freetoken_agent.runtime.model.layers import dense_linear, projections

NAMES = ("q_proj", "k_proj", "v_proj")


@pytest.mark.parametrize(("rows", "m", "fused"), [((512, 256, 256), 1, True), ((256, 128, 128), 1, False),
                                                 ((256, 128, 128), 12, True)])  # fmt: skip
def test_projections_equal_separate_products(rows: tuple[int, ...], m: int, fused: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # decode: weights of fewer than GEMV_MIN_ROWS rows stay with torch, so the three are fused only when none
    # does; prefill-sized x (more than GEMV_MAX_M rows) puts every product on the kernels
    if build.load() is None:
        pytest.skip("the C kernels are unavailable")
    d = 192
    w = {f"{n}.weight": torch.randn(r, d) for n, r in zip(NAMES, rows)}
    w["k_proj.bias"] = torch.randn(rows[1])
    x = torch.randn(m, d)
    calls = []
    real = ops.linear_f32_parts
    monkeypatch.setattr(ops, "linear_f32_parts", lambda *a: calls.append(1) or real(*a))
    got = projections(x, w, NAMES)
    assert bool(calls) == fused
    for g, n in zip(got, NAMES):
        assert torch.equal(g, dense_linear(x, w[f"{n}.weight"], w.get(f"{n}.bias")))
