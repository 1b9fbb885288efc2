"""The expert store: tiers (device slots ← host slots ← disk cache file), loading, prefetch, pinning, counters.

``acquire_host(key)`` returns a ready host slot holding the expert (reading it from the cache file on a miss) and
marks it in use until ``release``; ``acquire_device`` does the same on the device tier, copying from a host slot.
``prefetch_host(keys)`` starts background reads into host slots; a later ``acquire_host`` of a key still loading
waits for it (counted as stall time). Every byte moved and every hit/miss is counted per tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.experts.cache_file import ExpertCacheFile
from freetoken_agent.runtime.experts.layout import ExpertLayout
from freetoken_agent.runtime.experts.policies import Key
from freetoken_agent.runtime.experts.pool import SlotPool
from freetoken_agent.runtime.memory import MemoryBudget


@dataclass
class TierCounters:
    """Traffic of one tier."""

    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    seconds_in: float = 0.0

    def snapshot(self) -> dict[str, object]:
        total = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "hit_rate": round(self.hits / total, 4) if total else None,
                "bytes_in": self.bytes_in, "seconds_in": round(self.seconds_in, 4)}


@dataclass
class PrefetchCounters:
    """Gate look-ahead: predictions, the reads issued for them, and whether the predicted experts were then used.

    Every look-ahead is scored (``recent``: EMA of the fraction of its predicted *non-resident* experts — the ones a
    read would be for — that the next layer really used), whether or not reads were issued for it, so the store can stop reading while predictions do not pay off
    (random-weight models: ~10-30%) and start again as soon as they do (trained models: ~80%).
    """

    issued: int = 0
    used: int = 0
    wasted: int = 0
    dropped: int = 0
    """Predicted experts not read because every slot was busy."""
    paused: int = 0
    """Look-aheads not acted on because ``recent`` was below ``min_accuracy`` (wasted reads cost bandwidth)."""
    predictions: int = 0
    recent: float = 1.0
    min_accuracy: float = 0.5
    pending: dict[int, set[int]] = field(default_factory=dict)
    predicted: dict[int, set[int]] = field(default_factory=dict)

    def settle(self, layer: int, hit: set[int]) -> None:
        issued = self.pending.pop(layer, set())
        used = len(issued & hit)
        self.used += used
        self.wasted += len(issued) - used
        guess = self.predicted.pop(layer, None)
        if guess:
            self.recent = 0.9 * self.recent + 0.1 * len(guess & hit) / len(guess)

    def should_issue(self) -> bool:
        if self.recent >= self.min_accuracy:
            return True
        self.paused += 1
        return False

    def snapshot(self) -> dict[str, object]:
        done = self.used + self.wasted
        return {"predictions": self.predictions, "issued": self.issued, "used": self.used, "wasted": self.wasted,
                "dropped": self.dropped, "paused": self.paused, "recent_accuracy": round(self.recent, 4),
                "accuracy": round(self.used / done, 4) if done else None}


class ExpertStore:
    """All experts of a model across tiers, under the budgets' ledgers."""

    def __init__(
        self, disk: ExpertCacheFile, host: SlotPool, device: SlotPool | None, ledgers: dict[str, MemoryBudget],
        prefetch: bool = True,
    ) -> None:  # fmt: skip
        self.disk, self.host, self.device, self.ledgers = disk, host, device, ledgers
        self.counters = {"host": TierCounters(), "device": TierCounters(), "disk": TierCounters()}
        self.prefetch = PrefetchCounters()
        self.stall_s = 0.0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ft-prefetch") if prefetch else None
        self.compute_pool = ThreadPoolExecutor(1, thread_name_prefix="ft-host-experts")
        """Runs a step's host experts while the calling thread runs its device experts."""
        self.planner_counts: dict[str, int] = {"resident": 0, "fetch": 0, "host": 0}
        self.observe_copy: Callable[[int, float], None] | None = None
        """Told of every timed host→device copy ``(bytes, seconds)`` (the planner's cost model listens)."""
        self.observe_disk: Callable[[int, float], None] | None = None
        """Told of every timed cache-file read ``(bytes, seconds)``."""
        self.min_slots = 1
        """Host slots one MoE step needs (top-k); ``shrink_host`` never goes below this plus the pins."""
        self.read_aheads = 0
        self._read_ahead: set[Key] = set()
        self._inflight: dict[Key, tuple[object, int]] = {}
        """Device fetches in flight on the side stream: key → (CUDA event, host slot held for the DMA)."""
        self._copy_stream: object = None

    def layout_of(self, layer: int) -> ExpertLayout:
        """The layout of MoE layer ``layer``'s experts in a slot (the slots are the size of the widest layer's)."""
        return self.disk.layout_of(layer)

    @property
    def prefetching(self) -> bool:
        """Whether it reads predicted experts ahead in the background (``prefetch_host``)."""
        return self._executor is not None

    # ---------------------------------------------------------------- host tier

    def _fill_host(self, key: Key, slot: int) -> None:
        t0 = time.perf_counter()
        try:
            n = self.disk.read_into(key[0], key[1], self.host.data[slot])
        except BaseException:
            self.host.abandon(slot)
            raise
        dt = time.perf_counter() - t0
        for c in (self.counters["disk"], self.counters["host"]):  # disk → host: the host tier's incoming bytes
            c.bytes_in += n
            c.seconds_in += dt
        self.host.ready(slot)
        if self.observe_disk is not None:
            self.observe_disk(n, dt)

    def _protected(self, keys: Iterable[Key]) -> set[int]:
        table = self.host.table
        return {table[k] for k in keys if k in table}

    def acquire_host(self, key: Key, protect: Iterable[Key] = ()) -> int:
        """A ready host slot holding ``key``, marked in use (call ``release_host``).

        ``protect``: keys this step still needs — a miss evicts them only when nothing else can go.
        """
        pool = self.host
        while True:
            with pool.lock:
                slot = pool.slot_of(key)
                if slot is not None:
                    pool.use(slot)
                    loading = slot in pool.loading
                else:
                    slot = pool.claim(key, self._protected(protect)) if protect else None
                    if slot is None:
                        slot = pool.claim(key)
                    if slot is not None:
                        pool.in_use[slot] += 1
                    loading = False
            if slot is None:  # every slot busy: only prefetch fills can be in flight; wait for one and retry
                if not pool.loading:
                    raise FreeTokenError(
                        f"host expert pool of {pool.n_slots} slots is too small for one MoE step "
                        f"({len(pool.pinned)} pinned); raise --host-memory"
                    )
                self.stall_s += pool.wait_ready(next(iter(pool.loading)))
                continue
            break
        if loading:
            self.stall_s += pool.wait_ready(slot)
            if key in self._read_ahead:  # read early in this same step: a miss whose read overlapped compute
                self._read_ahead.discard(key)
                self.counters["host"].misses += 1
            else:  # predicted by the look-ahead one layer earlier: a hit (the wait, if any, is stall)
                self.counters["host"].hits += 1
        elif pool.is_ready(key):
            self.counters["host"].hits += 1
        else:
            self.counters["host"].misses += 1
            t0 = time.perf_counter()
            self._fill_host(key, slot)
            self.stall_s += time.perf_counter() - t0
        return slot

    def release_host(self, slot: int) -> None:
        self.host.unuse(slot)

    def read_ahead(self, key: Key, protect: Iterable[Key] = ()) -> bool:
        """Start reading ``key`` in the background now (double buffering within a step); False if no slot was free.

        Never evicts ``protect`` (this step's other experts). Counted as a miss when acquired, not as a prefetch.
        """
        if self._executor is None:
            return False
        with self.host.lock:
            if self.host.slot_of(key) is not None:
                return False
            slot = self.host.claim(key, self._protected(protect))
        if slot is None:
            return False
        self._read_ahead.add(key)
        self.read_aheads += 1
        self._executor.submit(self._fill_host, key, slot)
        return True

    def prefetch_host(self, layer: int, experts: list[int]) -> None:
        """Start background reads of experts of ``layer`` that are not in host slots (gate look-ahead)."""
        if self._executor is None:
            return
        self.prefetch.predictions += 1
        cold = {e for e in experts if self.host.slot_of((layer, e)) is None}
        if cold:  # scored on the experts a read would be for: already-resident guesses cost nothing either way
            self.prefetch.predicted[layer] = cold
        if not self.prefetch.should_issue():
            return
        issued: set[int] = set()
        for e in experts:
            key = (layer, e)
            with self.host.lock:
                if self.host.slot_of(key) is not None:
                    continue
                slot = self.host.claim(key)
            if slot is None:
                self.prefetch.dropped += 1
                continue
            issued.add(e)
            self.prefetch.issued += 1
            self._executor.submit(self._fill_host, key, slot)
        if issued:
            self.prefetch.pending.setdefault(layer, set()).update(issued)

    def pin(self, keys: list[Key]) -> None:
        """Load ``keys`` into host slots and never evict them."""
        room = self.host.n_slots - len(self.host.pinned) - 1
        if len(keys) > room:
            raise FreeTokenError(f"cannot pin {len(keys)} experts: the host pool has room for {room}")
        for key in keys:
            slot = self.acquire_host(key)
            self.host.pinned.add(key)
            self.release_host(slot)

    # ---------------------------------------------------------------- elastic boundary (KV <-> expert slots)

    def shrink_host(self, nbytes: int) -> int:
        """Give up whole host slots worth at least ``nbytes`` (``SlotPool.resize``: experts in the slots that stay are
        kept when the pool shrinks in place; pins reloaded); returns bytes freed.

        Never below ``min_slots`` + pins (returns less, possibly 0, when it cannot). Between steps only.

        Installed as the ``experts`` reservation's ``on_shrink``, so ``ledgers["host"].move("experts", "kv", n)``
        moves the boundary without reloading the model.
        """
        pool = self.host
        self.drain()
        deadline = time.monotonic() + 30
        while pool.loading and time.monotonic() < deadline:  # phase staging fills slots from its own thread
            time.sleep(0.001)
        stride = pool.layout.stride
        keep = max(self.min_slots + len(pool.pinned), pool.n_slots - -(-nbytes // stride))
        if keep >= pool.n_slots:
            return 0
        pins = sorted(pool.pinned)
        freed = pool.resize(keep)
        pool.pinned.clear()
        if pins:
            self.pin(pins)
        return freed

    def grow_host(self, nbytes: int, source: str = "kv") -> int:
        """Take ``nbytes`` (whole slots) from reservation ``source`` of the host ledger into more expert slots."""
        pool, ledger = self.host, self.ledgers["host"]
        self.drain()
        n = min(nbytes, ledger.reservations[source].nbytes) // pool.layout.stride
        if n <= 0:
            return 0
        ledger.reservations[source].shrink(n * pool.layout.stride)
        pins = sorted(pool.pinned)
        pool.resize(pool.n_slots + n)
        pool.pinned.clear()
        if pins:
            self.pin(pins)
        ledger.moves.append((source, "experts", n * pool.layout.stride))
        return n * pool.layout.stride

    # ---------------------------------------------------------------- device tier

    def acquire_device(self, key: Key) -> int:
        """A device slot holding ``key`` (copied from a host slot on a miss), marked in use."""
        dev = self.device
        assert dev is not None
        with dev.lock:
            slot = dev.slot_of(key)
            if slot is not None:
                dev.use(slot)
        if slot is not None and key in self._inflight:  # copied ahead on the side stream: order, then settle
            import torch

            event, hslot = self._inflight.pop(key)
            torch.cuda.current_stream(dev.device).wait_event(event)
            event.synchronize()  # the pinned host slot may be reused only once the DMA has read it
            self.release_host(hslot)
            dev.unuse(slot)  # the hold fetch_async took
            self.counters["device"].misses += 1
            return slot
        if slot is not None:
            self.counters["device"].hits += 1
            return slot
        with dev.lock:
            slot = dev.claim(key)
            if slot is None:
                raise FreeTokenError(f"device expert pool of {dev.n_slots} slots is too small for one MoE step")
            dev.in_use[slot] += 1
        hslot = self.acquire_host(key)
        t0 = time.perf_counter()
        try:
            dev.data[slot].copy_(self.host.data[hslot], non_blocking=False)
        finally:
            self.release_host(hslot)
        dt = time.perf_counter() - t0
        c = self.counters["device"]
        c.misses += 1
        c.bytes_in += self.host.layout.blob_bytes
        c.seconds_in += dt
        self.stall_s += dt
        dev.ready(slot)
        if self.observe_copy is not None:
            self.observe_copy(self.host.layout.blob_bytes, dt)
        return slot

    def fetch_async(self, key: Key, protect: Iterable[Key] = ()) -> bool:
        """Start copying ``key`` host → device on a side CUDA stream (the next expert while this one computes).

        The copy waits for work already queued on the compute stream (an evicted slot may still be read there);
        ``acquire_device`` makes the compute stream wait for it. CUDA pools only; returns whether a copy started.
        """
        dev = self.device
        if dev is None or dev.device.type != "cuda" or key in self._inflight:
            return False
        import torch

        with dev.lock:
            if dev.slot_of(key) is not None:
                return False
            slot = dev.claim(key, {dev.table[k] for k in protect if k in dev.table})  # never this step's
            if slot is None:
                return False
            dev.in_use[slot] += 1  # held until acquire_device settles the copy
        hslot = self.acquire_host(key)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=dev.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(dev.device))
        with torch.cuda.stream(self._copy_stream):
            dev.data[slot].copy_(self.host.data[hslot], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        self._inflight[key] = (event, hslot)
        self.counters["device"].bytes_in += self.host.layout.blob_bytes
        dev.ready(slot)
        return True

    def release_device(self, slot: int) -> None:
        assert self.device is not None
        self.device.unuse(slot)

    def on_phase(self, phase: str) -> None:
        """An agent phase hint: phase-aware policies switch which heat drives eviction."""
        for pool in (self.host, self.device):
            if pool is not None and hasattr(pool.policy, "set_phase"):
                pool.policy.set_phase(phase)  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- stats

    def drain(self) -> None:
        """Wait for in-flight prefetches (tests, shutdown)."""
        if self._executor is not None:
            self._executor.submit(lambda: None).result()

    def stats(self) -> dict[str, object]:
        tiers: dict[str, object] = {}
        for name, pool in (("host", self.host), ("device", self.device)):
            if pool is None:
                continue
            ledger = self.ledgers[name]
            tiers[name] = {**self.counters[name].snapshot(), "slots": pool.n_slots, "slot_bytes": pool.layout.stride,
                           "evictions": pool.evictions, "pinned": len(pool.pinned), "limit": ledger.limit,
                           "used": ledger.used, "peak": ledger.peak}
        disk = self.counters["disk"]
        tiers["disk"] = {"file": str(self.disk.path), "bytes": self.disk.nbytes, "bytes_read": disk.bytes_in,
                         "read_s": round(disk.seconds_in, 4),
                         "read_gbps": round(disk.bytes_in / disk.seconds_in / 1e9, 3) if disk.seconds_in else None}
        return {"policy": self.host.policy.name, "tiers": tiers, "prefetch": self.prefetch.snapshot(),
                "read_ahead": self.read_aheads,
                "planner": dict(self.planner_counts), "stall_s": round(self.stall_s, 4),
                "budget": {n: b.snapshot() for n, b in self.ledgers.items()}}

    def close(self) -> None:
        self.compute_pool.shutdown(wait=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.disk.close()
