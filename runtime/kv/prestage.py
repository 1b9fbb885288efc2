"""KV pre-staging: warm phase-specific prompt prefixes in the radix cache while the engine idles (tool pauses).

Some prefixes are known before the prompt that starts with them:

- a session's *tool-result framing*: the conversation so far as the chat template re-renders it, plus what the
  template puts before a tool's output (``<|im_start|>user\\n<tool_response>\\n`` for Qwen). The turn after the tool
  starts with it whatever the tool prints. Set per session with ``Session.expect(tokens)`` before the tool runs;
  ``Session.warm`` feeds it into the session's own pages when it continues the session's log exactly (the radix
  tree holds whole pages only, and a framing is shorter than a page), else into the radix tree as below.
- per-phase prompts (``register(phase, tokens)``): a sub-agent's or a phase's own system prompt and tool schemas.

When a session pauses for a tool (``Session.hint``), ``start`` warms them on a background thread:
``KVManager.warm`` matches each prefix's longest cached page-aligned part in the radix tree and computes only the
rest, into pages that the tree alone holds (unpinned: evicted LRU like any shared page, and never by growing an
elastic pool at the expert pool's expense); no session's pages or token log are touched, and the next turn finds
the warmed pages through its usual radix match. Outputs are unchanged either way: a position's KV depends only on the
tokens up to it, and only exact token matches are reused (a next prompt that does not start with a fed framing
falls back to the longest common prefix). Sessions call ``wait`` before they touch the page pool, so the
pool is never used by two threads at once.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from freetoken_agent.runtime.kv.pool import OutOfPages

if TYPE_CHECKING:
    from freetoken_agent.runtime.kv.session import KVManager, Session


class Warmed(NamedTuple):
    """What ``KVManager.warm`` did: prefix tokens already cached, and tokens computed now."""

    reused: int
    prefilled: int


@dataclass
class PrestageStats:
    """KV pre-staging counters (``KVManager.snapshot()["prestage"]``)."""

    runs: int = 0
    """Pauses that warmed something."""
    prefixes: int = 0
    """Prefixes warmed (framings and registered prompts)."""
    prefilled_tokens: int = 0
    """Tokens computed during pauses."""
    cached_tokens: int = 0
    """Prefix tokens that were already in the radix tree (nothing to compute)."""
    skipped: int = 0
    """Prefixes not warmed: the pool had no free or evictable page, or the session went away."""
    streamed_tokens: int = 0
    """Tokens of running tools' streamed output prefilled before the tool ended (``feed``)."""
    seconds: float = 0.0

    def snapshot(self) -> dict[str, object]:
        return {"runs": self.runs, "prefixes": self.prefixes, "prefilled_tokens": self.prefilled_tokens,
                "cached_tokens": self.cached_tokens, "skipped": self.skipped, "streamed_tokens": self.streamed_tokens,
                "seconds": round(self.seconds, 4)}


class PrefixStager:
    """The prefixes to warm at the next pause, and the background thread that warms them (one per ``KVManager``)."""

    def __init__(self, manager: KVManager) -> None:
        self.manager = manager
        self.registered: dict[str, list[list[int]]] = {}
        """phase → prompts that phase's turns (or sub-agents) start with."""
        self.expected: dict[int, tuple[Session, list[int]]] = {}
        """session id → the prefix its next prompt starts with (warmed once, at its next pause)."""
        self.stats = PrestageStats()
        self.enabled = True
        """False: pauses warm nothing (benchmarks compare with and without)."""
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._feeds: dict[int, tuple[Session, list[int]]] = {}
        """session id → the newest streamed-output prefix not yet taken by the worker (``feed``)."""
        self._futures: list[Future[None]] = []
        """Warms submitted and not yet seen finished by ``wait`` (one worker: they run in order)."""

    def register(self, phase: str, tokens: list[int]) -> None:
        """A prompt prefix that ``phase``'s turns start with (kept; re-warming a cached one costs a tree walk)."""
        with self._lock:
            prompts = self.registered.setdefault(phase, [])
            if list(tokens) not in prompts:
                prompts.append([int(t) for t in tokens])

    def expect(self, session: Session, tokens: list[int]) -> None:
        """``session``'s next prompt starts with ``tokens`` (replaces an earlier expectation)."""
        with self._lock:
            self.expected[session.id] = (session, [int(t) for t in tokens])

    def feed(self, session: Session, tokens: list[int]) -> None:
        """Prefill ``tokens`` (the conversation plus a running tool's output so far) into ``session`` in the
        background (``Session.prefill``), queued behind other warms; a newer call for the same session replaces
        tokens not yet taken, so a fast-streaming tool costs one prefill at a time."""
        if not self.enabled or session.closed or session.stateful:
            return
        with self._lock:
            queued = session.id in self._feeds
            self._feeds[session.id] = (session, [int(t) for t in tokens])
            if queued:
                return
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="ft-kv-prestage")
            self._futures.append(self._executor.submit(self._feed, session.id))

    def _feed(self, session_id: int) -> None:
        with self._lock:
            session, tokens = self._feeds.pop(session_id)
        if session.closed:
            return
        t0 = time.perf_counter()
        try:
            fed = session.prefill(tokens)
        except OutOfPages:  # opportunistic, like warming: the turn itself will prefill what is missing
            self.stats.skipped += 1
            return
        self.stats.streamed_tokens += fed
        self.stats.seconds += time.perf_counter() - t0

    def start(self, engine: Any, first: str = "plan") -> None:
        """Warm the expected framings, then the registered prompts (``first``'s before the others), in the
        background. Returns at once; ``wait`` joins."""
        with self._lock:
            framings = [(s, t) for s, t in self.expected.values()]
            self.expected.clear()
            prompts = [t for phase in sorted(self.registered, key=lambda p: p != first) for t in self.registered[phase]]
        if not self.enabled or not (framings or prompts):
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="ft-kv-prestage")
        future = self._executor.submit(self._run, engine, framings, prompts)  # queued behind a running one
        with self._lock:
            self._futures.append(future)

    def _run(self, engine: Any, framings: list[tuple[Session, list[int]]], prompts: list[list[int]]) -> None:
        t0 = time.perf_counter()
        st = self.stats
        todo: list[tuple[Session | None, list[int]]] = [(s, t) for s, t in framings if not (s.closed or s.stateful)]
        st.skipped += len(framings) - len(todo)
        for session, tokens in todo + [(None, t) for t in prompts]:
            try:
                done = session.warm(tokens) if session is not None else self.manager.warm(engine, tokens)
            except OutOfPages:  # warming is opportunistic: it never takes pages that sessions hold
                st.skipped += 1
                continue
            st.prefixes += 1
            st.prefilled_tokens += done.prefilled
            st.cached_tokens += done.reused
        st.runs += 1
        st.seconds += time.perf_counter() - t0

    def wait(self) -> None:
        """Block until every submitted warm is done; re-raises the first error. A no-op on the worker itself (a
        streamed-output prefill runs ``Session.prefill``, which waits for warms before touching pages)."""
        if threading.current_thread().name.startswith("ft-kv-prestage"):
            return
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            future.exception()  # waits
        with self._lock:  # only those seen finished are dropped (another thread may have queued one meanwhile)
            self._futures = [f for f in self._futures if f not in futures]
        for future in futures:
            future.result()  # a failed warm is reported once, to the caller that found it

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
