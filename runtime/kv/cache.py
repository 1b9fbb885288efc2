"""A simple contiguous per-sequence KV cache.

Each layer keeps a list of tensors whose first dimension is the position (GQA: keys [S, Hkv, Dh] and values
[S, Hkv, Dv]; MLA: the compressed latent [S, rank] and the shared rotary key [S, R]). Storage grows by doubling so
appends are amortized O(1). Paging and prefix sharing live elsewhere; this is the exact baseline they must match.
"""

from __future__ import annotations

import torch


class RecurrentStates:
    """Per-layer recurrent state (Gated DeltaNet, Mamba, short conv, ...) kept beside the KV of a sequence.

    A state summarizes every earlier position and cannot be rewound: it is valid only for the position it was
    committed at. A prefix cache must snapshot states where it wants to reuse them (``snapshot_states``) and put
    them back (``restore_states``) after truncating to that position.
    """

    length: int

    def _init_states(self) -> None:
        self._states: dict[int, tuple[int, tuple[torch.Tensor, ...]]] = {}
        self._pending_states: dict[int, tuple[torch.Tensor, ...]] = {}

    def _commit_states(self) -> None:
        for layer, tensors in self._pending_states.items():
            self._states[layer] = (self.length, tensors)
        self._pending_states.clear()

    @property
    def has_states(self) -> bool:
        return bool(self._states)

    def get_state(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """The recurrent state of ``layer`` at position ``length`` (None before the layer's first forward)."""
        entry = self._states.get(layer)
        if entry is None:
            if self.length:
                raise ValueError(f"layer {layer} has no recurrent state for position {self.length}")
            return None
        position, tensors = entry
        if position != self.length:
            raise ValueError(
                f"layer {layer} holds its recurrent state for position {position}, not {self.length}: "
                "recurrent layers cannot be rewound without a snapshot"
            )
        return tensors

    def set_state(self, layer: int, *tensors: torch.Tensor) -> None:
        """Record ``layer``'s state after the current forward; it becomes the state for ``length`` at ``advance()``."""
        self._pending_states[layer] = tensors

    def snapshot_states(self) -> dict[int, tuple[torch.Tensor, ...]]:
        """Every layer's state at the current position (tensors are replaced, never mutated, so no copy)."""
        return {layer: tensors for layer, (pos, tensors) in self._states.items() if pos == self.length}

    def restore_states(self, snapshot: dict[int, tuple[torch.Tensor, ...]]) -> None:
        """Make ``snapshot`` (taken at the current ``length``) the committed states."""
        self._pending_states.clear()
        self._states = {layer: (self.length, tensors) for layer, tensors in snapshot.items()}

    def clear_states(self) -> None:
        self._states.clear()
        self._pending_states.clear()

    def states_nbytes(self) -> int:
        return sum(t.element_size() * t.numel() for _, ts in self._states.values() for t in ts)


class KVCache(RecurrentStates):
    """Contiguous cache for one sequence over ``num_layers`` layers."""

    def __init__(self, num_layers: int) -> None:
        self._store: list[list[torch.Tensor] | None] = [None] * num_layers
        self.length = 0
        """Positions already cached (the position of the next token)."""
        self._pending = 0
        self._init_states()

    def append(self, layer: int, *parts: torch.Tensor, stored: bool = False) -> list[torch.Tensor]:
        """Append this step's tensors for ``layer`` (each [T, ...]) and return views of all cached positions.
        ``stored`` (the paged cache's option to get a 16-bit pool's own tensors): this cache stores ``parts`` as
        they come, so it changes nothing."""
        t = parts[0].shape[0]
        end = self.length + t
        store = self._store[layer]
        if store is None or store[0].shape[0] < end:
            capacity = max(end, 2 * (store[0].shape[0] if store else 0), 64)
            grown = [p.new_empty((capacity, *p.shape[1:])) for p in parts]
            if store is not None:
                for g, old in zip(grown, store):
                    g[: self.length] = old[: self.length]
            store = self._store[layer] = grown
        for buf, p in zip(store, parts):
            buf[self.length : end] = p
        self._pending = t
        return [buf[:end] for buf in store]

    def cached(self, layer: int, stored: bool = False) -> list[torch.Tensor]:
        """Views of every position ``layer`` holds, this forward's appends included (a layer reading another
        layer's KV: Gemma 4 KV sharing); ``stored`` as in ``append``."""
        store = self._store[layer]
        if store is None:
            raise ValueError(f"layer {layer} has cached nothing yet")
        return [buf[: self.length + self._pending] for buf in store]

    def reserve(self, n: int) -> None:
        """Room for ``n`` more positions: grows on ``append``, nothing to reserve (the paged cache's interface)."""

    def advance(self) -> None:
        """Commit the tokens appended by the current forward (called once after all layers)."""
        self.length += self._pending
        self._pending = 0
        self._commit_states()

    def truncate(self, length: int) -> None:
        """Forget positions ≥ ``length`` (e.g. to re-decode after a divergence)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length

    rollback = truncate  # rejected draft tokens: the contiguous cache holds no pages to keep

    def nbytes(self) -> int:
        kv = sum(t.element_size() * t.numel() for store in self._store if store for t in store)
        return kv + self.states_nbytes()
