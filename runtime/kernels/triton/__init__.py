"""Triton GPU kernels: dequant-GEMM (split-K GEMV + tiled GEMM) and a grouped MoE GEMM over expert slots.

Each kernel has a launcher that checks shapes/strides, a plain-torch reference, and a test that runs under
``TRITON_INTERPRET=1`` on the CPU. Importing this package does not import triton.
"""

from .dequant_gemm import TritonQuantWeight, dequant_matmul, reference_matmul
from .moe_gemm import TritonQuantExperts, align_by_slot, grouped_matmul, moe_forward, reference_moe_forward

__all__ = [
    "TritonQuantExperts",
    "TritonQuantWeight",
    "align_by_slot",
    "dequant_matmul",
    "grouped_matmul",
    "moe_forward",
    "reference_matmul",
    "reference_moe_forward",
]
