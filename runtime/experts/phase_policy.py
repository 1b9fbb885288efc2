"""The phase-aware eviction policy and the per-phase switch tuning used by ``PhaseScheduler`` (``phase.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from freetoken_agent.runtime.experts.phase_profiles import Key, PhaseProfiles
from freetoken_agent.runtime.experts.policies import HeatPolicy


@dataclass(frozen=True)
class SwitchTuning:
    """How a switch into one phase is handled."""

    onset_tokens: int
    """The phase's first tokens after its hint are also profiled on their own (``onset_key``): they are what a
    switch needs first, and they repeat turn after turn (the same framing, the same way of starting a call)."""
    reserve_tokens: int
    """Staged keys are reserved (evicted last) for this many tokens of the new phase..."""
    reserve_fraction: float
    """...at most this share of the slots (the hottest staged keys)."""


TUNING = {"plan": SwitchTuning(8, 8, 0.5), "code": SwitchTuning(16, 16, 0.9), "tool": SwitchTuning(8, 8, 0.5)}
"""Chosen on training sessions (never on the held-out ones the benchmark reports): a plan turn starts with a short
burst (framing + first words) and then wanders, so its onset is short and half the slots are held; a tool call is
regular for longer, so code holds nearly all staged keys for 16 tokens."""


def onset_key(phase: str) -> str:
    """The profile name of ``phase``'s first ``TUNING[phase].onset_tokens`` tokens."""
    return f"{phase}@onset"


class PhaseSchedulingPolicy(HeatPolicy):
    """Blend of per-token heat (recency) and the current phase's routing profile; reserved keys stay.

    ``weight`` 2 was chosen on training sessions (switch misses 3,657 at 1, 3,587 at 2, 3,590 at 3, 3,604 at 4).
    """

    name = "phase-sched"

    def __init__(self, profiles: PhaseProfiles, top_k: int, weight: float = 2.0, decay: float = 0.9) -> None:
        super().__init__(decay)
        self.profiles, self.top_k, self.weight = profiles, top_k, weight
        self.phase = "plan"
        self.reserved: set[Key] = set()
        self.faster: Any = None
        """The device slot pool in front of this (host) pool, if any: keys it holds are not read from here, so
        their host copies go first (the host tier should hold what the device tier misses)."""

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def observe(self, layer: int, counts: dict[int, int]) -> None:
        """Heat per token (a 512-token prefill chunk must not outweigh every decode step that follows)."""
        tokens = sum(counts.values()) / self.top_k
        if tokens > 0:
            super().observe(layer, {e: n / tokens for e, n in counts.items()})

    def score(self, key: Key) -> float:
        return self.value(key) + self.weight * self.top_k * self.profiles.share(self.phase, key)

    def victim(self, resident: Sequence[Key | None], evictable: Callable[[Key], bool]) -> Key | None:
        """The lowest score among evictable keys (up to ``4·sample`` random ones in large pools), reserved last."""
        if len(resident) <= 4 * self.sample:
            free = [k for k in resident if k is not None and evictable(k)]
        else:  # sampled, as ``HeatPolicy`` does: eviction stays O(sample) in pools of thousands of slots
            picks = {resident[self._rng.randrange(len(resident))] for _ in range(4 * self.sample)}
            free = [k for k in picks if k is not None and evictable(k)]
            if not any(k not in self.reserved for k in free):
                free = [k for k in resident if k is not None and evictable(k)]
        if not free:
            return None
        pool = [k for k in free if k not in self.reserved] or free
        faster = self.faster
        return min(pool, key=lambda k: (k in self.reserved, faster is None or faster.slot_of(k) is None,
                                         self.score(k), self._last.get(k, -1)))
