"""``ft_route`` (``ops.route``): top-k routing in C, the choice ``model/moe.py``'s ``route`` and the fused decode step
both make, against the plain-torch reference of each mode (softmax then top-k, normalized or not, scaled; top-k
then softmax), ties to the lower expert id, bad arguments refused."""

from __future__ import annotations

import pytest
import torch

from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.kernels import build, ops
from freetoken_agent.runtime.model.moe import route
from freetoken_agent.runtime.model.spec import RouterSpec

pytestmark = pytest.mark.skipif(build.load() is None, reason="C kernels unavailable (no compiler)")


def reference(logits: torch.Tensor, k: int, mode: int, norm: bool, eps: float, scaling: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    if mode == 1:
        top, ids = torch.topk(logits, k, dim=-1)
        return ids, torch.softmax(top, dim=-1) * scaling
    scores = torch.softmax(logits, dim=-1)
    top, ids = torch.topk(scores, k, dim=-1)
    if norm:
        top = top / (top.sum(-1, keepdim=True) + eps)
    return ids, top * scaling


@pytest.mark.parametrize(("e", "k"), [(8, 2), (64, 8), (128, 1), (160, 6)])
@pytest.mark.parametrize(("mode", "norm", "eps", "scaling"), [(0, False, 0.0, 1.0), (0, True, 0.0, 1.0),
                                                              (0, True, 1e-20, 2.5), (1, False, 0.0, 1.0),
                                                              (1, False, 0.0, 1.5)])
def test_route_matches_the_torch_reference(e: int, k: int, mode: int, norm: bool, eps: float, scaling: float) -> None:
    logits = torch.randn(37, e, generator=torch.Generator().manual_seed(e + k)) * 3
    ids, weights = ops.route(logits, k, mode, norm, eps, scaling)  # type: ignore[misc]
    ref_ids, ref_weights = reference(logits, k, mode, norm, eps, scaling)
    assert ids.dtype == torch.int64 and ids.shape == (37, k) and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=2e-6, atol=1e-7)


def test_ties_go_to_the_lower_expert_id_and_bad_arguments_are_refused() -> None:
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, 0.5], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    ids, weights = ops.route(logits, 3, 0, True, 0.0, 1.0)  # type: ignore[misc]
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3))
    with pytest.raises(FreeTokenError):
        ops.route(logits, 7, 0, False, 0.0, 1.0)
    with pytest.raises(FreeTokenError):
        ops.route(logits, 2, 3, False, 0.0, 1.0)


def test_model_routers_take_the_kernel_where_it_applies() -> None:
    """``route`` runs softmax routers (Qwen/OLMoE style, Mixtral style) through ``ft_route``: the same ids as torch and
    the weights within a few ulps; a correction bias (DeepSeek-V3 style) keeps torch's path."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 32, generator=g), torch.randn(16, 32, generator=g)
    logits = x @ w.T
    for spec, mode in ((RouterSpec(norm_topk=True), 0), (RouterSpec(topk_before_scoring=True), 1)):
        ids, weights = route(x, spec, 4, w)
        ref_ids, ref_weights = reference(logits, 4, mode, spec.norm_topk, 0.0, 1.0)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
        assert torch.equal(weights, ops.route(route_logits(x, w), 4, mode, spec.norm_topk, 0.0, 1.0)[1])  # type: ignore[index]
    spec = RouterSpec(scoring="sigmoid", correction_bias=True, norm_topk=True)
    ids, _ = route(x, spec, 4, w, correction=torch.zeros(16))
    assert torch.equal(ids, torch.topk(torch.sigmoid(logits), 4, dim=-1).indices)


def route_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The router's product as ``route`` computes it (the kernels' fp32 linear)."""
    return ops.linear_f32(w, x)
