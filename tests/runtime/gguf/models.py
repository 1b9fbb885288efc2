"""Tiny random Hugging Face checkpoints for the GGUF tests: ``tests/runtime/checkpoints.py``'s configs, and the
generic tiny configs (``tests/runtime/arch_configs.py``) for types that list has not (Qwen3-Next)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.runtime import arch_configs, checkpoints


def varied_checkpoint(arch: str, folder: Path, seed: int, **overrides: Any) -> Any:
    """A tiny random checkpoint whose constant tensors at init (zero biases, unit norm weights) get random values
    too, so a bias or norm read from the wrong GGUF tensor (or not read at all) changes the logits."""
    make = checkpoints.make_model if arch in checkpoints.ARCHITECTURES else arch_configs.make_model
    model = make(arch, seed, **overrides)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1 and bool((p == p.reshape(-1)[0]).all()):
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(folder)
    return model
