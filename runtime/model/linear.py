"""The fp32 dense product every model module uses (``dense_linear``): on the kernels' batch-invariant fp32 linear
where it can run, torch's otherwise. Its own module so that the attention helpers below ``layers`` (the
sparse-attention indexer) use it too."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken_agent.runtime.kernels import invariant
from freetoken_agent.runtime.kernels import ops as kops

F32 = torch.float32


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; fp32 CPU products go through the kernels' fp32 linear when they are loaded. At decode it streams
    the weight on every pool thread, where torch's GEMV often uses one; in prefill it beats torch's GEMM (0.45-0.8x
    its time on a Zen 4, 9-512 rows, 1 and 2 threads: evals/perf/RESULTS.md). It reduces each row in one fixed
    order, so those products are batch invariant by default, whatever the weight's size (small weights used to stay
    in torch at decode, a few µs faster op by op; the fused decode step runs every product on the kernels, and a
    verify row must give its tokens' decode-step bits). Deterministic mode: that kernel for every product."""
    if on_kernels(x, weight, bias):
        return kops.linear_f32(weight, x, bias)
    if kops.deterministic():
        return invariant.linear(x, weight, bias)
    return F.linear(x, weight, bias)



def on_kernels(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``dense_linear`` runs this product on the kernels' fp32 linear (see there)."""
    return (
        x.dtype is F32
        and weight.dtype is F32
        and x.dim() == 2
        and (bias is None or bias.dtype is F32)
        and weight.is_cpu
        and weight.numel() > 0  # a zero-width MLP (shared size 0) is torch's: the C GEMM wants a real matrix
        and weight.is_contiguous()
        and x.is_contiguous()
        and kops.fast() is not None
    )
