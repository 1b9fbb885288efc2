"""Per-sequence states of the short causal convolutions inside an attention layer (Inkling).

Legend: T new tokens, C channels, K kernel width. An Inkling layer carries four convolutions — on the keys, the
values, the mixer output and the FFN output — each needing the last K-1 inputs of the sequence. They are kept as one
recurrent state per layer (``KVCache.get_state`` / ``set_state``: committed at ``advance``, snapshotted by prefix
caches like any hybrid model's state), a tuple with one [K-1, C] tensor per slot; a slot not yet written holds an
empty tensor. Within one forward the slots of a layer are updated at different points, so the new tensors are
gathered in the sequence's per-forward ``scratch`` and the layer's whole tuple is re-recorded after each update.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from freetoken_agent.runtime.kv.cache import KVCache

KEY, VALUE, MIXER, FFN = range(4)
"""Slots of a layer's state tuple."""
SLOTS = 4

ConvFn = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
"""``(x [T, C], previous inputs [K-1, C] or None) -> (y [T, C], the last K-1 inputs [K-1, C])``."""


def slot_conv(x: torch.Tensor, cache: KVCache, scratch: dict, layer: int, slot: int, conv: ConvFn) -> torch.Tensor:
    """Run ``conv`` on x [T, C] continuing ``slot`` of ``layer``'s state; record the new state for ``advance``."""
    committed = cache.get_state(layer)
    pending = scratch.get(("conv_states", layer))
    if pending is None:
        empty = torch.empty(0, device=x.device)
        pending = scratch[("conv_states", layer)] = list(committed) if committed is not None else [empty] * SLOTS
    previous = committed[slot] if committed is not None else None
    y, state = conv(x, previous if previous is not None and previous.numel() else None)
    pending[slot] = state
    cache.set_state(layer, *pending)
    return y


def check_states(cache: KVCache, layers: list[int]) -> None:
    """Raise (before any cache is touched) if a stateful layer's state is not at the cache's position."""
    for i in layers:
        cache.get_state(i)
