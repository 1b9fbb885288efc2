"""A prompt as token ids: one normalization for every entry point (engine, scheduler, server, CLI).

Range checks that need the model (ids inside the vocabulary, length inside the context) are the scheduler's, at
``submit``; this module makes sure what reaches them is a flat list of Python integers, so a float id is not
truncated, ``True`` is not token 1, and an id like ``2**70`` is reported as outside the vocabulary instead of
overflowing a tensor conversion.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from freetoken_agent.runtime.errors import PromptError


def as_token_ids(token_ids: Any) -> list[int]:
    """``token_ids`` as a list of ints: a list/tuple of integers, or an integer tensor/array of shape [T] or [1, T].

    Raises ``PromptError`` naming the first offending item for anything else (floats, booleans, strings, nested
    lists, a batch of several prompts).
    """
    if isinstance(token_ids, torch.Tensor) or (hasattr(token_ids, "dtype") and hasattr(token_ids, "tolist")):
        tensor = torch.as_tensor(token_ids) if not isinstance(token_ids, torch.Tensor) else token_ids
        if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
            raise PromptError(f"prompt token ids must be integers, got a tensor of {tensor.dtype}")
        if tensor.dim() == 2 and tensor.shape[0] == 1:
            tensor = tensor[0]
        if tensor.dim() != 1:
            raise PromptError(f"prompt token ids must be one sequence, shape [T] or [1, T]; got {list(tensor.shape)}")
        return [int(t) for t in tensor.tolist()]
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, (list, tuple)):
        raise PromptError(f"prompt token ids must be a list of integers, got {type(token_ids).__name__} "
                          "(encode text with the tokenizer first)")
    for i, t in enumerate(token_ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise PromptError(f"prompt token id at position {i} must be an integer, got {t!r:.40}")
    return [int(t) for t in token_ids]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (slices compared in C, chunk by chunk)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i, step = 0, 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i
