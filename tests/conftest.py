"""Suite-wide setup that must happen before any test module imports triton.

Without a GPU, Triton kernels are tested under the interpreter. The mode is fixed when a ``@triton.jit`` function is
decorated, so it must be set before *anything* (our kernels, or transformers' own Triton helpers pulled in by some
architectures) imports triton; otherwise kernels decorated earlier in compiled mode break the interpreter later in
the same process.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The engine's default KV cache on the CPU is fp16 (runtime/kv/pool.py); the suite's oracle comparisons (logits
# within 1e-4 of transformers, exact greedy decodes) are fp32 properties, so ``auto`` means fp32 here. 16-bit
# caches are tested by passing ``kv_dtype`` explicitly (tests/runtime/kv/test_kv16.py, kernels/test_attn_kv16.py).
os.environ.setdefault("FREETOKEN_KV_DTYPE", "fp32")
