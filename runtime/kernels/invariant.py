"""Batch-invariant ops: what ``ops.set_deterministic(True)`` routes the model's row-mixing ops through.

Legend: M rows (tokens) in a call, K reduction dim, N outputs, D normalized dim.

A greedy request must return the same tokens whatever else shares its batch and whether its KV prefix was cached
or is computed now in a prefill chunk. So with the switch on, every op computes each row (each attention query)
in one fixed order that depends on nothing but that row: not on M, not on the row's place in the batch, not on the
chunking of a prompt (the idea of vLLM's batch-invariant mode). torch's CPU ops do not promise that: its fp32
GEMM changes algorithm with M (a GEMV at M = 1, other kernels at M = 2, 3 and from 4), and its vectorized
activations (SiLU, GELU, sigmoid, softplus) compute the last ``numel % 32`` values of a call with a scalar formula
whose bits differ, so a value's bits depend on where the call's end falls.

Invariant by default (no switch needed; the tests check them bitwise):
  * quantized dense linears (``QuantLinear``, ``ops.linear``) and the fused MoE step (``ops.moe``): activations
    are quantized per row and every tile kernel (1-token and 4-token) sums a row in integer arithmetic, then in
    the same fp32 order;
  * fp32 RMSNorm (``layers.rms_norm``: the C row kernel for every size, faster than ``F.rms_norm`` at every size
    measured);
  * fp32 dense linears (``layers.dense_linear``), lm_head and the router logits of ``moe.route`` included: the C
    fp32 linear (``ops.linear_f32``) for every M and every weight size, faster than torch's GEMM at every M
    measured;
  * the C rotary embedding and the torch rotary formula (bitwise equal: elementwise, no reduction); the C decode
    attention.
Only with the switch (what each costs: evals/perf/RESULTS.md):
  * bf16 dense linears → ``linear`` (C ``ft_gemm_f32`` for every M, fixed order);
  * bf16 RMSNorm, unit RMSNorm and LayerNorm → the C row norm;
  * reference experts (``TorchExperts``, float ``ManagedExperts``) → ``linear`` per expert;
  * quantized experts never switch to dequantize + ``torch.mm`` by tokens per expert (the int8 kernels for all);
  * activations and gates → ``pointwise`` (whole vectors only, one thread per piece);
  * attention: every query through the C split-over-keys kernel over its own key range, exactly as a decode step
    computes it (masks that are not one key range per query: one torch call per query over its visible keys).
Everything here runs on the CPU; other devices keep torch's ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import ops

PIECE = 1 << 14
"""Values per ``pointwise`` call: below torch's parallel grain (32768), so one thread runs each piece whole."""
WHOLE = 32
"""torch's vectorized loops step 2 x 16 fp32 values (AVX-512; 2 x 8 on AVX2): a multiple of it has no scalar tail."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x [..., K], weight [N, K], bias [N])`` with each row reduced in one fixed order (any M).

    fp32 or bf16 ``x`` and ``weight`` (bf16 is widened exactly; the fp32 sum is rounded to ``x``'s dtype at the
    end); other dtypes are converted to fp32 first. Non-CPU tensors go to ``F.linear``.
    """
    if x.device.type != "cpu" or weight.device.type != "cpu":
        return torch.nn.functional.linear(x, weight, bias)
    n, k = weight.shape
    if weight.dtype not in (torch.float32, torch.bfloat16):
        weight = weight.float()
    rows = x.reshape(-1, k)
    rows = rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.float().contiguous()
    b = None if bias is None else bias.float().contiguous()
    y = ops.linear_f32(weight.contiguous(), rows, b)  # [M, N]
    y = y.view(*x.shape[:-1], n)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32 with the C row kernel (every size), HF order for low-precision ``x``:
    normalize in fp32, cast back, then scale."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    rows = rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.float().contiguous()
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        return ops.rms_norm(rows, None if weight is None else weight.contiguous(), eps).view(x.shape)
    normed = ops.rms_norm(rows, None, eps).view(x.shape).to(x.dtype)
    return normed if weight is None else weight * normed


_ones: dict[int, torch.Tensor] = {}


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Mean-centred LayerNorm in fp32: the row mean is a fixed-order dot with ones (``linear``), the rest the C
    RMSNorm of the centred row; then scale (and shift) and cast back to ``x``'s dtype."""
    d = x.shape[-1]
    if d not in _ones:
        _ones[d] = torch.ones(1, d)
    h = x.reshape(-1, d).float().contiguous()  # [M, D]
    centred = h - ops.linear_f32(_ones[d], h) / d
    out = weight.float() * ops.rms_norm(centred, None, eps)
    if bias is not None:
        out = out + bias.float()
    return out.view(x.shape).to(x.dtype)


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn`` (SiLU, GELU, sigmoid, softplus, ...) with every value computed by
    torch's vectorized formula, never its scalar tail: the values go through ``fn`` in pieces of ``PIECE``, the last
    one padded with zeros to a whole number of vectors."""
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    whole = -(-n // WHOLE) * WHOLE
    if whole != n:
        flat = torch.cat([flat, flat.new_zeros(whole - n)])
    if whole <= PIECE:
        return fn(flat)[:n].view(x.shape)
    out = torch.cat([fn(flat[a : a + PIECE]) for a in range(0, whole, PIECE)])
    return out[:n].view(x.shape)
