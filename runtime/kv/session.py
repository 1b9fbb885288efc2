"""Sessions: multi-turn generation that prefills only what the KV cache does not already hold.

``KVManager`` (one per engine) owns the page pools (device tier, optional host tier), the radix prefix cache shared
by all sessions, the keep/offload/drop policy for tool pauses, and the stats. A ``Session`` keeps an append-only
token log whose KV sits in its page table; each turn reuses the longest prefix that the session or the radix tree
holds, and falls back to the longest common prefix when the client's history diverged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from freetoken_agent.runtime.generation.prompt import common_prefix
from freetoken_agent.runtime.kv.paged import PagedKVCache
from freetoken_agent.runtime.kv.pool import OutOfPages, PagePool
from freetoken_agent.runtime.kv.prestage import PrefixStager, Warmed
from freetoken_agent.runtime.kv.radix import Node, RadixCache

if TYPE_CHECKING:
    from freetoken_agent.runtime.engine import Engine, TokenEvent
    from freetoken_agent.runtime.generation.sampling import SamplingParams
    from freetoken_agent.runtime.phase import Phase


@dataclass
class KVStats:
    turns: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    """Prompt tokens served from cache (session or radix)."""
    prefilled_tokens: int = 0
    divergences: int = 0
    offloads: int = 0
    restores: int = 0
    drops: int = 0
    ttft_s: list[float] = field(default_factory=list)
    """Time to first token of each turn, in order."""
    background_prefill_tokens: int = 0
    """Tokens prefilled ahead of a turn (during tool pauses) by ``Session.prefill``."""
    background_prefill_s: float = 0.0


@dataclass(frozen=True)
class KVConfig:
    """Sizing of the KV pools. ``host_pages`` > 0 adds a host tier that idle sessions can be offloaded to."""

    page_size: int = 16
    device_pages: int = 4096
    host_pages: int = 0
    prefill_tok_s_guess: float = 2000.0
    """Recompute-cost estimate before any prefill has been measured."""
    reload_gbps: float = 10.0
    """Host→device copy bandwidth used to price an offloaded session's return (from the hardware probe)."""


@dataclass
class ElasticKV:
    """Ties the KV pool to a memory ledger it shares with the expert-slot pool (DESIGN §4.5).

    ``reservation`` is the KV pool's claim on the tier; growing context moves bytes from the ``experts`` reservation
    (the expert pool evicts slots to free them), and when sessions end, idle pages are retired and their bytes
    handed back with ``give_back(nbytes)`` (the expert pool grows). The tier's limit holds at every instant.
    """

    reservation: Any  # runtime.memory.Reservation
    bytes_per_page: int
    give_back: Any = None  # (nbytes) -> bytes taken by the expert pool
    grow_pages: int = 16
    """Pages asked for per growth step."""
    slack: float = 0.25
    """Idle pages kept (fraction of the active ones) before handing memory back."""
    grown_bytes: int = 0
    returned_bytes: int = 0


class KVManager:
    """Page pools + radix cache + pause policy, shared by an engine's sessions."""

    def __init__(self, num_layers: int, config: KVConfig, device: str = "cpu", elastic: ElasticKV | None = None,
                 stateful: bool = False, lock: Any = None, kv_dtype: Any = None) -> None:
        """``stateful``: the model has recurrent layers (hybrid), whose states the radix tree cannot share.
        ``kv_dtype``: the pools' storage type for keys and values (``PagePool``; None: the compute dtype); the host
        tier stores the same type, so offloading copies pages as they are. Recurrent states stay in the cache
        objects, in the compute dtype.
        ``lock``: the engine's lock, held by its scheduler thread for each step; every change to pages, the radix
        tree or a session's cache from another thread takes it."""
        import threading

        self.config = config
        self.stateful = stateful
        self.lock = lock if lock is not None else threading.RLock()
        self.elastic = elastic
        if elastic is not None:  # capacity = everything the tier could ever give; active = what is reserved now
            limit = elastic.reservation.budget.limit
            capacity = max(1, (limit if limit is not None else config.device_pages * elastic.bytes_per_page)
                           // elastic.bytes_per_page)
            active = elastic.reservation.nbytes // elastic.bytes_per_page
            self.pool = PagePool(num_layers, capacity, config.page_size, device, tier="device", active=active,
                                 kv_dtype=kv_dtype)
        else:
            self.pool = PagePool(num_layers, config.device_pages, config.page_size, device, tier="device",
                                 kv_dtype=kv_dtype)
        self.host = PagePool(num_layers, config.host_pages, config.page_size, "cpu", tier="host", kv_dtype=kv_dtype) \
            if config.host_pages else None
        self.radix = RadixCache(self.pool)
        self.stats = KVStats()
        self.prestage = PrefixStager(self)
        """KV pre-staging: prompt prefixes warmed into the radix tree during tool pauses."""
        self.sessions: dict[int, Session] = {}
        self._next_id = 0

    def alloc(self) -> int:
        """A free device page: evicts unpinned radix leaves (LRU) first, then grows an elastic pool."""
        while True:
            try:
                return self.pool.alloc()
            except OutOfPages:
                if self.radix.evict(1) == 0 and not self._grow():
                    raise OutOfPages(
                        f"KV pool is full ({self.pool.active} pages × {self.pool.page_size} positions, all held "
                        "by active sessions): raise the KV budget, close sessions or shorten the context"
                    ) from None

    def _grow(self) -> bool:
        """Take memory from the expert-slot pool for more KV pages (elastic pools only)."""
        e = self.elastic
        if e is None:
            return False
        paid = e.reservation.nbytes // e.bytes_per_page - self.pool.active
        if paid <= 0:
            ledger = e.reservation.budget
            need = e.grow_pages * e.bytes_per_page
            if ledger.limit is None or ledger.free >= need:  # room in the tier (unlimited, or no expert pool on
                # it: a GPU engine whose experts stay on the host): grow, no expert pays. Where an expert pool shares
                # the tier it holds what the KV does not, and pays for every KV page
                e.reservation.grow(need)
                e.grown_bytes += need
            elif "experts" in ledger.reservations:
                e.grown_bytes += ledger.move("experts", e.reservation.name, need)
            else:
                return False
            paid = e.reservation.nbytes // e.bytes_per_page - self.pool.active
        return self.pool.grow(max(paid, 0)) > 0

    def rebalance(self) -> int:
        """Hand idle KV pages back to the expert pool (elastic pools); returns the bytes given back."""
        e = self.elastic
        if e is None or e.give_back is None:
            return 0
        keep = max(e.grow_pages, int(self.pool.active * e.slack))
        spare = self.pool.num_free - keep
        if spare <= 0:
            return 0
        retired = self.pool.retire(spare)
        taken = e.give_back(retired * e.bytes_per_page)  # shrinks our reservation by what it takes
        e.returned_bytes += taken
        # pages whose bytes were not taken (less than one expert slot) go back into circulation
        self.pool.grow(max(0, e.reservation.nbytes // e.bytes_per_page - self.pool.active))
        return taken

    def warm(self, engine: Engine, tokens: list[int]) -> Warmed:
        """Compute the KV of ``tokens``' full pages into the radix tree, only what it does not hold already.

        The pages belong to the tree alone (unpinned, evictable LRU); no session is touched. It runs through the
        engine's scheduler as a background, opportunistic prefill: pages come from the free list or by evicting
        unpinned radix leaves, never by growing an elastic pool (that would take expert slots away while the phase
        scheduler stages them) nor from other sequences. Raises ``OutOfPages`` when neither has one. Blocks until
        done: call it from a worker thread (the prestager's), not from the engine's.
        """
        from freetoken_agent.runtime.scheduler import Request

        ps = self.pool.page_size
        tokens = [int(t) for t in tokens[: len(tokens) // ps * ps]]
        if not tokens or self.stateful:
            return Warmed(0, 0)  # hybrid models do not share pages through the tree (see ``Session.stateful``)
        result = engine.submit(Request(tokens, kind="prefill", background=True, opportunistic=True)).result()
        return Warmed(result.reused_tokens, len(tokens) - result.reused_tokens)

    def alloc_cached(self) -> int:
        """A free page, evicting unpinned radix leaves if needed; never grows the pool."""
        while True:
            try:
                return self.pool.alloc()
            except OutOfPages:
                if self.radix.evict(1) == 0:
                    raise

    def new_session(self, engine: Engine) -> Session:
        self._next_id += 1
        session = Session(engine, self, self._next_id)
        self.sessions[session.id] = session
        return session

    def pressure(self) -> float:
        return self.pool.num_used / max(self.pool.active, 1)

    def decide(self, session: Session, expected_s: float | None, prefill_tok_s: float) -> str:
        """keep / offload / drop a pausing session's KV (the Continuum/InferCept trade-off)."""
        tokens = session.cache.length
        if expected_s is None or tokens == 0 or self.pressure() < 0.5:
            return "keep"
        recompute_s = tokens / max(prefill_tok_s, 1.0)
        reload_s = session.cache.nbytes() / (self.config.reload_gbps * 1e9)
        if self.host is not None and self.host.num_free >= len(session.cache.pages) and reload_s < recompute_s:
            return "offload"
        return "drop" if expected_s > 2 * recompute_s else "keep"

    def snapshot(self) -> dict[str, Any]:
        s = self.stats
        saved = s.prefix_hit_tokens
        return {
            "page_size": self.pool.page_size,
            "kv_dtype": str(self.pool.kv_dtype).removeprefix("torch.") if self.pool.kv_dtype else "as computed",
            "pages_device_used": self.pool.num_used,
            "pages_device_total": self.pool.active,
            "kv_grown_bytes": self.elastic.grown_bytes if self.elastic else 0,
            "kv_returned_bytes": self.elastic.returned_bytes if self.elastic else 0,
            "pages_host_used": self.host.num_used if self.host else 0,
            "radix_nodes": self.radix.num_nodes,
            "radix_evicted_pages": self.radix.evicted_pages,
            "turns": s.turns,
            "prefix_hit_tokens": saved,
            "prefill_tokens": s.prefilled_tokens,
            "prefix_hit_rate": round(saved / s.prompt_tokens, 4) if s.prompt_tokens else None,
            "divergences": s.divergences,
            "offloads": s.offloads,
            "restores": s.restores,
            "drops": s.drops,
            "background_prefill_tokens": s.background_prefill_tokens,
            "background_prefill_s": round(s.background_prefill_s, 4),
            "prestage": self.prestage.stats.snapshot(),
            "ttft_s": [round(t, 5) for t in s.ttft_s[-64:]],
        }


class Session:
    """One conversation's KV state: an append-only token log whose KV sits in ``cache``.

    Turns run through the engine's scheduler (one turn in flight per session); ``begin``/``end`` are its hooks on
    the engine thread. Every other method may be called from any thread: it takes the engine's lock.
    """

    def __init__(self, engine: Engine, manager: KVManager, session_id: int) -> None:
        self.engine, self.manager, self.id = engine, manager, session_id
        self.cache = PagedKVCache(manager.pool, manager.alloc, manager.radix.evict_page,
                                   manager.radix.move_page)
        self.log: list[int] = []
        """Token ids whose KV is in ``cache`` (``len(log) == cache.length``), append-only between turns."""
        self._pinned: Node | None = None
        self._offloaded: list[int] | None = None
        self.closed = False
        self.stateful = manager.stateful
        """Hybrid model: recurrent layers' states cannot be rewound or shared, so reuse goes through snapshots
        taken at the end of each turn, and the radix tree (shared pages without states) is not used."""
        self._snapshots: dict[int, dict[int, Any]] = {}
        """Position → recurrent states of every stateful layer at that position (the last few turn ends)."""
        self.phase: str | None = None
        """The phase this session's agent said comes next (scheduling input: idle ``tool`` sessions lose their
        KV first under memory pressure)."""
        self.last_used = time.monotonic()
        self._inflight: Any = None  # the RequestHandle of this session's request in flight
        self._submit_lock = threading.Lock()

    # ------------------------------------------------------------------------------------------------ engine hooks

    def begin(self, prompt: list[int], keep_one: bool = True) -> int:
        """Align the cache with ``prompt`` (engine thread, at admission); returns how many positions are reused.

        With ``keep_one`` at least one prompt token is left unfed (its logits start the reply).
        """
        self.last_used = time.monotonic()
        self.resume()
        if self.stateful:
            return self._prepare_stateful(prompt, keep_one)
        stats = self.manager.stats
        common = common_prefix(prompt, self.log)
        if common < len(self.log):
            stats.divergences += 1
            self.cache.truncate(common)
            del self.log[common:]
        match = self.manager.radix.match_prefix(prompt)
        if match.length > len(self.log):
            self.cache.adopt(match.pages, match.length)
            self.log = list(prompt[: match.length])
        limit = len(prompt) - 1 if keep_one else len(prompt)
        if len(self.log) > limit:
            self.cache.truncate(limit)
            del self.log[limit:]
        return len(self.log)

    def _prepare_stateful(self, prompt: list[int], keep_one: bool) -> int:
        """Reuse for hybrid models: continue from the cache if the prompt extends it, else roll back to the latest
        snapshot at or before the common prefix (recomputing from there)."""
        common = common_prefix(prompt, self.log)
        target = min(common, len(prompt) - 1 if keep_one else len(prompt))
        if target == len(self.log) == self.cache.length:
            return target
        if common < len(self.log):
            self.manager.stats.divergences += 1
        position = max((p for p in self._snapshots if p <= target), default=0)
        self.cache.truncate(position)
        del self.log[position:]
        if position:
            self.cache.restore_states(self._snapshots[position])
        else:
            self.cache.clear_states()
        self._snapshots = {p: snap for p, snap in self._snapshots.items() if p <= position}
        return position

    def end(self, tokens: list[int]) -> None:
        """The cache now holds ``tokens`` (engine thread, when a request finishes or is preempted): publish."""
        self.log = list(tokens[: self.cache.length])
        self.last_used = time.monotonic()
        self._publish()

    def evict(self) -> None:
        """Release this session's KV under memory pressure (engine thread); the next turn recomputes what the
        radix tree no longer holds."""
        with self.manager.lock:
            self._release_kv()

    # ------------------------------------------------------------------------------------------------ turns

    @property
    def busy(self) -> bool:
        """A request of this session is in flight."""
        return self._inflight is not None and not self._inflight.done

    def submit(self, request: Any) -> Any:
        """Submit ``request`` (its ``session`` is set to this one); returns the ``RequestHandle``, or None for a
        background request while another is in flight (opportunistic work is skipped, never queued twice). A
        foreground turn waits for this session's background prefill in flight: it covers the turn's prefix."""
        if self.closed:
            raise RuntimeError("session is closed")
        with self._submit_lock:
            prev = self._inflight
            if prev is not None and not prev.done:
                if request.background:
                    return None
                prev.wait()
            request.session = self
            request.phase = request.phase or self.phase
            self._inflight = self.engine.submit(request)
            return self._inflight

    def prefill(self, prefix: list[int]) -> int:
        """Prefill ``prefix`` (e.g. the conversation plus tool output streamed so far) without generating.

        Called while a tool runs, so that when it ends only the tail is left to prefill. If the final prompt
        tokenizes the boundary differently, the next turn falls back to the longest common prefix. Returns how
        many tokens were fed now (0 when another request of this session is in flight).
        """
        from freetoken_agent.runtime.scheduler import Request

        prefix = [int(t) for t in prefix]
        t0 = time.perf_counter()
        handle = self.submit(Request(prefix, kind="prefill", background=True))
        if handle is None:
            return 0
        result = handle.result()
        fed = len(prefix) - result.reused_tokens
        stats = self.manager.stats
        stats.prefilled_tokens += fed
        stats.background_prefill_tokens += fed
        stats.background_prefill_s += time.perf_counter() - t0
        return fed

    def warm(self, tokens: list[int]) -> Warmed:
        """KV pre-staging of the known start of this session's next prompt (run by ``PrefixStager`` in a pause).

        When ``tokens`` continue the session's log (the template re-renders the history as it was generated), the
        rest is fed into the session's own pages, partial last page included: the next turn then starts after
        them. Otherwise (the history re-renders differently) the prefix is warmed in the radix tree only
        (``KVManager.warm``: full pages, the session untouched) and the next turn adopts it by its radix match.
        """
        from freetoken_agent.runtime.scheduler import Request

        tokens = [int(t) for t in tokens]
        with self.manager.lock:
            own = len(self.log)
            extends = (not self.stateful and own and own < len(tokens) and tokens[:own] == self.log
                       and self.cache.length == own)
        if not extends:
            return self.manager.warm(self.engine, tokens)
        handle = self.submit(Request(tokens, kind="prefill", background=True, opportunistic=True))
        if handle is None:
            return Warmed(own, 0)
        result = handle.result()
        return Warmed(result.reused_tokens, len(tokens) - result.reused_tokens)

    def _publish(self) -> None:
        """Share the full pages of this session's log through the radix tree and pin that path (attention-only
        models); snapshot the recurrent states at the end of the log (hybrid models)."""
        if self.stateful:
            if self.cache.length and self.cache.has_states:
                self._snapshots[self.cache.length] = self.cache.snapshot_states()
                for old in sorted(self._snapshots)[:-4]:  # keep the last few turn ends
                    del self._snapshots[old]
            return
        ps = self.manager.pool.page_size
        full = len(self.log) // ps
        node = self.manager.radix.insert(self.log[: full * ps], self.cache.pages[:full])
        if self._pinned is not None:
            self.manager.radix.unlock(self._pinned)
        self.manager.radix.lock(node)
        self._pinned = node

    def _request(self, prompt: list[int], params: SamplingParams | None, phase: Phase | str | None,
                 kwargs: dict[str, Any]) -> Any:
        from freetoken_agent.runtime.scheduler import Request

        if self.closed:
            raise RuntimeError("session is closed")
        if phase is not None:
            self.hint(phase)
        prompt = [int(t) for t in prompt]
        return Request(prompt, self.engine.sampling(params, kwargs))

    def _turn(self, request: Any) -> Any:
        t0 = time.perf_counter()
        handle = self.submit(request)
        return handle, t0

    def _account(self, prompt_len: int, result: Any, t0: float, first_s: float | None) -> None:
        stats = self.manager.stats
        stats.turns += 1
        stats.prompt_tokens += prompt_len
        stats.prefix_hit_tokens += result.reused_tokens
        stats.prefilled_tokens += prompt_len - result.reused_tokens
        if first_s is not None:
            stats.ttft_s.append(first_s - t0)

    def iter_generate(
        self, prompt: list[int], params: SamplingParams | None = None, phase: Phase | str | None = None,
        **kwargs: Any,
    ) -> Iterator[TokenEvent]:
        """Generate a reply to ``prompt`` (the whole conversation so far, as token ids), reusing cached KV."""
        request = self._request(prompt, params, phase, kwargs)
        handle, t0 = self._turn(request)
        first = None
        try:
            for ev in handle:
                first = first or time.perf_counter()
                yield ev
        finally:
            handle.cancel()  # a consumer that stopped early frees the slot; a no-op once finished
        self._account(len(request.prompt), handle.result(), t0, first)

    def prefill_logits(self, prompt: list[int]) -> tuple[int, Any]:
        """Verification path: align with ``prompt`` and prefill the rest; returns (reused, logits [T_new, V])."""
        from freetoken_agent.runtime.scheduler import Request

        result = self.submit(Request([int(t) for t in prompt], kind="logits")).result()
        return result.reused_tokens, result.logits

    def generate(self, prompt: list[int], params: SamplingParams | None = None, **kwargs: Any) -> Any:
        """Blocking turn; returns the engine's ``GenerationResult``."""
        from freetoken_agent.runtime.engine import GenerationResult

        phase = kwargs.pop("phase", None)
        request = self._request(prompt, params, phase, kwargs)
        handle, t0 = self._turn(request)
        result = handle.result()
        self._account(len(request.prompt), result, t0, t0 + result.prefill_s)
        return GenerationResult.of(result)

    async def stream(self, prompt: list[int], params: SamplingParams | None = None, **kwargs: Any
                     ) -> AsyncIterator[TokenEvent]:
        """Async turn: tokens as the engine thread produces them, without blocking the event loop; leaving the
        loop early (or being cancelled) cancels the request."""
        import anyio.to_thread

        phase = kwargs.pop("phase", None)
        request = self._request(prompt, params, phase, kwargs)
        handle, t0 = await anyio.to_thread.run_sync(self._turn, request)  # may wait for a background prefill
        first = None
        try:
            async for ev in handle:
                first = first or time.perf_counter()
                yield ev
        finally:
            handle.cancel()
        self._account(len(request.prompt), await handle.aresult(), t0, first)

    # ------------------------------------------------------------------------------------------------ pauses

    def hint(self, phase: Phase | str, expected_s: float | None = None) -> str:
        """Phase hint from the agent; returns the KV decision.

        A ``tool`` phase pauses the session (see ``pause``), then the idle engine warms the expected start of the
        next prompt (``expect``) and the registered per-phase prompts in the prefix cache (``prestage``: only free
        or evictable pages, so whatever the session's KV decision was, no memory is taken from anyone).
        """
        name = str(getattr(phase, "value", phase))
        self.phase = name
        self.engine.hint(phase, expected_s, session=self)
        if name == "tool":
            decision = self.pause(expected_s)
            self.manager.prestage.start(self.engine)
            return decision
        self.resume()  # the tool is done: bring offloaded KV back before the next turn asks for it
        return "keep"

    def expect(self, tokens: list[int]) -> None:
        """This session's next prompt starts with ``tokens`` (e.g. the conversation plus the tool-result framing
        the chat template puts before a tool's output): warmed into the prefix cache at the next tool pause."""
        self.manager.prestage.expect(self, tokens)

    def pause(self, expected_s: float | None) -> str:
        """A tool runs for about ``expected_s`` seconds: keep, offload to host, or drop this session's KV."""
        rate = self.engine.stats().get("prefill_tok_s") or self.manager.config.prefill_tok_s_guess
        with self.manager.lock:
            if self._inflight is not None and not self._inflight.done:
                return "keep"  # a request of this session is running: its KV is in use
            decision = self.manager.decide(self, expected_s, rate)
            if decision == "offload":
                self._offload()
            elif decision == "drop":
                self.drop()
        return decision

    def _offload(self) -> None:
        host, pool = self.manager.host, self.manager.pool
        assert host is not None
        if self._offloaded is not None:
            return
        pages = []
        for page in self.cache.pages:
            dst = host.alloc()
            host.copy_page(page, dst, other=pool)
            pages.append(dst)
        length, states = self.cache.length, self.cache.snapshot_states()
        self.cache.release()
        self.cache.length = length  # positions are remembered; pages come back on resume
        self.cache.restore_states(states)  # recurrent states are small: they stay
        self._offloaded = pages
        if self._pinned is not None:  # the shared copies become evictable while we are away
            self.manager.radix.unlock(self._pinned)
            self._pinned = None
        self.manager.stats.offloads += 1

    def resume(self) -> None:
        """Bring offloaded KV back to the device tier (no-op if nothing is offloaded)."""
        with self.manager.lock:
            if self._offloaded is None:
                return
            host, pool = self.manager.host, self.manager.pool
            assert host is not None
            pages = []
            for src in self._offloaded:
                dst = self.manager.alloc()
                pool.copy_page(src, dst, other=host)
                host.decref(src)
                pages.append(dst)
            self.cache.pages = pages
            self._offloaded = None
            self.manager.stats.restores += 1

    def _release_kv(self) -> None:
        if self._offloaded is not None:
            for page in self._offloaded:
                self.manager.host.decref(page)  # type: ignore[union-attr]
            self._offloaded = None
        self.cache.release()
        self.log = []
        self._snapshots.clear()
        if self._pinned is not None:
            self.manager.radix.unlock(self._pinned)
            self._pinned = None

    def drop(self) -> None:
        """Release this session's KV; its published pages stay in the radix tree until evicted."""
        with self.manager.lock:
            self._release_kv()
            self.manager.stats.drops += 1

    def close(self) -> None:
        """End the session: a turn in flight is cancelled, the KV released (published pages stay shared)."""
        if self.closed:
            return
        inflight = self._inflight
        if inflight is not None and not inflight.done:
            inflight.cancel()
            inflight.wait()
        with self.manager.lock:
            self._release_kv()
            self.manager.sessions.pop(self.id, None)
            self.closed = True
            self.manager.rebalance()
