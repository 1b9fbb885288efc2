"""ggml's own quantizer (``ggml_quantize_chunk`` in the ``libggml-base`` that ``llama-cpp-python`` ships), for tests
that compare our quantizers' bytes with ggml's; the test is skipped where that library is not installed."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

GGML_TYPE = {"q4_k": 12, "q5_k": 13, "mxfp4": 39}
"""ggml's ``ggml_type`` codes of the formats compared."""


def ggml_quantize(w: torch.Tensor, fmt: str, block_bytes: int, block_values: int) -> torch.Tensor:
    """``w [N, K]`` fp32 → ggml's blocks ``[N, K / block_values, block_bytes]`` (its reference quantizer: no
    importance matrix)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    lib = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    if not lib.exists():
        pytest.skip(f"no {lib}")
    fn = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL).ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p]  # fmt: skip
    w = w.float().contiguous()
    n, k = w.shape
    out = torch.empty(n, k // block_values, block_bytes, dtype=torch.uint8)
    written = fn(GGML_TYPE[fmt], w.data_ptr(), out.data_ptr(), 0, n, k, None)
    assert written == out.numel(), f"ggml wrote {written} bytes of {fmt}, expected {out.numel()}"
    return out
