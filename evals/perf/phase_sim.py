"""Trace-driven replay of one residency policy on a real ``SlotPool``, in virtual time.

The pool, its eviction rules and the policies (``lru``, ``heat``, the ``phase`` placeholder, and
``PhaseScheduler``'s staging and pause prefetch) are the runtime's own objects; only time is simulated, from
measured costs (``Costs``): each MoE layer step computes for its share of a token's decode (or prefill) time;
an expert that is not in a ready slot is read on demand (``read_s``, the caller waits: stall); staged reads
queue on one background reader and complete ``read_s`` apart (an access to one still loading waits for it:
stall). Demand and background reads proceed in parallel (two reader threads, as in the store).

A "miss" here is any access that found its expert not ready (absent, or still loading). A *phase-switch* window
opens at every ``plan``/``code`` hint and lasts until ``window`` tokens of that phase have been generated
(including the turn's framing prefill before them); a ``tool`` window is the first chunk of the tool output.
"""

from __future__ import annotations

import heapq
import statistics
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from freetoken_agent.evals.perf.phase_trace import Segment, Trace, segments
from freetoken_agent.runtime.experts.pool import SlotPool

PAUSE_CHUNK = 64
"""Tool output arrives and is prefilled in chunks of this many tokens while the tool runs."""
PREFILL_CHUNK = 512


@dataclass(frozen=True)
class Costs:
    """Measured costs on this machine (see ``phase_replay.measure_costs``)."""

    decode_s: float
    """One generated token, all experts resident."""
    prefill_s: float
    """One prefilled token (chunked), all experts resident."""
    read_s: float
    """One expert from the cache file into a host slot."""
    blob_bytes: int


@dataclass
class Result:
    """Counters of one policy over the replayed sessions."""

    accesses: int = 0
    misses: int = 0
    switch_misses: dict[str, int] = field(default_factory=lambda: {"plan": 0, "code": 0, "tool": 0})
    switches: dict[str, int] = field(default_factory=lambda: {"plan": 0, "code": 0, "tool": 0})
    stall_s: float = 0.0
    visible_stall_s: float = 0.0
    """Stall outside tool pauses (what the user waits for)."""
    decode_tokens: int = 0
    decode_time_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    staged: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ttft = self.ttft_s[1:] or self.ttft_s  # the first turn prefills the whole system prompt: same for all
        return {
            "switch_misses": self.switch_misses["plan"] + self.switch_misses["code"],
            "switch_misses_by_phase": dict(self.switch_misses), "switches": dict(self.switches),
            "misses": self.misses, "hit_rate": round(1 - self.misses / self.accesses, 4) if self.accesses else None,
            "stall_s": round(self.stall_s, 4), "visible_stall_s": round(self.visible_stall_s, 4),
            "ttft_median_ms": round(1e3 * statistics.median(ttft), 3) if ttft else None,
            "ttft_mean_ms": round(1e3 * statistics.fmean(ttft), 3) if ttft else None,
            "decode_tok_s": round(self.decode_tokens / self.decode_time_s, 2) if self.decode_time_s else None,
            **({"phase_scheduler": self.staged} if self.staged else {}),
        }


class _Inline:
    """An executor that runs the submitted call at once (the call only schedules a virtual-time read)."""

    def submit(self, fn: Any, *args: Any) -> Future:
        fut: Future = Future()
        fut.set_result(fn(*args))
        return fut


class SimStore:
    """What ``PhaseScheduler`` needs of an ``ExpertStore``: the host pool and a background fill."""

    def __init__(self, sim: Replay) -> None:
        self.sim, self.host, self._executor = sim, sim.pool, _Inline()
        self.device = None  # one tier: host slots over the disk

    def _fill_host(self, key: tuple[int, int], slot: int) -> None:
        self.sim.background_read(slot)


class Replay:
    """One policy over traces; ``scheduler`` (a ``PhaseScheduler`` over ``SimStore``) for phase-aware runs."""

    def __init__(self, pool: SlotPool, costs: Costs, n_layers: int, window: int = 16) -> None:
        self.pool, self.costs, self.n_layers, self.window = pool, costs, n_layers, window
        self.scheduler: Any = None
        self.clock = self.bg_free = 0.0
        self._loading: list[tuple[float, int]] = []
        self.result = Result()
        self._in_pause = False
        self._switch: str | None = None
        self._switch_left = 0

    # ---------------------------------------------------------------- reads in virtual time

    def background_read(self, slot: int) -> None:
        start = max(self.clock, self.bg_free)
        self.bg_free = start + self.costs.read_s
        heapq.heappush(self._loading, (self.bg_free, slot))

    def _complete(self, until: float) -> None:
        while self._loading and self._loading[0][0] <= until:
            _, slot = heapq.heappop(self._loading)
            self.pool.ready(slot)

    def _wait(self, seconds: float) -> None:
        self.clock += seconds
        self.result.stall_s += seconds
        if not self._in_pause:
            self.result.visible_stall_s += seconds

    # ---------------------------------------------------------------- one MoE layer step

    def step(self, layer: int, counts: dict[int, int], tokens: int, compute_s: float) -> None:
        pool, res = self.pool, self.result
        pool.policy.observe(layer, counts)
        if self.scheduler is not None:
            self.scheduler.observe_counts(layer, counts, tokens)
        held = []
        for e in sorted(counts):
            key = (layer, e)
            self._complete(self.clock)
            slot = pool.slot_of(key)
            ready = slot is not None and slot not in pool.loading
            if slot is None:
                while (slot := pool.claim(key)) is None:  # every free slot is loading: wait for the first
                    when = self._loading[0][0]
                    self._wait(max(0.0, when - self.clock))
                    self._complete(self.clock)
                self._wait(self.costs.read_s)
                pool.ready(slot)
            elif not ready:
                when = next(t for t, s in self._loading if s == slot)
                self._wait(max(0.0, when - self.clock))
                self._complete(self.clock)
            res.accesses += 1
            if not ready:
                res.misses += 1
                if self._switch is not None:
                    res.switch_misses[self._switch] += 1
            pool.use(slot)
            held.append(slot)
        self.clock += compute_s
        for slot in held:
            pool.unuse(slot)

    def _tokens(self, ids: list[list[list[int]]], layers: list[int], a: int, b: int, per_token_s: float) -> None:
        """Tokens ``[a, b)`` as one forward: each layer routes them all, then computes its share."""
        for j, layer in enumerate(layers):
            counts: dict[int, int] = {}
            for t in range(a, b):
                for e in ids[t][j]:
                    counts[e] = counts.get(e, 0) + 1
            self.step(layer, counts, b - a, per_token_s * (b - a) / len(layers))

    # ---------------------------------------------------------------- a session

    def hint(self, phase: str, expected_s: float | None) -> None:
        if self.scheduler is not None:
            self.scheduler.on_hint(phase, expected_s)
        elif hasattr(self.pool.policy, "set_phase"):
            self.pool.policy.set_phase(phase)

    def run(self, trace: Trace) -> None:
        ids = trace.ids.tolist()  # [T][L][K]
        res, c = self.result, self.costs
        pause_end, turn_t0 = 0.0, None
        segs = segments(trace)
        for i, seg in enumerate(segs):
            if seg.kind != "pause" and self._in_pause:
                self.clock = max(self.clock, pause_end)  # the tool ends
                self._in_pause = False
            if seg.hint is not None:
                if seg.hint == "tool":
                    group = self._pause_group(segs, i)
                    pause_start, pause_end = self.clock, self.clock + seg.pause_s
                    self._in_pause = True
                self.hint(seg.hint, seg.pause_s if seg.hint == "tool" else None)
                self._switch = seg.hint
                self._switch_left = PAUSE_CHUNK if seg.hint == "tool" else self.window
                res.switches[seg.hint] += 1
                if seg.turn_start:
                    turn_t0 = self.clock
            if seg.kind == "decode":
                for t in range(seg.start, seg.end):
                    t0 = self.clock
                    self._tokens(ids, trace.layers, t, t + 1, c.decode_s)
                    res.decode_tokens += 1
                    res.decode_time_s += self.clock - t0
                    if turn_t0 is not None:
                        res.ttft_s.append(self.clock - turn_t0)
                        turn_t0 = None
                    self._switch_left -= 1
                    if self._switch_left <= 0:
                        self._switch = None
            elif seg.kind == "prefill":
                opened, self._switch = self._switch, self._switch if seg.end - seg.start <= PAUSE_CHUNK else None
                for a in range(seg.start, seg.end, PREFILL_CHUNK):  # the session start is no phase switch
                    self._tokens(ids, trace.layers, a, min(seg.end, a + PREFILL_CHUNK), c.prefill_s)
                self._switch = opened
            else:  # the tool output streams in while the tool runs; each chunk is prefilled once it has arrived
                first, total = group
                for a in range(seg.start, seg.end, PAUSE_CHUNK):
                    b = min(seg.end, a + PAUSE_CHUNK)
                    arrival = pause_start + (pause_end - pause_start) * (b - first) / total
                    self.clock = max(self.clock, arrival)
                    self._tokens(ids, trace.layers, a, b, c.prefill_s)
                    if self._switch == "tool":
                        self._switch_left -= b - a
                        if self._switch_left <= 0:
                            self._switch = None  # the tool window is the output's first chunk of tokens
        self._complete(float("inf"))
        self.clock = max(self.clock, self.bg_free)

    @staticmethod
    def _pause_group(segs: list[Segment], i: int) -> tuple[int, int]:
        """(first token, token count) of the pause starting at segment ``i`` and its continuation segments."""
        j = i + 1
        while j < len(segs) and segs[j].kind == "pause" and segs[j].hint is None:
            j += 1
        return segs[i].start, max(1, segs[j - 1].end - segs[i].start)
