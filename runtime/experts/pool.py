"""A fixed pool of equal-size expert slots on one tier, with a slot table ``(layer, expert) → slot``.

The pool is one ``uint8 [S, stride]`` tensor (no fragmentation; a quantized layer's kernels run over the whole
pool with slot ids). Its bytes are claimed from the tier's ``MemoryBudget`` before allocation. Slots are
``free``, ``loading`` (a reader is filling them; others wait on an event), or ``ready``. A slot is evictable when
it is ready, not in use by the step being computed (``use``/``unuse`` counts) and its key is not pinned; the
policy picks among evictable slots. With ``per_layer`` set the pool acts as per-layer pools (each layer owns at
most that many slots and, once full, evicts only its own experts); by default it is one global pool.
Thread-safe: the prefetch thread claims and fills slots concurrently.

``resize`` (the KV ↔ expert boundary moving) keeps the tensor where it can: a CPU pool shrinks in place (the slots
past the new end are evicted and their pages given back to the OS) and grows back in place up to the size it was
allocated with, keeping every expert in the slots that stay. Only growth past that, or a pool whose pages cannot be
given back (device, pinned), allocates a new tensor; ``on_reallocate`` callbacks run first, so no view over the old
tensor keeps it alive while the new one fills: the pool's memory never exceeds what its reservation holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch
from freetoken_agent.runtime.experts.layout import ExpertLayout
from freetoken_agent.runtime.experts.policies import Key, ResidencyPolicy
from freetoken_agent.runtime.memory import Reservation, release_pages


class SlotPool:
    """``n_slots`` expert slots of one tier (``host`` or ``device``), managed by a residency policy."""

    def __init__(
        self, tier: str, layout: ExpertLayout, n_slots: int, device: torch.device | str,
        reservation: Reservation, policy: ResidencyPolicy, pin_memory: bool = False,
    ) -> None:  # fmt: skip
        self.tier, self.layout, self.device, self.policy = tier, layout, torch.device(device), policy
        self.reservation = reservation
        self.pin_memory = pin_memory
        self.lock = threading.RLock()
        self.pinned: set[Key] = set()
        self.generation = 0
        """Bumped when the pool tensor is reallocated (views over it must be rebuilt)."""
        self.hits = self.misses = self.evictions = 0
        self.per_layer: int | None = None
        """Per-layer pools: each layer holds at most this many slots (None: one global pool)."""
        self._split: tuple[int, int] | None = None
        self.on_reallocate: list[Callable[[], None]] = []
        """Called before the pool tensor is replaced: whoever holds views over ``data`` drops them here."""
        self._allocate(n_slots)

    def split_per_layer(self, layers: int, floor: int) -> None:
        """Act as ``layers`` per-layer pools of equal share (at least ``floor`` slots each), kept through resizes."""
        self._split = (layers, floor)
        self.per_layer = max(floor, self.n_slots // layers)

    def _allocate(self, n_slots: int) -> None:
        self.reservation.grow(n_slots * self.layout.stride)  # raises before any allocation when it does not fit
        pin = self.pin_memory and self.device.type == "cpu"
        self.data = torch.empty(n_slots, self.layout.stride, dtype=torch.uint8, device=self.device, pin_memory=pin)
        self._pinned = pin
        self.capacity = n_slots
        """Slots ``data`` has room for; ``n_slots`` (those in use) is at most this after a shrink in place."""
        self.n_slots = n_slots
        self.table: dict[Key, int] = {}
        self.owner: list[Key | None] = [None] * n_slots
        self.free = list(range(n_slots - 1, -1, -1))
        self.loading: dict[int, threading.Event] = {}
        self.in_use = [0] * n_slots
        self.layer_count: dict[int, int] = {}
        self.generation += 1

    # ---------------------------------------------------------------- lookups

    def slot_of(self, key: Key) -> int | None:
        """The slot holding ``key`` (ready or loading), without touching the policy."""
        return self.table.get(key)

    def wait_ready(self, slot: int) -> float:
        """Block until ``slot`` is filled; returns the seconds waited (0 when ready)."""
        ev = self.loading.get(slot)
        if ev is None:
            return 0.0
        import time

        t0 = time.perf_counter()
        ev.wait()
        return time.perf_counter() - t0

    def is_ready(self, key: Key) -> bool:
        s = self.table.get(key)
        return s is not None and s not in self.loading

    # ---------------------------------------------------------------- claiming

    def _evictable(self, protect: set[int]) -> Callable[[Key], bool]:
        table, in_use, loading, pinned = self.table, self.in_use, self.loading, self.pinned

        def ok(key: Key) -> bool:
            s = table.get(key)
            return s is not None and not in_use[s] and s not in loading and s not in protect and key not in pinned

        return ok

    def claim(self, key: Key, protect: Iterable[int] = ()) -> int | None:
        """A slot for ``key`` (marked loading; fill it, then ``ready``), evicting if needed; None if all are busy."""
        with self.lock:
            assert key not in self.table, f"{key} already has a slot"
            layer_full = self.per_layer is not None and self.layer_count.get(key[0], 0) >= self.per_layer
            if self.free and not layer_full:
                s = self.free.pop()
            else:
                ok = self._evictable(set(protect))
                if layer_full:  # per-layer pools: a layer at its share evicts only its own experts
                    same = ok
                    ok = lambda k: k[0] == key[0] and same(k)
                victim = self.policy.victim(self.owner, ok)
                if victim is None:
                    return None
                s = self.table.pop(victim)
                self.policy.forget(victim)
                self.layer_count[victim[0]] -= 1
                self.evictions += 1
            self.layer_count[key[0]] = self.layer_count.get(key[0], 0) + 1
            self.owner[s] = key
            self.table[key] = s
            self.loading[s] = threading.Event()
            return s

    def ready(self, slot: int) -> None:
        with self.lock:
            ev = self.loading.pop(slot, None)
            key = self.owner[slot]
            if key is not None:
                self.policy.touch(key)
        if ev is not None:
            ev.set()

    def abandon(self, slot: int) -> None:
        """Give back a claimed slot whose fill failed."""
        with self.lock:
            key = self.owner[slot]
            if key is not None:
                self.table.pop(key, None)
                self.layer_count[key[0]] -= 1
            self.owner[slot] = None
            self.free.append(slot)
            ev = self.loading.pop(slot, None)
        if ev is not None:
            ev.set()

    def use(self, slot: int) -> None:
        with self.lock:
            self.in_use[slot] += 1
            key = self.owner[slot]
            if key is not None:
                self.policy.touch(key)

    def unuse(self, slot: int) -> None:
        with self.lock:
            self.in_use[slot] -= 1

    def capacity_for_step(self) -> int:
        """Slots a step may hold at once: all but the pinned and loading ones."""
        with self.lock:
            return self.n_slots - len(self.pinned) - len(self.loading)

    # ---------------------------------------------------------------- resize (elastic boundary)

    def resize(self, n_slots: int) -> int:
        """Change the pool to ``n_slots`` slots; returns the bytes freed (negative when it grew).

        In place where it can (module docstring): the experts in slots below both sizes stay, those above the new
        size are evicted (pins among them too: the caller reloads its pins). Otherwise a new tensor, contents
        dropped: views over the old one are dropped (``on_reallocate``) and it is released before the new one is
        claimed and allocated, so the tier never holds both.
        """
        with self.lock:
            if self.loading or any(self.in_use):
                raise RuntimeError("cannot resize a slot pool while slots are loading or in use")
            before = self.n_slots
            if n_slots <= self.capacity and self._resize_in_place(n_slots):
                return (before - n_slots) * self.layout.stride
            for key in list(self.table):
                self.policy.forget(key)
            for drop_views in self.on_reallocate:
                drop_views()
            del self.data
            self.reservation.shrink(before * self.layout.stride)
            self._allocate(n_slots)
            if self._split is not None:
                self.split_per_layer(*self._split)
            return (before - n_slots) * self.layout.stride

    def _resize_in_place(self, n_slots: int) -> bool:
        """``resize`` within ``capacity`` keeping ``data``; False (nothing changed) where its pages cannot be given
        back. Growth claims the bytes before the slots are used; a shrink evicts, releases, then gives them back."""
        before, stride = self.n_slots, self.layout.stride
        if n_slots < before and (self._pinned or not release_pages(self.data[n_slots:before].view(-1))):
            return False
        if n_slots > before:
            self.reservation.grow((n_slots - before) * stride)
        for s in range(n_slots, before):  # slots past the new end: evict their experts
            key = self.owner[s]
            if key is not None:
                del self.table[key]
                self.policy.forget(key)
                self.layer_count[key[0]] -= 1
        self.owner = self.owner[:n_slots] + [None] * (n_slots - before)
        self.in_use = self.in_use[:n_slots] + [0] * (n_slots - before)
        self.free = list(range(n_slots - 1, before - 1, -1)) + [s for s in self.free if s < n_slots]
        self.n_slots = n_slots
        if n_slots < before:
            self.reservation.shrink((before - n_slots) * stride)
        if self._split is not None:
            self.split_per_layer(*self._split)
        return True

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.layout.stride

    def resident(self) -> list[Key]:
        with self.lock:
            return [k for k, s in self.table.items() if s not in self.loading]
