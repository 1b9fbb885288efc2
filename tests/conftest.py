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
