"""CPU expert kernels (a small C library built at first use, loaded with ctypes) and Triton GPU kernels.

``ops`` wraps the C entry points (int8-activation GEMV over repacked Q8_0/Q4_0 weights, dequantize, one fused
call per MoE layer step) with a torch fallback; ``experts.QuantizedExperts`` is the MoE layer's expert backend.
"""

from .build import KernelStatus, status
from .experts import QuantizedExperts

__all__ = ["KernelStatus", "QuantizedExperts", "status"]
