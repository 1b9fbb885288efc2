"""``LocalEngine``: the in-process runtime as a backend — the model's own chat template, streaming, phase hints."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from freetoken_agent.backends.base import (
    Constraint, GenerateRequest, GenerationDone, TextBackend, TextChunk, TokenLogprobs, check_context, stop_hit,
)
from freetoken_agent.chat import detect_format
from freetoken_agent.events import Usage
from freetoken_agent.phases import Phase

MARK = "\u2063freetoken-prestage\u2063"
"""Stands in for content not known yet when rendering the start of a future prompt (``expect_prompt``)."""


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: tool-call arguments as objects, not JSON strings."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                fn = dict(call.get("function", {}))
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"] or "{}")
                    except json.JSONDecodeError:
                        pass  # keep the text; the template renders it as is
                fixed.append({**call, "function": fn})
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out


POOL_SIZE = 16
"""Idle sessions kept for key-less requests (each holds its KV until the pool evicts it under memory pressure)."""


class LocalEngine(TextBackend):
    """A backend around a runtime ``Engine`` in this process.

    The prompt is rendered with the model's chat template (tools included); tool calls are parsed in the format
    the template reveals (or ``tool_format``). Each conversation (``request.session``, the agent's run id) gets an
    engine session, so a turn prefills only what its cached prefix does not cover; phase hints go to that session
    (a ``tool`` hint lets it keep, offload or drop its KV while the tool runs). Requests without a conversation key
    (a server's clients) take the idle pooled session whose log shares the longest prefix with their prompt, so a
    client's next turn continues its own KV (hybrid models included). Any number of requests run at once: the
    engine's scheduler batches them.

    Phase scheduling: with ``phase_scheduling`` None (default) a ``PhaseScheduler`` is attached when the engine was
    loaded under a memory budget with the ``phase`` residency policy (True: whenever it has a budget; False: never).
    Its counters are ``stats()["phase"]``; its routing profile is saved at the end of each agent run. While a tool
    runs, the start of the next prompt (``expect_prompt``: the conversation and the tool-result framing) and the
    prompts of ``register_prompt`` are warmed in the engine's prefix cache.
    """

    def __init__(self, engine: Any, tool_format: str | None = None, phase_scheduling: bool | None = None) -> None:
        self.engine = engine
        config = {"model_type": getattr(getattr(engine, "spec", None), "model_type", "")}
        self.tool_format = tool_format or detect_format(engine.chat_template, config)
        self._eos = set(engine.eos_token_ids)
        self._sessions: dict[str, Any] = {}
        self._pool: list[Any] = []
        """Idle engine sessions for requests without a conversation key (``POOL_SIZE`` at most)."""
        self.pause_decisions: list[str] = []  # what the engine chose at each tool pause (keep/offload/drop)
        self.scheduler = attach_scheduler(engine, phase_scheduling)
        """The engine's ``PhaseScheduler`` (None on an engine without one)."""

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], device: str = "cpu", dtype: str = "float32",
                        tool_format: str | None = None, phase_scheduling: bool | None = None,
                        **engine_kwargs: Any) -> LocalEngine:
        """Load a Hugging Face model folder with the runtime engine (``engine_kwargs``: e.g. ``budget``,
        ``residency``, ``quant``, ``threads`` for ``Engine.from_pretrained``)."""
        from freetoken_agent.runtime.engine import Engine

        engine = Engine.from_pretrained(path, device=device, dtype=dtype, require_tokenizer=True, **engine_kwargs)
        return cls(engine, tool_format, phase_scheduling)

    def hint(self, phase: Phase, expected_s: float | None = None, session: str | None = None) -> None:
        engine_session = self._sessions.get(session) if session is not None else None
        if engine_session is None:
            self.engine.hint(phase, expected_s)
            return
        decision = engine_session.hint(phase, expected_s)
        if phase is Phase.TOOL:
            self.pause_decisions.append(decision)

    def end_session(self, session: str) -> None:
        engine_session = self._sessions.pop(session, None)
        if engine_session is not None:
            engine_session.close()
        if self.scheduler is not None:
            self.scheduler.save()  # the next run (or process) starts from this run's routing profile

    def expect_prompt(self, session: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        """Conversation ``session``'s next prompt renders ``messages``, whose last content is not known yet (a
        running tool's output): the tokens before it are warmed in the prefix cache at the next tool pause."""
        engine_session, ids = self._next_prompt(session, messages, tools, known="")
        if ids:
            engine_session.expect(ids)

    def stream_tool_output(
        self, session: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> None:
        """The running tool's result starts with the last message's content (its output so far): prefill the
        conversation up to there into the session in the background, so only the rest is left when the tool ends.
        Each call supersedes a queued one; a prompt that finally tokenizes differently falls back to the longest
        common prefix."""
        known = str(messages[-1].get("content") or "") if messages else ""
        engine_session, ids = self._next_prompt(session, messages, tools, known)
        if ids:
            self.engine.kv_manager().prestage.feed(engine_session, ids)

    def _next_prompt(
        self, session: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, known: str
    ) -> tuple[Any, list[int]]:
        """Conversation ``session``'s engine session and the ids of its next prompt up to where the last message's
        content stops being ``known`` ([] when there is no such session)."""
        engine_session = self._sessions.get(session)
        if engine_session is None or not messages:
            return None, []
        return engine_session, self.prefix_ids([*messages[:-1], {**messages[-1], "content": known + MARK}], tools)

    def register_prompt(self, phase: Phase, system: str, tools: list[dict[str, Any]] | None = None) -> int:
        """A prompt that ``phase``'s conversations start with (a sub-agent's system prompt and tool schemas): kept
        warm in the prefix cache, recomputed during tool pauses if evicted. Returns the tokens registered."""
        ids = self.prefix_ids([{"role": "system", "content": system}, {"role": "user", "content": MARK}], tools)
        if ids:
            self.engine.kv_manager().prestage.register(Phase(phase).value, ids)
        return len(ids)

    def prefix_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """Token ids of the rendered ``messages`` up to ``MARK`` (empty when the template drops it)."""
        text = self.engine.render_chat(template_messages(messages), tools or None, add_generation_prompt=False)
        cut = text.find(MARK)
        if cut <= 0:
            return []
        return self.engine.tokenizer.encode(text[:cut])[:-1]  # the last token may merge with what follows

    def _session(self, key: str | None) -> Any:
        if key is None:
            return None
        if key not in self._sessions:
            self._sessions[key] = self.engine.session()
        return self._sessions[key]

    def stats(self) -> dict[str, Any] | None:
        return self.engine.stats()

    def render(self, request: GenerateRequest) -> str:
        """The prompt text for ``request``."""
        if request.prompt is not None:
            return request.prompt
        return self.engine.render_chat(template_messages(request.messages), request.tools or None,
                                       add_generation_prompt=True)

    @property
    def context_length(self) -> int:
        """The model's context (``max_position_embeddings``)."""
        return int(self.engine.spec.max_position)

    def sampling_defaults(self) -> dict[str, Any]:
        """The model's sampling defaults from its ``generation_config.json`` (``temperature``, ``top_p``,
        ``top_k``) when it samples (``do_sample``); {} for a greedy model. A server uses them for fields a
        request leaves out."""
        config = getattr(self.engine, "generation_config", None) or {}
        if not config.get("do_sample"):
            return {}
        out: dict[str, Any] = {}
        for key, kind in (("temperature", float), ("top_p", float), ("top_k", int)):
            value = config.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
                out[key] = kind(value)
        if "top_p" in out and not 0 < out["top_p"] <= 1:
            del out["top_p"]
        return out

    def count_tokens(self, request: GenerateRequest) -> int:
        return len(self.engine.tokenizer.encode(self.render(request)))

    @property
    def supports_constraints(self) -> bool:  # type: ignore[override]
        """Grammar-constrained output needs a ``tokenizer.json`` (the grammar engine reads it) and llguidance."""
        import importlib.util

        path = getattr(self.engine, "path", None)
        return path is not None and (Path(path) / "tokenizer.json").exists() and \
            importlib.util.find_spec("llguidance") is not None

    def grammar(self, constraint: Constraint, tools: list[dict[str, Any]]) -> Any:
        """A fresh ``GrammarProcessor`` enforcing ``constraint`` (one per request: it holds the grammar's state)."""
        from freetoken_agent.chat.grammar import tool_call_lark
        from freetoken_agent.runtime.generation.constraints import (
            JSON_STYLE, GrammarError, GrammarProcessor, grammar_tokenizer, json_schema_grammar, lark_grammar,
        )

        vocab = int(self.engine.spec.vocab_size)
        tokenizer = grammar_tokenizer(Path(self.engine.path) / "tokenizer.json", vocab, tuple(sorted(self._eos)))
        if constraint.kind == "json":
            grammar = json_schema_grammar(constraint.schema or {"type": "object"})
        else:
            try:
                grammar = lark_grammar(tool_call_lark(self.tool_format, tools, constraint.name, constraint.parallel,
                                                      self.engine.tokenizer.token_id, JSON_STYLE))
            except ValueError as exc:
                raise GrammarError(str(exc)) from None
        return GrammarProcessor(tokenizer, grammar, vocab)

    async def stream_text(self, request: GenerateRequest) -> AsyncIterator[TextChunk | GenerationDone]:
        ids = self.engine.tokenizer.encode(self.render(request))
        check_context(len(ids), request, self.context_length)
        greedy = request.temperature <= 0 or request.top_p <= 0
        sampling = {"max_new_tokens": request.max_tokens, "temperature": 0.0 if greedy else request.temperature,
                    "top_p": 1.0 if greedy else request.top_p, "top_k": 0 if greedy else request.top_k,
                    "seed": request.seed, "stop": tuple(request.stop)}
        processors, recorder = self.processors(request, sampling["temperature"], ids)
        if processors:
            from freetoken_agent.runtime.generation.processors import Chain

            sampling["processor"] = processors[0] if len(processors) == 1 else Chain(processors)
        count, finish, text, out_ids = 0, "length", [], []
        decode = self.engine.tokenizer.decode
        logprobs: list[TokenLogprobs] = []  # per token, as each is picked (the recorder learned it before its event)
        held = 0  # tokens since the last chunk (their text was incomplete or held back for a stop string)
        async for item in self._stream(ids, request.session, sampling):
            if isinstance(item, tuple):
                count += 1
                held += 1
                out_ids.append(item[0])
                if recorder is not None:
                    e = recorder.entries[count - 1]
                    logprobs.append(TokenLogprobs(decode([e.token]), e.logprob,
                                                  tuple((decode([i]), v) for i, v in e.top)))
                if item[1]:
                    text.append(item[1])
                    yield TextChunk(item[1], held, None if recorder is None else tuple(logprobs[count - held:]))
                    held = 0
            else:
                finish = item
        stop = None
        if finish == "stop" and request.stop and out_ids and out_ids[-1] not in self._eos:
            stop = stop_hit(decode(out_ids), len("".join(text)), request.stop)
        yield GenerationDone(finish, Usage(len(ids), count), stop, None if recorder is None else tuple(logprobs))

    supports_logits = True

    def processors(self, request: GenerateRequest, temperature: float, prompt: list[int] | None = None,
                   ) -> tuple[list[Any], Any]:
        """The request's logits processors, in order (biases and penalties, min-p, the grammar, the log-probability
        recorder last, so it sees the distribution the pick is drawn from), and the recorder (or None). ``prompt``:
        the prompt's token ids (the repetition penalty covers them)."""
        from freetoken_agent.runtime.generation.processors import (
            LogitBias, LogprobRecorder, MinP, Penalties, RepetitionPenalty,
        )

        out: list[Any] = []
        if request.logit_bias:
            vocab = int(self.engine.spec.vocab_size)
            outside = [t for t in request.logit_bias if not 0 <= t < vocab]
            if outside:
                from freetoken_agent.runtime.errors import SamplingError

                raise SamplingError(f"logit_bias names token {outside[0]}, outside the vocabulary (0..{vocab - 1})")
            out.append(LogitBias(request.logit_bias))
        if request.repetition_penalty != 1.0:
            out.append(RepetitionPenalty(request.repetition_penalty, prompt or ()))
        if request.frequency_penalty or request.presence_penalty:
            out.append(Penalties(request.frequency_penalty, request.presence_penalty))
        if request.min_p:
            out.append(MinP(request.min_p, temperature))
        if request.constraint is not None:
            out.append(self.grammar(request.constraint, request.tools))
        recorder = LogprobRecorder(request.logprobs) if request.logprobs is not None else None
        if recorder is not None:
            out.append(recorder)
        return out, recorder

    @property
    def pooled_sessions(self) -> tuple[Any, ...]:
        """The idle sessions kept for key-less requests."""
        return tuple(self._pool)

    def _checkout(self, ids: list[int]) -> Any:
        """The idle pooled session sharing the longest prefix with ``ids`` (a new one when none shares any)."""
        best = max(self._pool, key=lambda s: _shared(s.log, ids), default=None)
        if best is not None and (_shared(best.log, ids) or len(self._pool) >= POOL_SIZE):
            self._pool.remove(best)
            return best
        return self.engine.session()

    def _checkin(self, session: Any) -> None:
        self._pool.append(session)
        while len(self._pool) > POOL_SIZE:
            self._pool.pop(0).close()

    async def _stream(self, ids: list[int], key: str | None, sampling: dict[str, Any]) -> AsyncIterator[Any]:
        """(token id, text) per token (end-of-sequence text removed), then the finish reason."""
        session = self._session(key)
        pooled = session is None or session.busy  # a second request of one conversation runs beside it
        if pooled:
            session = self._checkout(ids)
        try:
            async for item in self._events(session, ids, sampling):
                yield item
        finally:
            if pooled:
                self._checkin(session)

    async def _events(self, session: Any, ids: list[int], sampling: dict[str, Any]) -> AsyncIterator[Any]:
        finish = "length"
        async for event in session.stream(ids, **sampling):
            text = event.text
            if event.finish_reason == "stop" and event.token_id in self._eos:
                eos_text = self.engine.tokenizer.decode([event.token_id])
                text = text[: -len(eos_text)] if eos_text and text.endswith(eos_text) else text
            yield event.token_id, text
            finish = event.finish_reason or finish
        yield finish


def _shared(log: list[int], ids: list[int]) -> int:
    n = 0
    for a, b in zip(log, ids):
        if a != b:
            break
        n += 1
    return n


def attach_scheduler(engine: Any, enabled: bool | None) -> Any:
    """The engine's ``PhaseScheduler``: the one already attached, else a new one when ``enabled`` (None: when the
    engine's residency policy is ``phase``); None otherwise. ``enabled=True`` without a budget is a one-line error."""
    from freetoken_agent.runtime.experts.phase import PhaseScheduler

    existing = PhaseScheduler.of(engine)
    if existing is not None or enabled is False:
        return existing
    store = getattr(engine, "residency", None)
    if enabled is None and (store is None or getattr(store.host.policy, "name", None) != "phase"):
        return None
    return PhaseScheduler.attach(engine)
