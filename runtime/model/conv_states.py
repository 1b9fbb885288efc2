"""Per-sequence states of several stateful pieces of one layer, kept as slots of the layer's one recurrent state.

Legend: T new tokens, C channels, K kernel width. An Inkling layer carries four convolutions — on the keys, the
values, the mixer output and the FFN output — each needing the last K-1 inputs of the sequence (ZAYA: its q/k
convolution and delayed values; Qwen4-Exp: a Gated DeltaNet's two tensors beside its n-gram embeddings' two). They
are kept as one recurrent state per layer (``KVCache.get_state`` / ``set_state``: committed at ``advance``,
snapshotted by prefix caches like any hybrid model's state), a tuple with one tensor per slot; a slot not yet written
holds an empty tensor. Within one forward the slots of a layer are updated at different points, so the new tensors are
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


class SlotView:
    """A layer's state seen, by one user, as slots ``first .. first + width`` of its ``SLOTS``-wide tuple (one
    sequence, one forward). It has ``KVCache``'s ``get_state`` / ``set_state``, so a mixer written for a whole state
    (Gated DeltaNet) can share its layer with others (Qwen4-Exp's per-layer embeddings)."""

    def __init__(self, cache: KVCache, scratch: dict, first: int, width: int) -> None:
        self.cache, self.scratch, self.first, self.width = cache, scratch, first, width

    def get_state(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        committed = self.cache.get_state(layer)
        if committed is None:
            return None
        part = committed[self.first : self.first + self.width]
        return None if any(t.numel() == 0 for t in part) else tuple(part)

    def set_state(self, layer: int, *tensors: torch.Tensor) -> None:
        pending = self.scratch.get(("conv_states", layer))
        if pending is None:
            committed = self.cache.get_state(layer)
            empty = torch.empty(0, device=tensors[0].device)
            pending = self.scratch[("conv_states", layer)] = list(committed or ()) or [empty] * SLOTS
        pending[self.first : self.first + self.width] = tensors
        self.cache.set_state(layer, *pending)


def slot_conv(x: torch.Tensor, cache: KVCache, scratch: dict, layer: int, slot: int, conv: ConvFn) -> torch.Tensor:
    """Run ``conv`` on x [T, C] continuing ``slot`` of ``layer``'s state; record the new state for ``advance``."""
    view = SlotView(cache, scratch, slot, 1)
    previous = view.get_state(layer)
    y, state = conv(x, None if previous is None else previous[0])
    view.set_state(layer, state)
    return y
