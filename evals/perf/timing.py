"""The one timing helper of the benchmarks: warm-up, repeats, alternating sides, median and spread, decode rates.

Every row times through these functions, so each number in a report means the same thing:

- ``repeat``: warm-up calls, then ``repeats`` timed calls of one function → ``Spread`` (median, min, max);
- ``alternate``: several sides (ours, a peer) timed in rounds whose order flips every round (A B, B A, ...), so
  drift on a shared machine hits every side alike;
- ``DecodeTiming``: decode tokens over decode seconds with each token counted exactly once. The first token of a
  generation comes out of the prefill step; the decode steps are the ones after it, so ``n`` generated tokens
  are ``n - 1`` decode tokens over the time from the first token to the last. ``from_stamps`` takes the times at
  which the tokens appeared, ``from_generation`` an engine result (its ``decode_s`` is measured by the scheduler
  from the first token to the last).

A clock is any ``() -> seconds`` callable (default ``time.perf_counter``); tests pass a fake one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
Clock = Callable[[], float]


@dataclass(frozen=True)
class Spread:
    """Repeated measurements of one quantity: their median and range."""

    median: float
    low: float
    high: float
    runs: tuple[float, ...]

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        runs = tuple(values)
        if not runs:
            raise ValueError("a spread needs at least one measurement")
        return cls(statistics.median(runs), min(runs), max(runs), runs)

    @property
    def relative(self) -> float:
        """(high - low) / median: 0 when every run agrees."""
        return (self.high - self.low) / self.median if self.median else 0.0

    def to_json(self, digits: int = 6) -> dict[str, Any]:
        return {"median": round(self.median, digits), "low": round(self.low, digits), "high": round(self.high, digits),
                "runs": [round(v, digits) for v in self.runs]}


def timed(fn: Callable[[], T], clock: Clock = time.perf_counter) -> tuple[T, float]:
    """``fn()``'s result and the seconds it took."""
    t0 = clock()
    out = fn()
    return out, clock() - t0


def repeat(fn: Callable[[], object], repeats: int, warmup: int = 1, clock: Clock = time.perf_counter,
           sync: Callable[[], object] | None = None) -> Spread:
    """Seconds per call of ``fn``: ``warmup`` untimed calls, then ``repeats`` timed ones. ``sync`` (e.g.
    ``torch.cuda.synchronize``) runs after every call inside the timing, so asynchronous work is counted."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    for _ in range(warmup):
        fn()
        if sync:
            sync()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        if sync:
            sync()
        times.append(clock() - t0)
    return Spread.of(times)


def alternate(sides: dict[str, Callable[[], T]], rounds: int, warmup: int = 1) -> dict[str, list[T]]:
    """Each side's results over ``rounds`` rounds (after ``warmup`` untimed rounds); the order of the sides flips
    every round. The functions do their own timing (they return what they measured)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    for _ in range(warmup):
        for fn in sides.values():
            fn()
    out: dict[str, list[T]] = {k: [] for k in sides}
    order = list(sides)
    for r in range(rounds):
        for label in order if r % 2 == 0 else order[::-1]:
            out[label].append(sides[label]())
    return out


@dataclass(frozen=True)
class DecodeTiming:
    """Decode tokens and the seconds of the steps that made them (the first, prefilled token excluded)."""

    tokens: int
    seconds: float

    @property
    def tok_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    @classmethod
    def from_stamps(cls, stamps: Sequence[float]) -> DecodeTiming:
        """``stamps[i]``: when token ``i`` of one generation appeared. Token 0 ends the prefill, so ``n`` stamps
        are ``n - 1`` decode tokens over ``stamps[-1] - stamps[0]``."""
        if len(stamps) < 2:
            return cls(0, 0.0)
        return cls(len(stamps) - 1, stamps[-1] - stamps[0])

    @classmethod
    def from_stream(cls, tokens: Iterable[object], clock: Clock = time.perf_counter) -> DecodeTiming:
        """Consume a token stream, stamping each token as it arrives (``from_stamps``)."""
        return cls.from_stamps([clock() for _ in tokens])

    @classmethod
    def from_generation(cls, result: Any) -> DecodeTiming:
        """An engine result with ``token_ids`` and ``decode_s`` (seconds from its first token to its last)."""
        return cls(max(0, len(result.token_ids) - 1), float(result.decode_s))

    def __add__(self, other: DecodeTiming) -> DecodeTiming:
        return DecodeTiming(self.tokens + other.tokens, self.seconds + other.seconds)
