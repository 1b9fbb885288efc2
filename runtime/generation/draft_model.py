"""Speculative decoding with a draft model: a small model of the same tokenizer proposes the next tokens.

Prompt lookup (``speculative.PromptLookup``) drafts only what the context already holds; a draft model drafts
anything it can predict — prose in ``plan`` turns as well as copies in ``code`` turns. ``DraftModel`` wraps a second
``Engine`` (any architecture and weight format the engine loads) and hands each sequence of the main engine a
``ModelDrafter``. A drafter owns one of the draft engine's KV sessions while its sequence lives: a proposal is one
greedy turn of at most k tokens on that session, so the draft model's KV follows the sequence incrementally — the
session keeps what the sequence already fed, rolls rejected drafts back to the longest common prefix, and a hybrid
draft model (recurrent layers) restarts from the state snapshot at the last verified position. When a sequence ends
its session goes back to a small pool; the next sequence takes the one whose tokens share the longest prefix with
its own (an agent's next turn continues the last one's context). Where prompt lookup matches ``lookup_match`` tokens
or more, its copy is the draft instead (free); the drafter names each draft's source (``copy`` / ``model``) and
``DraftPolicy`` keeps their acceptance and price apart.

Greedy drafts are proposals with certainty, so the main engine's verification (``Sampler.verify``: exact match when
greedy, the speculative-sampling rule otherwise) keeps its output exactly as without speculation; the draft model
changes only how many tokens a step yields. What drafting costs is measured (``seconds_per_token``) and priced into
the draft length beside the verify row's cost (``DraftPolicy``).
"""

from __future__ import annotations

import statistics
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

from freetoken_agent.runtime.errors import OptionError
from freetoken_agent.runtime.generation.prompt import common_prefix

PROBE = "def main(argv):\n    return {'path': \"src/ünïcode.py\", 'n': 42}  # ok → ✓\n"
"""Text whose ids both tokenizers must agree on (code, unicode, digits, whitespace runs)."""


def vocabulary_mismatch(main: Any, draft: Any) -> str | None:
    """Why the draft model's tokenizer cannot draft for the main model's (None: they agree). Compares the probe
    text's ids and the text of ids sampled over the shared id range."""
    if main is None or draft is None:
        return None
    a, b = main.encode(PROBE), draft.encode(PROBE)
    if a != b:
        return f"the tokenizers encode the same text differently ({a[:6]}... vs {b[:6]}...)"
    n = min(main.vocab_size, draft.vocab_size)
    for i in range(0, n, max(1, n // 2048)):
        if main.decode([i]) != draft.decode([i]):
            return f"token id {i} is {main.decode([i])!r} for the model and {draft.decode([i])!r} for the draft model"
    return None


class DraftModel:
    """A small model drafting for a larger one of the same tokenizer (``SpeculationConfig.draft_model``).

    ``engine``: the draft model's ``Engine`` (``DraftModel.load`` builds one). Its own speculation is turned off;
    requests of its own may still run on it. ``sessions``: idle KV sessions kept for later sequences.
    ``lookup_match``: prompt lookup drafts instead of the model where its match covers at least this many tokens (a
    copy from the context, free; 0: the model always drafts) — on held-out agent turns this took the built-in model's
    tokens per step at k = 7 from 1.98 to 3.07 on ``code`` spans and from 1.38 to 1.87 on ``plan`` spans."""

    def __init__(self, engine: Any, sessions: int = 8, name: str | None = None, lookup_match: int = 4) -> None:
        from freetoken_agent.runtime.generation.speculative import unsupported

        why = unsupported(engine.spec)
        if why is not None:
            raise OptionError(f"this draft model cannot draft: {why}")
        engine.speculation = False
        self.engine, self.keep = engine, max(0, sessions)
        self.lookup_match = max(0, lookup_match)
        self.copied = 0
        """Draft tokens that came from prompt lookup instead of the model."""
        self.name = name or (str(engine.path) if engine.path is not None else "draft model")
        self.vocab_size = int(engine.spec.vocab_size)
        self.max_position = int(engine.spec.max_position)
        self.stateful = bool(engine.spec.state_layers())
        self._lock = threading.Lock()
        self._idle: list[Any] = []  # sessions no live drafter holds, most recently released last
        self.proposals = 0
        self.fed = 0
        """Context tokens the draft model computed (those its sessions did not hold already)."""
        self.drafted = 0
        self.seconds = 0.0
        self.failures = 0
        self._seconds_per_token: float | None = None
        self._recent: list[float] = []  # seconds per draft token of the last proposals that priced one
        self.disabled: str | None = None
        """Why drafting stopped (a failed draft forward), or None."""
        self.owned = False
        """Loaded from a path for one engine, which closes it (``Engine.attach_draft_model``)."""

    @classmethod
    def load(cls, path: str | Path, main: Any = None, **kwargs: Any) -> DraftModel:
        """Load the draft model at ``path`` (a model folder or GGUF, as ``Engine.from_pretrained``; ``kwargs`` go
        there) and check it can draft for ``main`` (an ``Engine``: same tokenizer, where both have one)."""
        from freetoken_agent.runtime.engine import Engine

        engine = Engine.from_pretrained(path, speculate=False, **kwargs)
        model = cls(engine, name=str(path))
        if main is not None:
            try:
                model.check(main)
            except OptionError:
                model.close()
                raise
        return model

    def check(self, main: Any) -> None:
        """Refuse (``OptionError``) a draft model whose tokens mean other text than the main model's."""
        why = vocabulary_mismatch(main.tokenizer_or_none, self.engine.tokenizer_or_none)
        if why is not None:
            raise OptionError(f"the draft model {self.name} does not share the model's tokenizer: {why}")

    @property
    def seconds_per_token(self) -> float | None:
        """Seconds of drafting per draft token (the median of recent proposals; see ``record``); None before one."""
        return self._seconds_per_token

    def drafter(self, history: Any = None) -> ModelDrafter:
        """A drafter for one sequence (``SpeculationConfig.drafter`` builds one per sequence); ``history``: the
        engine's ``TokenHistory``, which copies come from too."""
        return ModelDrafter(self, history)

    def acquire(self, tokens: list[int]) -> Any:
        """The idle session whose tokens share the longest prefix with ``tokens`` (a new one when none is idle)."""
        with self._lock:
            best, best_len = None, -1
            for s in reversed(self._idle):  # ties: the most recently released
                n = common_prefix(s.log, tokens)
                if n > best_len:
                    best, best_len = s, n
            if best is not None:
                self._idle.remove(best)
                return best
        return self.engine.session()

    def release(self, session: Any) -> None:
        """A drafter's sequence ended: keep its session for a later one (the oldest idle ones are closed)."""
        if session.closed:
            return
        with self._lock:
            self._idle.append(session)
            extra = self._idle[: max(0, len(self._idle) - self.keep)]
            del self._idle[: len(extra)]
        for s in extra:
            s.close()

    def record(self, drafted: int, seconds: float, fed: int) -> None:
        """A proposal drafted ``drafted`` tokens in ``seconds``, after feeding ``fed`` context tokens. Only proposals
        that fed what a decode step adds (at most one more than they draft) price a draft token: a new sequence's
        first proposal prefills its whole context once, which says nothing of the next ones. The price is the
        median of the last 15 (a slow moment does not stop drafting for good)."""
        self.proposals += 1
        self.drafted += drafted
        self.seconds += seconds
        if drafted and fed <= drafted + 2:
            self._recent.append(seconds / drafted)
            del self._recent[:-15]
            self._seconds_per_token = statistics.median(self._recent)

    def fail(self, exc: BaseException) -> None:
        """A draft forward failed: drafting stops (the main model decodes on without drafts), once, with a
        warning — a broken draft model never fails the main model's requests."""
        self.failures += 1
        if self.disabled is None:
            self.disabled = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"draft model {self.name} failed ({self.disabled}); speculation goes on without it",
                          RuntimeWarning, stacklevel=2)

    def snapshot(self) -> dict[str, Any]:
        """What the draft model did (``Engine.stats()["speculation"]["draft_model"]``)."""
        spt = self._seconds_per_token
        return {"name": self.name, "proposals": self.proposals, "fed": self.fed, "drafted": self.drafted,
                "copied": self.copied,
                "seconds": round(self.seconds, 4), "ms_per_token": None if spt is None else round(spt * 1e3, 3),
                "idle_sessions": len(self._idle), "disabled": self.disabled}

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()
        self.engine.close()


class ModelDrafter:
    """One sequence's drafter on a ``DraftModel`` (see the module docstring)."""

    def __init__(self, model: DraftModel, history: Any = None) -> None:
        from freetoken_agent.runtime.generation.speculative import ContextLookup, PromptLookup

        self.model = model
        self.lookup: Any = None
        if model.lookup_match:  # copies: from the sequence's own tokens, and the engine's history when it has one
            self.lookup = ContextLookup(history) if history is not None else PromptLookup()
        self._copied_at: tuple[int, list[int]] | None = None
        self.session: Any = None
        self._finalizer: Any = None
        self._checked = 0  # tokens[:_checked] are known to lie inside the draft model's vocabulary

    @property
    def seconds_per_token(self) -> float | None:
        return self.model.seconds_per_token

    def prepare(self, tokens: list[int]) -> None:
        if self.lookup is not None:
            self.lookup.prepare(tokens)

    def source(self, tokens: list[int]) -> tuple[str, float | None]:
        """Where the next proposal after ``tokens`` comes from: ``copy`` (prompt lookup matches enough: free) or
        ``model`` (its measured seconds per draft token); ``DraftPolicy`` prices and trusts each on its own."""
        copy = self._copy(tokens)
        return ("copy", None) if copy else ("model", self.model.seconds_per_token)

    def _copy(self, tokens: list[int]) -> list[int]:
        """Prompt lookup's draft of up to ``max_draft`` tokens after ``tokens`` when its match covers
        ``lookup_match`` tokens, else []; one lookup per length (``source`` and ``start`` of a step share it)."""
        if self.lookup is None:
            return []
        n = len(tokens)
        if self._copied_at is None or self._copied_at[0] != n:
            copy = self.lookup.propose(tokens, 64)
            self._copied_at = (n, copy if copy and self.lookup.match >= self.model.lookup_match else [])
        return self._copied_at[1]

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return self.finish(self.start(tokens, k))

    def start(self, tokens: list[int], k: int) -> Any:
        """Begin a proposal: the draft model's request is submitted and runs on its engine's thread while the
        caller starts other sequences' (the draft engine batches them); ``finish`` waits for it. None: no draft."""
        from freetoken_agent.runtime.generation.sampling import SamplingParams
        from freetoken_agent.runtime.scheduler import Request

        model = self.model
        n = len(tokens)
        if k <= 0 or not n:
            return None
        copy = self._copy(tokens)
        if copy:  # a copy from the context: no forward needed
            return copy[:k]
        if model.disabled is not None or n + k > model.max_position:
            return None
        if self._checked < n:  # a token the draft model has no embedding for: it cannot draft after it
            if max(tokens[self._checked :]) >= model.vocab_size:
                return None
            self._checked = n
        t0 = time.perf_counter()
        try:
            if self.session is None or self.session.closed:
                self.session = model.acquire(tokens)
                self._finalizer = weakref.finalize(self, model.release, self.session)
            session = self.session
            if model.stateful and n > 1:
                # a hybrid draft model cannot rewind its recurrent states: feed the verified tokens first, so the
                # session snapshots them, and the drafts roll back to that snapshot next time
                fed = session.submit(Request(tokens[:-1], kind="prefill")).result()
                model.fed += n - 1 - fed.reused_tokens
            handle = session.submit(Request(list(tokens), SamplingParams(max_new_tokens=k)))
        except Exception as exc:  # noqa: BLE001 — a broken draft model must never fail the main model's request
            model.fail(exc)
            return None
        return handle, n, k, t0

    def finish(self, started: Any) -> list[int]:
        """The draft tokens of a proposal ``start`` began ([] when it drafted nothing or the draft model failed)."""
        if started is None:
            return []
        if isinstance(started, list):  # prompt lookup's copy
            self.model.copied += len(started)
            return started
        handle, n, k, t0 = started
        model = self.model
        try:
            result = handle.result()
        except Exception as exc:  # noqa: BLE001 — as in ``start``
            model.fail(exc)
            return []
        fed = n - result.reused_tokens
        model.fed += fed
        draft = list(result.token_ids[:k])
        model.record(len(draft), time.perf_counter() - t0, fed)
        return draft
