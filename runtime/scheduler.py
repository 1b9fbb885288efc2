"""The scheduler: every request of an engine is a sequence; one thread steps them all through the runner.

Continuous batching in nano-vllm's shape: ``waiting`` and ``running`` queues, a token budget per step. Each step
takes, in order:

1. one decode token of every running sequence that is past its prompt (decode first: a long prompt never stalls
   another session's tokens by more than one step);
2. chunks of pending prompts (chunked prefill), oldest first, foreground before background (a tool's streamed
   output, KV warming during pauses), until the budget is spent;
3. new sequences from ``waiting`` (FIFO; preempted ones go back to its front) while budget and slots remain.

KV pages are reserved for every row before the forward. When the pool runs dry the scheduler frees, in this order:
unpinned prefix-cache pages (the pool's own LRU eviction), the KV of idle sessions — those paused in a ``tool``
phase first, then the least recently used —, and last the running sequence admitted most recently (preemption by
recompute: its pages are released and it re-enters ``waiting`` with its tokens so far; its prefix is matched again
in the radix tree and only the rest is recomputed; its sampler keeps its random state, so the output is as if it had
never been preempted). A request whose own prompt cannot fit the pool fails with a clear error instead of waiting
forever; cancellation (``RequestHandle.cancel``, a disconnected client) frees pages at the next step.

Phases are scheduling input: each sequence carries the phase of its session; background work (prefills during tool
pauses) uses only the budget that foreground sequences leave, and after ``BACKGROUND_AGE_STEPS`` steps of waiting it
is served like foreground work, so nothing starves. ``phase_mix()`` is the batch's phase composition that residency
staging follows (``Engine`` tells the expert store when it changes).

Speculative decoding (``generation/speculative.py``, on unless ``speculation.enabled`` is False): after the decode
rows are planned, each decoding sequence may get k draft tokens from its own context (k chosen per sequence from its
acceptance and its phase's; drafts take budget like prefill tokens, before prefill chunks, and only pages already
free — a draft never evicts or preempts anything). Its row is then the last sampled token plus the drafts, and the
logits of all k + 1 positions come back; ``Sampler.verify`` keeps the longest prefix of drafts the model agrees with
plus the model's own next token, token by token (so a request's processor — penalties, grammar, logprobs — sees
exactly the kept tokens, in order, and a stop ends the row where it would have ended the sequence). Rejected drafts'
KV is truncated: pages past the new length go back to the pool. Recurrent states (hybrid models) cannot be truncated:
the row's starting states are snapshotted, and after a partial rejection the sequence's KV and states go back to the
row's start and the kept tokens are fed again in the next step (a "replay" row, drafted on no further), which
recomputes exactly the states after the last kept token. Length-dependent rotary embeddings (dynamic NTK, longrope)
turn a row by its whole length, so they speculate only within their original context, where a row of k + 1 turns as
k + 1 single steps would; a model whose forward of several tokens is not the same as single steps (``unsupported``:
Doge's product-key router) never speculates.

Control is integers (ids, positions, page counts); tensors appear only in the rows handed to the runner.
"""

from __future__ import annotations

import asyncio
import atexit
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from freetoken_agent.runtime.errors import FreeTokenError, PromptError
from freetoken_agent.runtime.generation.prompt import as_token_ids
from freetoken_agent.runtime.generation.sampling import Sampler, SamplingParams, StopChecker
from freetoken_agent.runtime.generation.speculative import (
    DraftPolicy,
    PhaseAcceptance,
    SpeculationConfig,
    SpeculationStats,
    StepCost,
    unsupported,
)
from freetoken_agent.runtime.kv.pool import OutOfPages
from freetoken_agent.runtime.runner import ModelRunner, Row

if TYPE_CHECKING:
    from freetoken_agent.runtime.kv.session import KVManager, Session
    from freetoken_agent.runtime.tokenizer.tokenizer import Tokenizer

Kind = Literal["generate", "prefill", "logits"]
BACKGROUND_AGE_STEPS = 64
"""Steps a background sequence waits behind foreground work before it is served like foreground work."""


class ContextLengthError(FreeTokenError):
    """A prompt does not fit the model's context (or the KV pool)."""


class RequestCancelled(FreeTokenError):
    """The request was cancelled before it finished."""


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. ``text`` is the decoded delta (may be empty while a character is incomplete)."""

    token_id: int
    text: str
    finish_reason: str | None = None
    """Set on the last event: ``stop`` (stop token/string) or ``length`` (max_new_tokens or the context's end)."""
    step: int = -1
    """The scheduler step that produced it (tests bound the gaps between a sequence's tokens with it)."""


@dataclass
class Request:
    """What ``Engine.submit`` takes."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    kind: Kind = "generate"
    """``generate`` (prefill, then sample), ``prefill`` (feed only: KV warming), ``logits`` (every new position's
    logits, no sampling: verification)."""
    session: Session | None = None
    """The session whose cache holds the KV (multi-turn reuse); None: a cache of its own, with prefix-cache reuse."""
    background: bool = False
    """Low priority (prefill during a tool pause): served from the budget foreground work leaves."""
    phase: str | None = None
    reuse: bool = True
    """Session-less requests: match and publish prefixes in the radix tree (False for verification runs)."""
    opportunistic: bool = False
    """KV warming: pages only from the free list or the prefix cache's unpinned leaves — never by growing an elastic
    pool, evicting a session or preempting a sequence; fails with ``OutOfPages`` instead."""


@dataclass
class RequestResult:
    """What a finished request produced."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    reused_tokens: int
    prefill_s: float
    decode_s: float
    logits: torch.Tensor | None = None
    """``logits`` requests: [new positions, V] fp32."""


class RequestHandle:
    """A submitted request: a stream of ``TokenEvent`` (blocking or async), ``cancel``, ``result``.

    Safe to use from any thread; the async iterator never blocks the event loop (the engine thread wakes it).
    """

    def __init__(self, request: Request, on_cancel: Callable[[RequestHandle], None]) -> None:
        self.request = request
        self._on_cancel = on_cancel
        self._cond = threading.Condition()
        self._events: list[TokenEvent] = []
        self._done = False
        self._error: BaseException | None = None
        self._result: RequestResult | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._readers = 0  # threads blocked in __iter__ for the next event (result() waits only for the end)
        self.cancelled = False

    # -- engine side
    def _push(self, event: TokenEvent) -> None:
        with self._cond:
            self._events.append(event)
            if self._readers or self._waiters:  # waking a thread that only waits for the end costs the engine
                self._wake()  # thread a context switch per token (measured 0.7 ms on a busy 2-core machine)

    def _finish(self, result: RequestResult | None, error: BaseException | None = None) -> None:
        with self._cond:
            self._result, self._error, self._done = result, error, True
            self._wake()

    def _wake(self) -> None:
        self._cond.notify_all()
        for loop, event in self._waiters:
            if not loop.is_closed():  # a consumer whose event loop ended is not woken
                try:
                    loop.call_soon_threadsafe(event.set)
                except RuntimeError:  # closed between the check and the call
                    pass
        self._waiters.clear()

    # -- client side
    @property
    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        """Stop the request: its pages are freed at the next step; iterators end, ``result`` raises."""
        if not self._done and not self.cancelled:
            self.cancelled = True
            self._on_cancel(self)

    def __iter__(self) -> Iterator[TokenEvent]:
        i = 0
        while True:
            with self._cond:
                while i >= len(self._events) and not self._done:
                    self._readers += 1
                    try:
                        self._cond.wait()
                    finally:
                        self._readers -= 1
                events, done = self._events[i:], self._done
            for event in events:
                yield event
            i += len(events)
            if done and i >= len(self._events):
                self._raise()
                return

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        i = 0
        try:
            while True:
                with self._cond:
                    events, done = self._events[i:], self._done
                    if not events and not done:
                        wake = asyncio.Event()
                        self._waiters.append((asyncio.get_running_loop(), wake))
                if not events and not done:
                    try:
                        await wake.wait()
                    finally:
                        with self._cond:
                            self._waiters = [w for w in self._waiters if w[1] is not wake]
                    continue
                for event in events:
                    await asyncio.sleep(0)  # a checkpoint per event: a consumer's cancellation lands between tokens
                    yield event
                i += len(events)
                if done and i >= len(self._events):
                    self._raise()
                    return
        except (asyncio.CancelledError, GeneratorExit):
            self.cancel()  # the consumer went away (a disconnected client): stop generating
            raise

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request is done (finished, failed or cancelled); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._done, timeout)

    def result(self, timeout: float | None = None) -> RequestResult:
        """Block until the request finishes; raises its error (``RequestCancelled`` when cancelled)."""
        if not self.wait(timeout):
            raise TimeoutError("the request did not finish in time")
        self._raise()
        assert self._result is not None
        return self._result

    async def aresult(self) -> RequestResult:
        async for _ in self:
            pass
        assert self._result is not None
        return self._result

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error


@dataclass
class Sequence:
    """The scheduler's record of one request (engine thread only)."""

    id: int
    request: Request
    handle: RequestHandle
    tokens: list[int]
    """Prompt, then every generated token."""
    max_new: int
    sampler: Sampler | None
    stops: set[int]
    checker: StopChecker
    text: Any  # IncrementalDecoder | None
    arrival: int
    """Step count at submission (ages background work)."""
    cache: Any = None  # KVCache / PagedKVCache while admitted
    computed: int = 0
    """Positions of ``tokens`` whose KV is in ``cache``."""
    generated: int = 0
    reused: int = 0
    prompt_len: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)
    t_admit: float = 0.0
    t_first: float = 0.0
    preemptions: int = 0
    spec: DraftPolicy | None = None
    """Speculative decoding: this sequence's drafter and acceptance (created at its first decode step)."""
    replay: int = 0
    """Tokens before the last sampled one to feed again (after a partial rejection in a model with recurrent
    states, the cache went back to the verified row's start)."""

    @property
    def remaining(self) -> int:
        """Tokens still to feed (1 while decoding: the last sampled token)."""
        return len(self.tokens) - self.computed

    @property
    def session(self) -> Session | None:
        return self.request.session

    @property
    def decoding(self) -> bool:
        """Past its prompt: what is left to feed is the last sampled token (and any replayed ones)."""
        return self.remaining == 1 + self.replay


@dataclass
class SchedulerStats:
    steps: int = 0
    batched_rows: int = 0
    """Σ sequences per step (mean batch = batched_rows / steps)."""
    max_batch: int = 0
    reused_tokens: int = 0
    """Prompt positions whose KV came from a cache at admission (first admissions only)."""
    preemptions: int = 0
    idle_session_evictions: int = 0
    cancelled: int = 0
    failed: int = 0
    finished: int = 0


_LIVE: weakref.WeakSet[Scheduler] = weakref.WeakSet()


def _rope_limit(runner: ModelRunner) -> int:
    """The length up to which every length-dependent rotary embedding turns with fixed frequencies (a speculative
    row of k + 1 tokens then turns as k + 1 single steps would); unbounded when there is none."""
    limit = 1 << 62
    decoder = getattr(runner, "decoder", None)
    for rotary in getattr(decoder, "rotary", None) or []:
        if rotary is not None and rotary.length_dependent:
            rope = rotary.spec
            limit = min(limit, rope.max_position, rope.original_max_position or rope.max_position)
    return limit


@atexit.register
def _close_all() -> None:
    """Stop engine threads before the interpreter tears torch down (a thread inside a forward at exit aborts)."""
    for sched in list(_LIVE):
        sched.close()


class Scheduler:
    """Owns every sequence of one engine and the thread that steps them (``start`` on first submit)."""

    def __init__(
        self,
        runner: ModelRunner,
        kv: Callable[[], KVManager],
        lock: threading.RLock,
        tokenizer: Tokenizer | None,
        eos_ids: list[int],
        vocab_size: int,
        max_position: int,
        token_budget: int = 512,
        max_running: int = 16,
        on_step: Callable[[Scheduler, float, int, int], None] | None = None,
        speculation: SpeculationConfig | None = None,
    ) -> None:
        self.runner, self._kv, self.lock = runner, kv, lock
        self.tokenizer, self.eos_ids, self.vocab_size = tokenizer, eos_ids, vocab_size
        self.max_position = max_position
        self.token_budget = max(1, token_budget)
        self.max_running = max(1, max_running)
        self.on_step = on_step
        """Called after each step with (scheduler, seconds, prefill tokens, tokens generated by decode rows) for
        engine stats."""
        self.speculation = speculation if speculation is not None else SpeculationConfig()
        """Speculative decoding settings (replace the object to change them; sequences pick it up at their next
        step)."""
        self.profile: Any = None
        """An object with ``enable()`` / ``disable()`` (a ``cProfile.Profile``) switched on around each step on the
        engine thread, where a profiler started on the caller's thread sees nothing (``gpu_check --profile``)."""
        self.spec_stats = SpeculationStats()
        self._phase_acceptance = PhaseAcceptance(self.speculation)
        self.step_cost = StepCost()
        """Decode steps' seconds against their tokens: what a draft token costs on this machine and model."""
        self._after_prefill = 0
        """Decode steps since the last step that ran a prompt chunk."""
        self._rope_limit = _rope_limit(runner)
        decoder = getattr(runner, "decoder", None)
        self.speculation_unsupported = unsupported(decoder.spec) if decoder is not None else None
        """Why this model never speculates (None: it does where it pays)."""
        self._step_drafts: dict[int, tuple[list[int], Any, int]] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self._inbox: list[Sequence] = []
        self._live: dict[int, Sequence] = {}
        """Every sequence submitted and not yet finished or failed, by id (under ``_wake``): what ``phase_mix`` reads,
        since a sequence moving from ``waiting`` to ``running`` on the engine thread is briefly in neither."""
        self._cancels: list[RequestHandle] = []
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._next_id = 0
        self._busy_sessions: set[int] = set()

    # ------------------------------------------------------------------------------------------------ client side

    def submit(self, request: Request) -> RequestHandle:
        """Queue ``request``; returns its handle at once. Raises for a request that can never run."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("submit() from the engine's own thread would wait on itself")
        prompt = as_token_ids(request.prompt)  # PromptError for anything but integer ids
        self._check(request, prompt)
        p = request.params
        room = self.max_position - len(prompt)
        max_new = min(p.max_new_tokens, room) if request.kind == "generate" else 0
        stops = set(self.eos_ids if p.stop_token_ids is None else p.stop_token_ids)
        text = None
        if self.tokenizer is not None and request.kind == "generate":
            from freetoken_agent.runtime.tokenizer.tokenizer import IncrementalDecoder

            text = IncrementalDecoder(self.tokenizer)
        handle = RequestHandle(request, self._cancel)
        with self._wake:
            if request.session is not None:
                if request.session.id in self._busy_sessions:
                    raise RuntimeError("this session already has a turn in flight: one turn at a time")
                self._busy_sessions.add(request.session.id)
            self._next_id += 1
            seq = Sequence(self._next_id, request, handle, prompt, max_new,
                           Sampler(p) if request.kind == "generate" else None, stops, StopChecker(p.stop), text,
                           self.stats.steps, prompt_len=len(prompt))
            self._inbox.append(seq)
            self._live[seq.id] = seq
            self._start()
            self._wake.notify_all()
        return handle

    def _check(self, request: Request, prompt: list[int]) -> None:
        if not prompt:
            raise PromptError("the prompt is empty: give at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        if len(prompt) > self.max_position or (request.kind == "generate" and len(prompt) >= self.max_position):
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens but the model's context is {self.max_position} positions"
                + (": no room to generate" if len(prompt) == self.max_position else ""))
        pool = self._kv().pool
        need = -(-len(prompt) // pool.page_size)
        if need > pool.num_pages:
            raise (OutOfPages if request.opportunistic else ContextLengthError)(
                f"the prompt needs {need} KV pages of {pool.page_size} positions but the pool holds "
                f"{pool.num_pages}: raise the KV budget ($FREETOKEN_KV_BUDGET_MB) or shorten the prompt")

    def _cancel(self, handle: RequestHandle) -> None:
        with self._wake:
            self._cancels.append(handle)
            self._wake.notify_all()

    def close(self) -> None:
        """Stop the engine thread (pending requests fail with ``RequestCancelled``)."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------------------------------------ engine thread

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="freetoken-engine", daemon=True)
            self._thread.start()
            _LIVE.add(self)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._inbox or self._cancels or self.waiting or self.running or self._stop):
                    self.runner.idle()
                    self._wake.wait()
                if self._stop:
                    break
                self.waiting.extend(self._inbox)
                self._inbox.clear()
                cancels, self._cancels = self._cancels, []
            try:
                with self.lock:
                    self._apply_cancels(cancels)
                    profile = self.profile
                    if profile is not None:
                        profile.enable()
                    try:
                        progressed = self.step()
                    finally:
                        if profile is not None:
                            profile.disable()
                if not progressed and self.waiting:  # nothing could run this time (pages held elsewhere): yield
                    time.sleep(0.001)
            except Exception as exc:  # a scheduler bug must not kill the engine: fail what is in flight, go on
                traceback.print_exc(file=sys.stderr)
                with self.lock:
                    for seq in [*self.running, *self.waiting]:
                        self._fail(seq, exc)
                    self.running.clear()
                    self.waiting.clear()
        with self.lock:
            for seq in [*self.running, *self.waiting, *self._inbox]:
                self._fail(seq, RequestCancelled("the engine was closed"))
            self.running.clear()
            self.waiting.clear()
            self._inbox.clear()
        self.runner.idle()

    def _apply_cancels(self, handles: list[RequestHandle]) -> None:
        if not handles:
            return
        ids = {id(h) for h in handles}
        for queue in (self.running, self.waiting):
            for seq in [s for s in queue if id(s.handle) in ids]:
                queue.remove(seq)
                self.stats.cancelled += 1
                self._fail(seq, RequestCancelled("the request was cancelled"))

    def step(self) -> bool:
        """Plan and run one step; returns False when there was nothing to run."""
        rows, seqs, prefill, decode = self._plan()
        if not rows:
            return False
        t0 = time.perf_counter()
        try:
            outs = self.runner.run(rows)
        except Exception as exc:  # a bad weight, an OOM: the step's sequences fail, the others go on
            for seq in seqs:
                self.running.remove(seq)
                self._fail(seq, exc)
            return True
        seconds = time.perf_counter() - t0
        st = self.stats
        st.steps += 1
        st.batched_rows += len(rows)
        st.max_batch = max(st.max_batch, len(rows))
        generated = 0
        for seq, row, logits in zip(seqs, rows, outs):
            before = seq.generated
            verify = self._step_drafts.pop(seq.id, None)
            seq.computed += int(row.tokens.shape[0]) - row.draft
            try:
                if verify is not None:
                    self._verify(seq, logits, *verify)
                else:
                    self._after(seq, logits)
            except FreeTokenError as exc:  # NaN logits (sampling's NumericalError): this one fails, the others go on
                if seq in self.running:
                    self.running.remove(seq)
                self._fail(seq, exc)
            if seq.id in decode:
                generated += seq.generated - before
        self._step_drafts.clear()
        self._after_prefill = 0 if prefill else self._after_prefill + 1
        if self._after_prefill > StepCost.COLD_STEPS:  # a warm decode step's seconds against its tokens (rows, drafts)
            self.step_cost.observe(sum(int(r.tokens.shape[0]) for r in rows), seconds)
        if self.on_step is not None:
            self.on_step(self, seconds, prefill, generated)
        return True

    # ------------------------------------------------------------------------------------------------ planning

    def _plan(self) -> tuple[list[Row], list[Sequence], int, set[int]]:
        budget = self.token_budget
        self._preempted_now: set[int] = set()
        self._step_drafts.clear()
        plan: list[tuple[Sequence, int]] = []
        planned: set[int] = set()

        def take(seq: Sequence, n: int) -> bool:
            nonlocal budget
            if not self._reserve(seq, n, planned):
                return False
            plan.append((seq, n))
            planned.add(seq.id)
            budget -= n
            return True

        for seq in [s for s in self.running if s.decoding]:  # decode first
            if budget > 0 and seq in self.running:
                take(seq, seq.remaining)
        speculate = self.speculation.enabled and self.speculation_unsupported is None
        drafts = self._drafts(plan, budget) if speculate else {}
        budget -= sum(len(d) for d in drafts.values())
        order = sorted((s for s in self.running if s.remaining > 1 and not s.decoding), key=self._priority)
        for seq in order:
            if budget <= 0:
                break
            if seq in self.running and seq.id not in planned:
                take(seq, min(seq.remaining, budget))
        while budget > 0 and self.waiting and len(self.running) < self.max_running:
            seq = self._next_waiting()
            if seq is None:
                break
            if seq.id in self._preempted_now:  # it just gave its pages up: not back in the same step
                self.waiting.appendleft(seq)
                break
            if not self._admit(seq):
                continue
            n = min(seq.remaining, budget)
            if not take(seq, n):
                break
        if speculate and budget > 0:  # sequences admitted with one token left (a cached prompt)
            admitted = [(s, n) for s, n in plan if s.id not in drafts and s.decoding and n == s.remaining]
            drafts.update(self._drafts(admitted, budget))
        # a sequence preempted after it was planned gives its row back
        plan = [(s, n) for s, n in plan if s in self.running]
        rows = []
        stateful = self._kv().stateful
        for s, n in plan:
            draft = drafts.get(s.id) if s.cache is not None else None
            if draft:
                snapshot = s.cache.snapshot_states() if stateful else None
                self._step_drafts[s.id] = (draft, snapshot, s.computed)
                rows.append(Row(s.cache, torch.tensor(s.tokens[s.computed : s.computed + n] + draft), "draft",
                                len(s.tokens) + len(draft), len(draft)))
            else:
                rows.append(Row(s.cache, torch.tensor(s.tokens[s.computed : s.computed + n]), self._want(s, n),
                                len(s.tokens)))
        prefill = sum(n for s, n in plan if not s.decoding)
        return rows, [s for s, _ in plan], prefill, {s.id for s, _ in plan if s.decoding}

    def _drafts(self, plan: list[tuple[Sequence, int]], budget: int) -> dict[int, list[int]]:
        """Draft tokens for the decode rows planned so far (sequence id → drafts), within ``budget`` tokens and the
        pages free right now."""
        out: dict[int, list[int]] = {}
        config = self.speculation
        if self._phase_acceptance.config is not config:
            self._phase_acceptance = PhaseAcceptance(config)
        chosen: list[tuple[Sequence, int, int, bool, Any]] = []  # (sequence, row tokens, k, started?, drafts or handle)
        for seq, n in plan:
            if budget <= 0:
                break
            if seq.request.kind != "generate" or seq.replay or seq.sampler is None or seq.cache is None:
                continue
            length = len(seq.tokens)
            limit = min(budget, seq.max_new - seq.generated - 1, self.max_position - length,
                        self._rope_limit - length)
            if limit <= 0:
                continue
            k = self._policy(seq).length(self._phase(seq), limit, seq.tokens)
            if k <= 0:
                continue
            start = getattr(seq.spec.drafter, "start", None)  # a draft model: every proposal runs before any wait
            if start is not None:
                chosen.append((seq, n, k, True, start(seq.tokens, k)))
                budget -= k
            else:
                draft = list(seq.spec.drafter.propose(seq.tokens, k))[:k]
                chosen.append((seq, n, k, False, draft))
                budget -= len(draft)
        for seq, n, k, started, got in chosen:
            assert seq.spec is not None
            draft = list(seq.spec.drafter.finish(got))[:k] if started else got  # type: ignore[attr-defined]
            bad = next((i for i, t in enumerate(draft) if not 0 <= t < self.vocab_size), None)
            if bad is not None:  # a drafter's token outside the vocabulary: the draft ends before it
                del draft[bad:]
            if not draft:
                continue
            cache = seq.cache
            pool = cache.pool
            ps = pool.page_size
            end = cache.length + n
            while draft and -(-(end + len(draft)) // ps) - len(cache.pages) > pool.num_free:
                draft.pop()  # drafts take only free pages: never an eviction or a preemption
            if not draft:
                continue
            try:
                cache.reserve(n + len(draft))
            except OutOfPages:
                continue
            out[seq.id] = draft
        return out

    @staticmethod
    def _phase(seq: Sequence) -> str | None:
        return seq.request.phase or (seq.session.phase if seq.session is not None else None)

    def _priority(self, seq: Sequence) -> tuple[int, int]:
        aged = self.stats.steps - seq.arrival >= BACKGROUND_AGE_STEPS
        return (1 if seq.request.background and not aged else 0, seq.id)

    def _next_waiting(self) -> Sequence | None:
        """The oldest foreground waiting sequence (background ones only when no foreground one waits, or aged)."""
        best = min(self.waiting, key=self._priority, default=None)
        if best is not None:
            self.waiting.remove(best)
        return best

    def _want(self, seq: Sequence, n: int) -> str:
        kind = seq.request.kind
        if kind == "logits":
            return "all"
        if kind == "generate" and seq.computed + n == len(seq.tokens):
            return "last"
        return "none"

    def _admit(self, seq: Sequence) -> bool:
        """Attach a cache and align it with the sequence's tokens (prefix reuse); False if it failed."""
        manager = self._kv()
        keep_one = seq.request.kind != "prefill"
        try:
            if seq.session is not None:
                seq.cache = seq.session.cache
                reused = seq.session.begin(seq.tokens, keep_one=keep_one)
            else:
                from freetoken_agent.runtime.kv.paged import PagedKVCache

                alloc = manager.alloc_cached if seq.request.opportunistic else manager.alloc
                seq.cache = PagedKVCache(manager.pool, alloc, manager.radix.evict_page, manager.radix.move_page)
                reused = 0
                if seq.request.reuse and not manager.stateful:
                    match = manager.radix.match_prefix(seq.tokens)
                    reused = min(match.length, len(seq.tokens) - 1 if keep_one else len(seq.tokens))
                    reused = reused // manager.pool.page_size * manager.pool.page_size
                    if reused:
                        seq.cache.adopt(match.pages[: reused // manager.pool.page_size], reused)
        except Exception as exc:
            self._fail(seq, exc)
            return False
        seq.computed = reused
        if not seq.preemptions:
            seq.reused = reused
            seq.t_admit = time.perf_counter()
            self.stats.reused_tokens += reused
        self.running.append(seq)
        if seq.remaining == 0:  # a prefill whose tokens are all cached already
            self.running.remove(seq)
            self._complete(seq, "stop")
            return False
        return True

    def _reserve(self, seq: Sequence, n: int, planned: set[int]) -> bool:
        """Pages for ``n`` more positions of ``seq``, freeing others' KV when the pool is dry."""
        while True:
            try:
                seq.cache.reserve(n)
                return True
            except OutOfPages as exc:
                if seq.request.opportunistic or seq.request.background:  # never at anyone else's expense
                    self.running.remove(seq)
                    self._fail(seq, exc)
                    return False
                if self._evict_idle_session():
                    continue
                # the lowest-priority running sequence gives its pages up (the youngest, background ones first): when
                # that is ``seq`` itself it yields instead of taking an older one's, or two long sequences that do not
                # fit together would preempt each other forever, each losing its work before it could finish
                others = [s for s in self.running if s is not seq]
                if others:
                    victim = max([*others, seq], key=self._priority)
                    self._preempt(victim)
                    if victim is seq:
                        return False
                    continue
                # nothing else holds pages: this sequence alone does not fit
                self.running.remove(seq)
                self._fail(seq, ContextLengthError(f"{exc} (this request alone needs more)"))
                return False

    def _evict_idle_session(self) -> bool:
        """Drop the KV of one session that is not running: a tool-paused one first, then the least recently used."""
        manager = self._kv()
        active = {s.session.id for s in self.running if s.session is not None}
        idle = [s for s in manager.sessions.values() if s.id not in active and s.cache.pages]
        if not idle:
            return False
        victim = min(idle, key=lambda s: (s.phase != "tool", s.last_used))
        victim.evict()
        self.stats.idle_session_evictions += 1
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq, publish=True)
        if seq.session is not None:
            seq.session.evict()  # its published pages stay in the radix tree until evicted
        seq.cache, seq.computed, seq.replay = None, 0, 0
        seq.preemptions += 1
        self.stats.preemptions += 1
        self._preempted_now.add(seq.id)
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------------------------------------ results

    def _after(self, seq: Sequence, logits: torch.Tensor | None) -> None:
        kind = seq.request.kind
        if kind == "logits":
            assert logits is not None
            seq.logits.append(logits)
        if seq.remaining > 0:
            return
        if kind != "generate":
            self.running.remove(seq)
            self._complete(seq, "stop")
            return
        assert logits is not None and seq.sampler is not None
        seq.replay = 0
        if seq.max_new == 0:
            self.running.remove(seq)
            self._complete(seq, "length")
            return
        if seq.generated == 0 and self.speculation.enabled and self.speculation_unsupported is None:
            self._policy(seq).prepare(seq.tokens)  # with the prompt's processing, before its first token
        self._deliver(seq, [self._judge(seq, seq.sampler(logits[-1]))])

    def _policy(self, seq: Sequence) -> DraftPolicy:
        """The sequence's draft policy under the current speculation settings (made on first use)."""
        config = self.speculation
        if self._phase_acceptance.config is not config:
            self._phase_acceptance = PhaseAcceptance(config)
        if seq.spec is None or seq.spec.config is not config:
            seq.spec = DraftPolicy(config, self._phase_acceptance, cost=self.step_cost)
        return seq.spec

    def _judge(self, seq: Sequence, token: int) -> TokenEvent:
        """Account one sampled token: its text delta and whether it ends the sequence (nothing is sent yet)."""
        if seq.generated == 0:
            seq.t_first = time.perf_counter()
        seq.generated += 1
        delta = seq.text.push(token) if seq.text is not None else ""
        delta, hit_stop = seq.checker.feed(delta)
        step = self.stats.steps
        if token in seq.stops or hit_stop:
            return TokenEvent(token, delta + ("" if hit_stop else seq.checker.flush()), "stop", step)
        if seq.generated >= seq.max_new:
            return TokenEvent(token, delta + seq.checker.flush(), "length", step)
        return TokenEvent(token, delta, None, step)

    def _deliver(self, seq: Sequence, events: list[TokenEvent]) -> None:
        """Append the judged tokens, send their events, complete the sequence when the last one ends it."""
        for event in events:
            seq.tokens.append(event.token_id)  # a final token is never fed: the cache ends before it
            if event.finish_reason is not None:
                self.running.remove(seq)
                seq.handle._push(event)
                self._complete(seq, event.finish_reason)
                return
            seq.handle._push(event)

    def _verify(self, seq: Sequence, logits: torch.Tensor | None, draft: list[int], snapshot: Any,
                start: int) -> None:
        """Speculative decoding: keep the drafts the model agrees with and its own next token; roll the rest back.

        ``logits`` [k + 1, V]: the last real token's position and each draft's; ``snapshot``: the recurrent states
        at ``start`` (the row's first position), None when the model has none."""
        assert logits is not None and seq.sampler is not None
        seq.replay = 0
        k = len(draft)
        events: list[TokenEvent] = []
        kept = 0
        greedy = seq.sampler.greedy_picks(logits)  # greedy without a processor: every position's argmax at once
        for j in range(k + 1):
            if greedy is not None:
                token = seq.sampler.take_greedy(greedy[0][j], greedy[1][j])
                ok = j < k and token == draft[j]
            elif j < k:
                token, ok = seq.sampler.verify(logits[j], draft[j])
            else:
                token, ok = seq.sampler(logits[j]), False
            kept += ok
            events.append(self._judge(seq, token))
            if not ok or events[-1].finish_reason is not None:
                break
        # KV: positions < seq.computed hold the fed real tokens, the next k the drafts; `kept` of them are right
        cache, st = seq.cache, self.spec_stats
        if kept < k:
            if snapshot is not None:  # recurrent states exist only at `start` and after the whole row
                fed = seq.computed - start
                cache.rollback(start)
                cache.restore_states(snapshot)
                seq.computed = start
                st.rolled_back += fed + k
                if events[-1].finish_reason is None:
                    seq.replay = fed + kept  # fed again with the new token next step
                    st.replayed += fed + kept
            else:
                cache.rollback(seq.computed + kept)
                seq.computed += kept
                st.rolled_back += k - kept
        else:
            seq.computed += k
        phase = self._phase(seq)
        judged = min(len(events), k)
        st.record(phase, k, kept, len(events), seq.spec.last_source if seq.spec is not None else None)
        if seq.spec is not None:
            seq.spec.observe(phase, judged, kept)
        self._deliver(seq, events)

    def _complete(self, seq: Sequence, reason: str) -> None:
        self._release(seq, publish=True)
        history = self.speculation.history
        if history is not None and self.speculation.enabled and seq.request.kind == "generate":
            # what it generated, for later sequences to draft from (only outputs decoded with speculation on)
            history.add(seq.tokens[max(0, seq.prompt_len - history.prompt_tail) : seq.prompt_len],
                        seq.tokens[seq.prompt_len :])
        self._busy_sessions.discard(seq.session.id if seq.session is not None else -1)
        now = time.perf_counter()
        first = seq.t_first or now
        result = RequestResult(
            seq.tokens[seq.prompt_len :], seq.checker.text, reason, seq.prompt_len, seq.reused,
            first - seq.t_admit if seq.t_admit else 0.0, now - first if seq.t_first else 0.0,
            torch.cat(seq.logits) if seq.logits else None,
        )
        self.stats.finished += 1
        with self._wake:
            self._live.pop(seq.id, None)
        seq.handle._finish(result)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        try:
            self._release(seq, publish=False)
        except Exception:  # releasing must not hide the original error
            traceback.print_exc(file=sys.stderr)
        self._busy_sessions.discard(seq.session.id if seq.session is not None else -1)
        if not isinstance(exc, RequestCancelled):
            self.stats.failed += 1
        with self._wake:
            self._live.pop(seq.id, None)
        seq.handle._finish(None, exc)

    def _release(self, seq: Sequence, publish: bool) -> None:
        """Give the sequence's cache back. A session keeps its cache and publishes its log (``Session.end``); an
        own cache publishes its full pages in the radix tree, then releases its references."""
        cache = seq.cache
        if cache is None:
            return
        if seq.session is not None:
            if publish:
                cache.truncate(cache.length)  # pages held beyond it (room to grow, rolled-back drafts) go back
                seq.session.end(seq.tokens[: cache.length])
            else:  # a failed step may have written part of a chunk: nothing in the cache is trusted
                seq.session.evict()
            seq.cache = None
            return
        manager = self._kv()
        if publish and seq.request.reuse and not manager.stateful and cache.length:
            ps = manager.pool.page_size
            full = cache.length // ps
            manager.radix.insert(seq.tokens[: full * ps], cache.pages[:full])
        cache.release()
        seq.cache = None

    # ------------------------------------------------------------------------------------------------ views

    def phase_mix(self, exclude: Any = None) -> dict[str, int]:
        """Sequences in flight (running, waiting, just submitted) per announced phase (what residency weighs), leaving out those of session
        ``exclude`` and those whose session never announced one (a server's plain requests)."""
        mix: dict[str, int] = {}
        with self._wake:
            live = list(self._live.values())
        for seq in live:
            if exclude is not None and seq.session is exclude:
                continue
            phase = seq.request.phase or (seq.session.phase if seq.session is not None else None)
            if phase is not None and not seq.request.background:
                mix[phase] = mix.get(phase, 0) + 1
        return mix

    def speculation_snapshot(self) -> dict[str, Any]:
        """What speculative decoding did so far (``Engine.stats()["speculation"]``)."""
        cfg = self.speculation
        return {"enabled": cfg.enabled and self.speculation_unsupported is None,
                "unsupported": self.speculation_unsupported, "max_draft": cfg.max_draft,
                "verify_cost": cfg.verify_cost if cfg.verify_cost is not None else round(self.step_cost.estimate(), 4),
                # a row of k + 1 tokens in 1-token steps, k = 1..max_draft: what the policy prices drafts at
                "row_cost": [round(1 + cfg.verify_cost * k if cfg.verify_cost is not None
                                   else self.step_cost.relative(k), 3) for k in range(1, cfg.max_draft + 1)],
                "drafter": ("custom" if cfg.drafter is not None else "draft model" if cfg.draft_model is not None
                            else "prompt lookup + history" if cfg.history is not None else "prompt lookup"),
                "history": cfg.history.snapshot() if cfg.history is not None else None,
                "draft_model": cfg.draft_model.snapshot() if cfg.draft_model is not None else None,
                **self.spec_stats.snapshot()}

    def snapshot(self) -> dict[str, Any]:
        st = self.stats
        return {"steps": st.steps, "mean_batch": round(st.batched_rows / st.steps, 3) if st.steps else None,
                "max_batch": st.max_batch, "running": len(self.running), "waiting": len(self.waiting),
                "preemptions": st.preemptions, "idle_session_evictions": st.idle_session_evictions,
                "cancelled": st.cancelled, "failed": st.failed, "finished": st.finished,
                "token_budget": self.token_budget, "max_running": self.max_running}
