"""``TorchExperts.forward_gathered`` (the accelerator decode path: every (token, expert) pair's weights gathered by
id, one batched matmul pair, no host read of the routing) against the per-expert loop of ``forward``."""

from __future__ import annotations

import pytest
import torch

from freetoken_agent.runtime.model.moe import GATHER_PAIRS, TorchExperts
from freetoken_agent.runtime.model.spec import MoESpec, RouterSpec


def experts(activation: str = "silu", gated: bool = True, biased: bool = False, dtype: torch.dtype = torch.float32,
            e: int = 6, d: int = 32, inter: int = 24) -> TorchExperts:
    g = torch.Generator().manual_seed(0)
    rows = 2 * inter if gated else inter
    spec = MoESpec(num_experts=e, top_k=3, intermediate=inter, router=RouterSpec(), activation=activation, gated=gated)
    bias = (lambda *s: (torch.randn(*s, generator=g) / 8).to(dtype)) if biased else (lambda *s: None)
    return TorchExperts(spec, (torch.randn(e, rows, d, generator=g) / d**0.5).to(dtype),
                        (torch.randn(e, d, inter, generator=g) / inter**0.5).to(dtype), bias(e, rows), bias(e, d))


def routing(t: int, e: int = 6, k: int = 3, d: int = 32, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if t > 1:
        ids[1] = ids[0]  # two tokens on the same experts
    return torch.randn(t, d, generator=g).to(dtype), ids, torch.rand(t, k, generator=g)


@pytest.mark.parametrize("t", [1, 2, 5])
@pytest.mark.parametrize("variant", [dict(), dict(biased=True), dict(activation="gelu", gated=False),
                                     dict(activation="swiglu_oai", biased=True)])
def test_gathered_equals_the_per_expert_loop(t: int, variant: dict) -> None:
    ex = experts(**variant)  # unbiased fp32 SiLU: forward is the kernels' fp32 MoE on the CPU, else the loop
    x, ids, w = routing(t)
    torch.testing.assert_close(ex.forward_gathered(x, ids, w), ex.forward(x, ids, w), rtol=1e-5, atol=1e-5)


def test_bf16_gathered_is_within_rounding_of_the_loop() -> None:
    ex = experts(dtype=torch.bfloat16)
    x, ids, w = routing(4, dtype=torch.bfloat16)
    ref = experts().forward_gathered(x.float(), ids, w)
    for got in (ex.forward_gathered(x, ids, w), ex.forward(x, ids, w)):
        assert got.dtype == torch.bfloat16
        assert (got.float() - ref).abs().max() <= 0.02 * ref.abs().max()


def test_an_accelerator_decode_step_never_reads_the_routing_back() -> None:
    """On a non-CPU device, a small step takes the gathered path: on the meta device (no data at all) it runs, where
    the per-expert loop's host read of the counts would raise; a step past ``GATHER_PAIRS`` pairs takes the loop."""
    ex = experts(biased=True)
    meta = TorchExperts(ex.spec, ex.gate_up.to("meta"), ex.down.to("meta"), ex.gate_up_bias.to("meta"),
                        ex.down_bias.to("meta"))
    x, ids, w = routing(2)
    out = meta.forward(x.to("meta"), ids.to("meta"), w.to("meta"))
    assert out.shape == (2, 32) and out.device.type == "meta"
    t = GATHER_PAIRS // 3 + 1
    x, ids, w = routing(t)
    with pytest.raises(NotImplementedError, match="Meta tensors"):  # the loop's bincount, read back to the host
        meta.forward(x.to("meta"), ids.to("meta"), w.to("meta"))
