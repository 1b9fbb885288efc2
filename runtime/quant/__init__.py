"""Quantized weight formats: GGUF-compatible Q8_0 / Q4_0 / K-quant / MXFP4 blocks, and readers for native FP8-block
and MXFP4 checkpoints.

``blocks`` quantizes (round-to-nearest, with a cheap refinement for q4) and dequantizes; ``q4k`` / ``q5k`` / ``q6k``
do the same for GGUF's Q4_K / Q5_K / Q6_K super-blocks, ``mxfp4`` for its MXFP4 blocks; ``fp8`` and ``mxfp4`` decode
checkpoint tensors as stored. The kernels that compute with these formats live in ``runtime/kernels``.
"""

from .blocks import BLOCK, BLOCK_BYTES, BlockQuantized, canonical_format, dequantize, from_gguf_bytes, quantize
from .fp8 import dequantize_fp8_block, quantize_fp8_block
from .mxfp4 import MXFP4_BYTES, dequantize_mxfp4, dequantize_mxfp4_blocks, quantize_mxfp4, quantize_mxfp4_blocks
from .q4k import Q4_K_BYTES, dequantize_q4_k, quantize_q4_k
from .q5k import Q5_K_BYTES, dequantize_q5_k, quantize_q5_k
from .q6k import Q6_K_BYTES, dequantize_q6_k, quantize_q6_k

__all__ = [
    "BLOCK",
    "BLOCK_BYTES",
    "BlockQuantized",
    "MXFP4_BYTES",
    "Q4_K_BYTES",
    "Q5_K_BYTES",
    "Q6_K_BYTES",
    "canonical_format",
    "dequantize",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "dequantize_mxfp4_blocks",
    "dequantize_q4_k",
    "dequantize_q5_k",
    "dequantize_q6_k",
    "from_gguf_bytes",
    "quantize",
    "quantize_fp8_block",
    "quantize_mxfp4",
    "quantize_mxfp4_blocks",
    "quantize_q4_k",
    "quantize_q5_k",
    "quantize_q6_k",
]
