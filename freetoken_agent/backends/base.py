"""The backend protocol: turn a conversation into a stream of parsed events, and take phase hints.

A backend yields the chat-parser vocabulary (:class:`~freetoken_agent.chat.TextDelta`, ``ToolCallStarted``,
``ToolCallFinished``, ``FormatError``) and ends with one :class:`GenerationDone`. Backends that produce raw text
(the local engine, the scripted backend) derive from :class:`TextBackend`, which runs the model family's
streaming tool-call parser; a remote OpenAI-compatible server parses on its side and sends calls structured.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Union, runtime_checkable

from freetoken_agent.chat import FormatError, TextDelta, ToolCallFinished, ToolCallStarted, make_parser
from freetoken_agent.events import Usage
from freetoken_agent.phases import Phase
from freetoken_agent.runtime.errors import FreeTokenError


@dataclass(frozen=True)
class Constraint:
    """What the output must be, enforced token by token by a backend that ``supports_constraints``: a call to one
    of the request's tools (``kind="tool_call"``; ``name`` forces that tool; ``parallel`` allows several), or one
    JSON value valid under ``schema`` (``kind="json"``)."""

    kind: str
    schema: dict[str, Any] | None = None
    name: str | None = None
    parallel: bool = True


@dataclass
class GenerateRequest:
    """One model call: OpenAI-style ``messages`` and ``tools``, or a raw ``prompt`` (plain completion)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    max_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()
    prompt: str | None = None
    session: str | None = None
    """Conversation key: requests with the same key continue one conversation (a local engine keeps its KV)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: off)."""
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    """The multiplicative penalty over every token of the prompt and the completion (transformers', vLLM's and
    llama.cpp's ``repetition_penalty``; 1.0: off)."""
    logprobs: int | None = None
    """Report each generated token's log probability and this many alternatives (None: no log probabilities)."""
    constraint: Constraint | None = None
    """Grammar-constrained output (a forced tool call, a JSON schema); None: free text."""
    strict_length: bool = False
    """``max_tokens`` was asked for explicitly: a prompt that leaves less room than that in the context is refused
    (``ContextOverflow``) instead of having its completion clipped to the room left."""


def stop_hit(full_text: str, emitted: int, stops: Sequence[str]) -> str | None:
    """Which of ``stops`` ended a generation whose whole text is ``full_text`` and whose text was cut at
    ``emitted`` characters (the earliest stop at or after the cut; None when none is there)."""
    found = [(i, s) for s in stops if s and (i := full_text.find(s, max(0, emitted - len(s) + 1))) != -1]
    return min(found)[1] if found else None


class ContextOverflow(FreeTokenError):
    """A request does not fit the model's context: ``prompt_tokens`` + ``max_tokens`` > ``context``."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context: int) -> None:
        if prompt_tokens >= context:
            message = (f"the prompt has {prompt_tokens} tokens; the model's context is {context} tokens (the "
                       "completion needs at least one more)")
        else:
            message = (f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceed the model's "
                       f"context of {context} tokens: ask for at most {context - prompt_tokens} tokens")
        super().__init__(message)
        self.prompt_tokens, self.max_tokens, self.context = prompt_tokens, max_tokens, context


def check_context(prompt_tokens: int, request: GenerateRequest, context_length: int | None) -> None:
    """Refuse (``ContextOverflow``) a prompt that does not fit the context, or (``strict_length``) that leaves
    less room than ``max_tokens``."""
    if context_length is None:
        return
    asked = request.max_tokens if request.strict_length else 1
    if prompt_tokens + asked > context_length:
        raise ContextOverflow(prompt_tokens, asked, context_length)


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's text and log probability, and the most likely alternatives as (text, log prob)."""

    text: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class GenerationDone:
    """The last event of a generation: why it stopped (``stop``, ``length``, ``tool_calls``) and its usage."""

    finish_reason: str
    usage: Usage = Usage()
    stop_sequence: str | None = None
    """The stop string that ended the generation (``finish_reason == "stop"`` on a ``stop`` string, not an EOS)."""
    logprobs: tuple[TokenLogprobs, ...] | None = None
    """Per generated token (``GenerateRequest.logprobs``): its text, log probability and the top alternatives."""


@dataclass(frozen=True)
class LogprobsDelta:
    """The log probabilities of the tokens generated since the last such event (requests with
    ``GenerateRequest.logprobs`` only). :meth:`TextBackend.generate` sends it just before the events parsed from
    those tokens' text, so a streaming server attaches it to the next piece of output it sends; the whole list
    also comes with :class:`GenerationDone` (tokens whose text is no output, such as an end-of-sequence token, only
    there)."""

    entries: tuple[TokenLogprobs, ...]


BackendEvent = Union[TextDelta, ToolCallStarted, ToolCallFinished, FormatError, LogprobsDelta, GenerationDone]


@runtime_checkable
class Backend(Protocol):
    """What the agent loop needs from a model."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[BackendEvent]:
        """Stream parsed events for ``request``; the last one is a :class:`GenerationDone`."""
        ...

    def hint(self, phase: Phase, expected_s: float | None = None) -> None:
        """The next phase of the agent (a no-op for backends that cannot use it)."""
        ...

    def stats(self) -> dict[str, Any] | None:
        """Engine statistics for the run summary, or None."""
        ...


@runtime_checkable
class SessionBackend(Backend, Protocol):
    """A backend that keeps state per conversation (``GenerateRequest.session``; the agent's run id).

    Its ``hint`` also takes the conversation, and ``end_session`` releases what was kept for it (the loop calls
    it when a run ends). The agent loop checks for this protocol; other backends get plain hints.
    """

    def hint(self, phase: Phase, expected_s: float | None = None, session: str | None = None) -> None:
        """The next phase of conversation ``session`` (or of the backend as a whole when None)."""
        ...

    def end_session(self, session: str) -> None:
        """Conversation ``session`` is over."""
        ...


@dataclass(frozen=True)
class TextChunk:
    """A piece of generated text and how many tokens it covers."""

    text: str
    tokens: int = 1
    logprobs: tuple[TokenLogprobs, ...] | None = None
    """The log probabilities of the tokens whose text this chunk carries (``tokens`` of them; None when the request
    did not ask for them)."""


class TextBackend(ABC):
    """Base for backends that generate raw text: subclasses implement :meth:`stream_text`.

    ``tool_format`` names the tool-call format the model writes (see :func:`freetoken_agent.chat.detect_format`).
    """

    tool_format: str = "hermes"

    @abstractmethod
    def stream_text(self, request: GenerateRequest) -> AsyncIterator[TextChunk | GenerationDone]:
        """Raw text chunks for ``request``, then one :class:`GenerationDone`."""

    async def generate(self, request: GenerateRequest) -> AsyncIterator[BackendEvent]:
        # A request that declares no tools gets no tool calls, as from the hosted APIs: what the model writes in its
        # call syntax stays text (harmony is still parsed: its channels carry the reasoning and the final answer).
        parser = make_parser(self.tool_format, request.tools) if request.tools or self.tool_format == "harmony" \
            else None
        done = GenerationDone("stop")
        saw_call = False
        async for item in self.stream_text(request):
            if isinstance(item, GenerationDone):
                done = item
                continue
            if item.logprobs:
                yield LogprobsDelta(item.logprobs)
            if parser is None:
                if item.text:
                    yield TextDelta(item.text)
                continue
            for event in parser.feed(item.text):
                saw_call = saw_call or isinstance(event, ToolCallFinished)
                yield event
        for event in parser.finish() if parser is not None else ():
            saw_call = saw_call or isinstance(event, ToolCallFinished)
            yield event
        if saw_call and done.finish_reason == "stop" and done.stop_sequence is None:
            done = replace(done, finish_reason="tool_calls")
        yield done

    def hint(self, phase: Phase, expected_s: float | None = None, session: str | None = None) -> None:
        """Text backends without an engine ignore hints."""

    def end_session(self, session: str) -> None:
        """Nothing is kept per conversation."""

    def stats(self) -> dict[str, Any] | None:
        return None

    @property
    def context_length(self) -> int | None:
        """Tokens the model's context holds (None: unknown, nothing is checked)."""
        return None

    supports_constraints: bool = False
    """Whether ``GenerateRequest.constraint`` is enforced (a server refuses constrained requests otherwise)."""
    supports_logits: bool = False
    """Whether the logits-level controls are honored: penalties (``repetition_penalty`` too), ``logit_bias``,
    ``min_p``, ``logprobs``."""

    def count_tokens(self, request: GenerateRequest) -> int | None:
        """Prompt tokens ``request`` would take (what its ``GenerationDone.usage.prompt_tokens`` reports); None when
        this backend has no tokenizer to count with."""
        return None
