"""Residency policies: which expert leaves a full slot pool. One small interface, chosen by name.

A policy sees integers only: keys ``(layer, expert)``, routing counts, the phase. The pool tells it about every
access (``touch``), insertion and eviction, and asks it for a victim among the evictable keys.

- ``lru``: least recently used (the reference server's policy).
- ``heat``: frequency with decay — an EMA of routing counts per key, updated from every routing decision; the
  coldest key leaves (ties: least recently used).
- ``phase``: the interface for phase-aware residency — heat kept per agent phase, and ``hot_set(phase)`` to
  stage on a phase hint. Eviction uses the current phase's heat. (The phase-scheduling issue fills in staging.)
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

Key = tuple[int, int]
"""(layer, expert)."""


class ResidencyPolicy(Protocol):
    """Chooses eviction victims for one slot pool."""

    name: str

    def touch(self, key: Key) -> None:
        """``key`` was used (hit or just loaded)."""

    def observe(self, layer: int, counts: dict[int, int]) -> None:
        """A routing decision: tokens sent to each expert of ``layer``."""

    def forget(self, key: Key) -> None:
        """``key`` left the pool."""

    def victim(self, resident: Sequence[Key | None], evictable: Callable[[Key], bool]) -> Key | None:
        """The key to evict among ``resident`` (the pool's slot owners) for which ``evictable(key)``, or None."""


class LRUPolicy:
    """Evict the least recently used expert."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def touch(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def observe(self, layer: int, counts: dict[int, int]) -> None:
        pass

    def forget(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, resident: Sequence[Key | None], evictable: Callable[[Key], bool]) -> Key | None:
        for key in self._order:  # oldest first: usually the first one or two qualify
            if evictable(key):
                return key
        return next((k for k in resident if k is not None and evictable(k)), None)


class HeatPolicy:
    """Evict the coldest expert: heat = EMA of tokens routed per step (``decay`` per routing step of its layer).

    Decay is lazy (value and the layer step it was last updated at), so a routing step costs O(experts hit).
    """

    name = "heat"

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.heat: dict[Key, tuple[float, int]] = {}
        self.steps: dict[int, int] = {}
        self.sample = 32
        self._rng = random.Random(0)
        self._last: dict[Key, int] = {}
        self._tick = 0

    def value(self, key: Key) -> float:
        v, at = self.heat.get(key, (0.0, 0))
        return v * self.decay ** (self.steps.get(key[0], 0) - at)

    def touch(self, key: Key) -> None:
        self._tick += 1
        self._last[key] = self._tick

    def observe(self, layer: int, counts: dict[int, int]) -> None:
        step = self.steps.get(layer, 0) + 1
        self.steps[layer] = step
        for e, n in counts.items():
            key = (layer, e)
            self.heat[key] = (self.value(key) + (1 - self.decay) * n, step) if key in self.heat else (
                (1 - self.decay) * n, step)

    def forget(self, key: Key) -> None:
        self._last.pop(key, None)

    def victim(self, resident: Sequence[Key | None], evictable: Callable[[Key], bool]) -> Key | None:
        """The coldest of up to ``sample`` random evictable keys (all of them in small pools); ties: least recent.

        Sampling keeps eviction O(sample) in pools of thousands of slots (the approximate-LFU of caches like Redis).
        """
        if len(resident) <= 2 * self.sample:
            pool = [k for k in resident if k is not None and evictable(k)]
        else:
            pool = []
            for _ in range(4 * self.sample):
                k = resident[self._rng.randrange(len(resident))]
                if k is not None and k not in pool and evictable(k):
                    pool.append(k)
                    if len(pool) == self.sample:
                        break
            if not pool:
                pool = [k for k in resident if k is not None and evictable(k)]
        if not pool:
            return None
        return min(pool, key=lambda k: (self.value(k), self._last.get(k, -1)))


class PhaseAwarePolicy(HeatPolicy):
    """Heat per agent phase; ``set_phase`` switches which heat drives eviction, ``hot_set`` names what to stage."""

    name = "phase"

    def __init__(self, decay: float = 0.9) -> None:
        super().__init__(decay)
        self.phase = "default"
        self._by_phase: dict[str, dict[Key, tuple[float, int]]] = {"default": self.heat}

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.heat = self._by_phase.setdefault(phase, {})

    def hot_set(self, phase: str, n: int) -> list[Key]:
        """The ``n`` hottest keys seen in ``phase`` (what a phase hint should stage), hottest first."""
        heat = self._by_phase.get(phase, {})

        def value(k: Key) -> float:
            v, at = heat[k]
            return v * self.decay ** (self.steps.get(k[0], 0) - at)

        return sorted(heat, key=value, reverse=True)[:n]


POLICIES = {"lru": LRUPolicy, "heat": HeatPolicy, "phase": PhaseAwarePolicy}


def make_policy(name: str) -> ResidencyPolicy:
    """A policy by name: ``lru``, ``heat`` or ``phase``."""
    from freetoken_agent.runtime.errors import FreeTokenError

    try:
        return POLICIES[name]()
    except KeyError:
        raise FreeTokenError(f"unknown residency policy {name!r}; expected one of {', '.join(POLICIES)}") from None
