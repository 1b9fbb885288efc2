"""Phase-aware residency: stage the coming phase's experts on a hint, prefetch during tool pauses.

The agent tells the engine what comes next (``Engine.hint``: plan, code, tool with an expected duration). This
module turns those hints into residency actions on the host slot pool:

- ``PhaseSchedulingPolicy`` (a ``ResidencyPolicy``, in ``phase_policy.py``): evicts the key with the lowest blended score
  ``heat + weight · K · share(phase, key)`` — heat is the per-token EMA of recent routing (recency), share is
  the current phase's long-run routing profile — and keeps *reserved* keys (staged for a phase that has not
  started yet) unless nothing else can go. Ties: least recently used.
- ``PhaseScheduler``: attached to an engine, it records routing per phase into ``PhaseProfiles`` (through
  ``decoder.routing_observers``), and on each hint switches the policy's phase and stages that phase's hot set
  (at most ``stage_fraction`` of the slots) as background reads into free or evictable slots. Slots in use by
  the step being computed are never evictable (the pool's rule), so staging never disturbs the current step,
  and the pool never grows, so the budget holds by construction. On a ``tool`` hint with ``pause_prefetch``,
  the pause (when the engine is idle) is spent reading the *next* phase's hot set (the plan after the tool),
  reserved so that the tool output's prefill does not evict it; bounded by what the disk can read in the
  expected pause.
- Onset scripts (``phase_script``): a phase's turn prefill and first generated tokens repeat by position (the
  framing, ``THOUGHT:``, ``<tool_call>…``), so each position has its own profile; the hint stages the first
  positions' experts ahead of the hot set, and each routed token stages the next position's.

With a device tier in front (a GPU, or a simulated one), the host pool serves only the device tier's misses, so
keys the device pool holds are neither staged nor reserved in host slots, and their host copies are evicted first.
Staging into the device tier itself is not done here (the store's device path has no way to wait for a slot that
a background copy is still filling).

Outputs are unchanged: staging only decides which tier an expert is read from, never what is computed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from freetoken_agent.runtime.experts.phase_policy import (
    TUNING,
    PhaseSchedulingPolicy,
    SwitchTuning,
    onset_key,
)
from freetoken_agent.runtime.experts.phase_profiles import (
    Key,
    PhaseProfiles,
    profile_path,
)
from freetoken_agent.runtime.experts.phase_script import (
    AHEAD,
    SCRIPT_TOKENS,
    script_key,
    script_keys,
)

__all__ = ["TUNING", "PhaseScheduler", "PhaseSchedulingPolicy", "PhaseStats", "SwitchTuning", "onset_key"]

SWITCH_WINDOW = 16
"""Tokens after a ``plan``/``code`` hint whose expert misses and stall count as the switch's (``PhaseStats``)."""
AFTER_PAUSE = "plan"
"""The phase a tool pause is followed by (after the tool output is prefilled): the model plans its next step."""


@dataclass
class PhaseStats:
    """What the scheduler did: hints seen, experts staged per phase and whether they were then used."""

    hints: list[tuple[str, float | None]] = field(default_factory=list)
    staged: dict[str, int] = field(default_factory=dict)
    used: dict[str, int] = field(default_factory=dict)
    wasted: dict[str, int] = field(default_factory=dict)
    dropped: int = 0
    """Hot keys not staged because no slot was evictable."""
    pause_bytes: int = 0
    """Bytes read during tool pauses."""
    tokens: dict[str, int] = field(default_factory=dict)
    """Tokens the engine computed in each phase (prefilled and generated)."""
    switches: dict[str, int] = field(default_factory=dict)
    switch_misses: dict[str, int] = field(default_factory=dict)
    """Host-tier misses in the first ``SWITCH_WINDOW`` tokens after each hint, per phase."""
    switch_stall_s: dict[str, float] = field(default_factory=dict)

    def snapshot(self) -> dict[str, object]:
        acc = {p: round(self.used.get(p, 0) / n, 4) for p, n in self.staged.items() if n}
        return {"hints": len(self.hints), "staged": dict(self.staged), "used": dict(self.used),
                "wasted": dict(self.wasted), "accuracy": acc, "dropped": self.dropped,
                "pause_bytes": self.pause_bytes, "tokens": dict(self.tokens), "switches": dict(self.switches),
                "switch_misses": dict(self.switch_misses),
                "switch_stall_s": {p: round(v, 4) for p, v in self.switch_stall_s.items()}}


class PhaseScheduler:
    """Phase hints → profile updates, staging and pause prefetch on an engine's ``ExpertStore``."""

    def __init__(
        self, store: Any, profiles: PhaseProfiles, top_k: int, stage_fraction: float = 0.9,
        pause_prefetch: bool = True, read_gbps: float | None = None, save_path: Path | None = None,
        script: bool = True,
    ) -> None:  # fmt: skip
        self.store, self.profiles, self.top_k = store, profiles, top_k
        self.stage_fraction, self.pause_prefetch = stage_fraction, pause_prefetch
        self.script = script
        """Stage each of a phase's first tokens' experts just ahead of it (``phase_script``)."""
        self._decoded = 0
        """Tokens generated (one-token steps) since the last hint: the script position."""
        self._script_cache: dict[tuple[str, int | None], list[Key]] = {}
        self.read_gbps = read_gbps
        self.save_path = save_path
        self.phase = "plan"
        self.policy = PhaseSchedulingPolicy(profiles, top_k)
        self.stats = PhaseStats()
        self._pending: dict[Key, str] = {}
        self._onset_left = TUNING["plan"].onset_tokens
        self._reserve_left = TUNING["plan"].reserve_tokens
        self._own_executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._window: tuple[str, int, float] | None = None
        """An open switch window: (phase, host misses, stall seconds) when it opened."""
        self._window_left = 0

    # ---------------------------------------------------------------- wiring

    @classmethod
    def attach(cls, engine: Any, profiles: PhaseProfiles | None = None, **kwargs: Any) -> PhaseScheduler:
        """Install on a budgeted engine (``engine.residency`` set): policy, routing observer, hint listener.

        Without ``profiles`` the model's saved profile is loaded (cold when there is none) and saved on ``close``.
        Call before the first generation (the host pool's policy is replaced while it is still empty).
        """
        from freetoken_agent.runtime.errors import FreeTokenError

        store = engine.residency
        if store is None:
            raise FreeTokenError("phase-aware residency needs an engine loaded under a memory budget")
        moe = [i for i, layer in enumerate(engine.spec.layers) if layer.moe is not None]
        first = engine.spec.layers[moe[0]].moe
        if profiles is None:
            path = profile_path(engine.path)
            profiles = PhaseProfiles.load(path, moe, first.num_experts)
            kwargs.setdefault("save_path", path)
        sched = cls(store, profiles, first.top_k, **kwargs)
        with store.host.lock:
            for key in store.host.resident():
                sched.policy.touch(key)
            store.host.policy = sched.policy
        sched.policy.faster = store.device
        engine.decoder.routing_observers.append(sched.observe_routing)
        engine.phase_listeners.append(sched.on_hint)
        engine.phase_scheduler = sched  # ``Engine.stats()["phase"]`` reports its snapshot
        return sched

    @staticmethod
    def of(engine: Any) -> PhaseScheduler | None:
        """The scheduler attached to ``engine`` (None when there is none)."""
        sched = getattr(engine, "phase_scheduler", None)
        return sched if isinstance(sched, PhaseScheduler) else None

    # ---------------------------------------------------------------- events

    def observe_routing(self, layer: int, topk_ids: torch.Tensor) -> None:
        """A routing decision of the running phase: profile counts, and staged keys that were used."""
        counts = torch.bincount(topk_ids.reshape(-1), minlength=self.profiles.experts).tolist()
        self.observe_counts(layer, {e: n for e, n in enumerate(counts) if n}, topk_ids.shape[0])

    def observe_counts(self, layer: int, counts: dict[int, int], tokens: int) -> None:
        """``observe_routing`` with the tokens per expert already counted (``tokens`` routed in the step)."""
        with self._lock:  # hints arrive on the agent's thread, routing on the decode thread
            self.profiles.observe(self.phase, layer, counts)
            if self._onset_left > 0:
                self.profiles.observe(onset_key(self.phase), layer, counts)
            position = self._decoded if tokens == 1 else None  # a prefill chunk: the turn's prefill position
            if self.phase != "tool" and (position is None or position < SCRIPT_TOKENS):
                self.profiles.observe(script_key(self.phase, position), layer, counts)
                if layer == self.profiles.layers[0] and self.script and self.stage_fraction > 0:
                    ahead = (0 if position is None else position) + AHEAD
                    if ahead < SCRIPT_TOKENS:  # this token is routed: stage the one AHEAD positions later
                        self.stage(self.phase, 0, reserve=False, first=self._script(self.phase, ahead))
            if layer == self.profiles.layers[-1]:
                if self.script and self.phase != "tool":  # this position has run: its keys compete on heat now
                    ahead = (0 if position is None else position + 1) + AHEAD - 1
                    done = set(self._script(self.phase, position)).difference(self._script(self.phase, ahead))
                    self.policy.reserved.difference_update(done)
                if tokens == 1:
                    self._decoded += 1
            if layer == self.profiles.layers[-1]:
                self._onset_left -= tokens
                self._reserve_left -= tokens
                if self._reserve_left <= 0 and self.phase != "tool" and self.policy.reserved:
                    self.policy.reserved.clear()  # the switch is over: staged keys compete on their heat now
            if layer == self.profiles.layers[0]:
                self.stats.tokens[self.phase] = self.stats.tokens.get(self.phase, 0) + tokens
                if self._window is not None and self._window_left <= 0:
                    self._close_window()  # before this token's experts: the window's own tokens are all done
                self._window_left -= tokens
            if self._pending:
                for e in counts:
                    if self._pending.get((layer, e)) == self.phase:
                        del self._pending[(layer, e)]
                        self.stats.used[self.phase] = self.stats.used.get(self.phase, 0) + 1

    def on_hint(self, phase: str, expected_s: float | None = None) -> None:
        """The agent announced ``phase`` (see the module docstring for what is staged)."""
        with self._lock:  # hints arrive on the agent's thread, routing on the decode thread
            self.stats.hints.append((phase, expected_s))
            self.profiles.end_turn()
            self._script_cache.clear()
            for key, p in list(self._pending.items()):  # staged for a phase that ran (or never came): settle
                if p == self.phase and p != phase:
                    self.stats.wasted[p] = self.stats.wasted.get(p, 0) + 1
                    del self._pending[key]
            self._close_window()
            if phase != "tool" and hasattr(self.store, "counters"):
                self._window = (phase, self.store.counters["host"].misses, self.store.stall_s)
                self._window_left = SWITCH_WINDOW
                self.stats.switches[phase] = self.stats.switches.get(phase, 0) + 1
            self.phase = phase
            self._decoded = 0
            tuning = TUNING.get(phase, TUNING["plan"])
            self._onset_left, self._reserve_left = tuning.onset_tokens, tuning.reserve_tokens
            self.policy.set_phase(phase)
            if phase == "tool":
                if self.pause_prefetch:  # leave a layer's worth of slots to the tool output's prefill
                    n = min(self.stage_slots(), self.store.host.n_slots - self.profiles.experts)
                    gbps = self.read_gbps or self._measured_gbps()
                    if expected_s is not None and gbps:
                        blob = self.store.host.layout.blob_bytes
                        n = min(n, int(expected_s * gbps * 1e9 // blob))
                    self.stats.pause_bytes += self.stage(AFTER_PAUSE, n, reserve=True, first=self._opening(AFTER_PAUSE))
                return
            self.stage(phase, self.stage_slots(), reserve=True, first=self._opening(phase))  # kept through the onset

    def _opening(self, phase: str) -> list[Key]:
        """What ``phase``'s prefill and first ``AHEAD`` tokens need, in the order they need it (``phase_script``)."""
        if not self.script:
            return []
        return [k for position in (None, *range(AHEAD)) for k in self._script(phase, position)]

    def _script(self, phase: str, position: int | None) -> list[Key]:
        """``script_keys``, cached until the profile folds the next turn (it is asked once per token)."""
        key = (phase, position)
        if key not in self._script_cache:
            self._script_cache[key] = script_keys(self.profiles, phase, position)
        return self._script_cache[key]

    def _close_window(self) -> None:
        if self._window is None:
            return
        phase, misses, stall = self._window
        self._window = None
        st = self.stats
        st.switch_misses[phase] = st.switch_misses.get(phase, 0) + self.store.counters["host"].misses - misses
        st.switch_stall_s[phase] = st.switch_stall_s.get(phase, 0.0) + self.store.stall_s - stall

    def _measured_gbps(self) -> float | None:
        """The disk tier's read rate so far (the store's counters), None before any read."""
        disk = getattr(self.store, "counters", {}).get("disk")
        return disk.bytes_in / disk.seconds_in / 1e9 if disk is not None and disk.seconds_in > 0 else None

    def stage_slots(self) -> int:
        return int(self.store.host.n_slots * self.stage_fraction)

    def plan_stage(self, phase: str, n: int) -> list[Key]:
        """The keys to stage for ``phase``: the hottest of its onset (what the switch needs first), then the
        hottest of the whole phase, ``n`` in all."""
        floor = 0.5 / self.profiles.experts
        keys = self.profiles.hot_set(onset_key(phase), n, min_share=floor)
        seen = set(keys)
        keys += [k for k in self.profiles.hot_set(phase, n, min_share=floor) if k not in seen]
        keys = keys[:n]
        # read order: each layer's hottest first, layers in order (what the first token needs first), then seconds
        rank: dict[int, int] = {}
        order = []
        for k in keys:
            rank[k[0]] = rank.get(k[0], -1) + 1
            order.append((rank[k[0]], k[0], k))
        return [k for _, _, k in sorted(order)]

    def stage(self, phase: str, n: int, reserve: bool, first: Sequence[Key] = ()) -> int:
        """Start background reads of ``first`` (script keys, needed soonest), then ``phase``'s hot set (``n`` keys)
        into host slots; returns the bytes issued. ``reserve``: the hottest staged keys are kept through the onset
        (the rest competes on heat); script keys are always reserved until their position has run."""
        pool = self.store.host
        faster = self.store.device  # keys held by the device tier are not read from host slots: not staged there
        keys = list(dict.fromkeys([*first, *self.plan_stage(phase, n)]))
        keys = [k for k in keys if faster is None or faster.slot_of(k) is None]
        if reserve:
            fraction = TUNING.get(phase, TUNING["plan"]).reserve_fraction
            self.policy.reserved = set(keys[: int(self.store.host.n_slots * fraction)])
        self.policy.reserved.update(k for k in first if k in keys)
        issued = 0
        protect: set[int] = set()  # the slots of keys ranked before this one: never evicted for a later key
        for key in keys:
            with pool.lock:
                slot = pool.slot_of(key)
                if slot is not None:
                    protect.add(slot)
                    continue
                slot = pool.claim(key, protect)
            if slot is None:
                self.stats.dropped += 1
                continue
            protect.add(slot)
            self._pending[key] = phase
            self.stats.staged[phase] = self.stats.staged.get(phase, 0) + 1
            self._executor().submit(self.store._fill_host, key, slot)
            issued += pool.layout.blob_bytes
        return issued

    def _executor(self) -> ThreadPoolExecutor:
        if self.store._executor is not None:  # the store's prefetch thread: reads stay serialized with its own
            return self.store._executor
        if self._own_executor is None:
            self._own_executor = ThreadPoolExecutor(1, thread_name_prefix="ft-phase-stage")
        return self._own_executor

    def drain(self) -> None:
        """Wait for staged reads (tests, shutdown)."""
        self._executor().submit(lambda: None).result()

    def save(self) -> None:
        """Fold the open turn into the profile and save it (when attached with the model's own); the scheduler
        keeps running (``LocalEngine`` calls this at the end of each agent run, so the next process starts warm)."""
        with self._lock:
            self.profiles.end_turn()
        if self.save_path is not None:
            self.profiles.save(self.save_path)

    def close(self) -> None:
        """Fold the open turn, save the profile, stop the staging thread."""
        self.drain()
        with self._lock:
            self._close_window()
        self.save()
        if self._own_executor is not None:
            self._own_executor.shutdown(wait=True)

    def snapshot(self) -> dict[str, object]:
        """What ``Engine.stats()["phase"]`` shows: the scheduler's counters (see ``PhaseStats``) and how many
        turns of each phase the profile has folded."""
        turns = {k: n for k, n in self.profiles.turns.items() if "#" not in k}  # script positions left out
        return {"current": self.phase, **self.stats.snapshot(), "profile_turns": turns}
