"""Triton GPU kernels: dequant-GEMM (split-K GEMV + tiled GEMM), a grouped MoE GEMM over expert slots, and the
slot kernels that compute experts from a slot pool's own bytes (GGUF blocks or the C kernels' tiles).

Each kernel has a launcher that checks shapes/strides, a plain-torch reference, and a test that runs under
``TRITON_INTERPRET=1`` on the CPU. Importing this package does not import triton.
"""

from .dequant_gemm import TritonQuantWeight, dequant_matmul, reference_matmul
from .moe_gemm import (
    SLOT_FORMATS,
    SlotWeights,
    TritonQuantExperts,
    align_by_slot,
    grouped_matmul,
    moe_forward,
    reference_moe_forward,
    slots_matmul,
)

__all__ = [
    "SLOT_FORMATS",
    "SlotWeights",
    "TritonQuantExperts",
    "TritonQuantWeight",
    "align_by_slot",
    "dequant_matmul",
    "grouped_matmul",
    "moe_forward",
    "reference_matmul",
    "reference_moe_forward",
    "slots_matmul",
]
