"""``ScriptedBackend``: plays back prepared model outputs through the real parser and loop (tests, demos, replays)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Union

import anyio
from anyio.lowlevel import checkpoint

from freetoken_agent.backends.base import GenerateRequest, GenerationDone, TextBackend, TextChunk, check_context, stop_hit
from freetoken_agent.chat import TextDelta, ToolCallFinished, ToolCallStarted
from freetoken_agent.errors import BackendError
from freetoken_agent.events import Usage
from freetoken_agent.phases import Phase

# A scripted turn: raw model text (parsed in ``tool_format``), a structured assistant message
# ({"content": ..., "tool_calls": [{"name"|"function": ..., "arguments": ...}]}), or a function of the request.
Turn = Union[str, dict[str, Any], Callable[[GenerateRequest], Union[str, dict[str, Any]]]]

_TOKEN = re.compile(r"\s*\S+|\s+")


def _count_words(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content") or "").split()) for m in messages)


class ScriptedBackend(TextBackend):
    """Answers each model call with the next scripted turn, streamed word by word (one word = one "token").

    ``requests``, ``hints`` and ``ended`` record what the loop sent, so a test or demo can show exactly what the
    model saw. ``delay_s`` sleeps between tokens (to exercise cancellation and time limits). When the script runs
    out, the call fails with :class:`~freetoken_agent.errors.BackendError`.
    """

    def __init__(self, turns: Iterable[Turn], tool_format: str = "hermes", delay_s: float = 0.0,
                 context_length: int | None = None) -> None:
        self.turns: list[Turn] = list(turns)
        self.tool_format = tool_format
        self.delay_s = delay_s
        self._context_length = context_length
        self.requests: list[GenerateRequest] = []
        self.hints: list[tuple[Phase, float | None]] = []
        self.ended: list[str] = []  # conversations the loop closed
        self._next = 0
        self._pending: str | None = None  # the turn chosen by ``generate`` for ``stream_text``

    @classmethod
    def from_trajectory(cls, path: str) -> ScriptedBackend:
        """A backend that answers with the assistant messages recorded in a trajectory file."""
        from freetoken_agent.trajectory import assistant_turns

        return cls(assistant_turns(path))

    def hint(self, phase: Phase, expected_s: float | None = None, session: str | None = None) -> None:
        self.hints.append((phase, expected_s))

    def end_session(self, session: str) -> None:
        self.ended.append(session)

    @property
    def remaining(self) -> int:
        """Scripted turns not yet played."""
        return len(self.turns) - self._next

    @property
    def context_length(self) -> int | None:
        """The context the script pretends to have (None: unbounded), checked in words like its usage."""
        return self._context_length

    def count_tokens(self, request: GenerateRequest) -> int:
        return self._prompt_tokens(request)

    def _take(self, request: GenerateRequest) -> str | dict[str, Any]:
        check_context(self._prompt_tokens(request), request, self._context_length)
        self.requests.append(request)
        if self._next >= len(self.turns):
            raise BackendError(f"the scripted backend has no output left for call {self._next + 1} "
                               f"(it holds {len(self.turns)})")
        turn = self.turns[self._next]
        self._next += 1
        return turn(request) if callable(turn) else turn

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Any]:
        turn = self._take(request)
        if isinstance(turn, dict):
            async for event in self._structured(request, turn):
                yield event
            return
        self._pending = str(turn)
        async for event in super().generate(request):
            yield event

    async def stream_text(self, request: GenerateRequest) -> AsyncIterator[TextChunk | GenerationDone]:
        text, self._pending = (self._pending, None) if self._pending is not None else (str(self._take(request)), None)
        count = 0
        stop = stop_hit(text, 0, request.stop)  # the script's text ends at its first stop string, like a model's
        if stop is not None:
            text = text[: text.find(stop)]
        for match in _TOKEN.finditer(text):
            if count >= request.max_tokens:
                yield GenerationDone("length", Usage(self._prompt_tokens(request), count))
                return
            if self.delay_s:
                await anyio.sleep(self.delay_s)
            else:
                await checkpoint()
            count += 1
            yield TextChunk(match.group(0))
        yield GenerationDone("stop", Usage(self._prompt_tokens(request), count), stop)

    async def _structured(self, request: GenerateRequest, turn: dict[str, Any]) -> AsyncIterator[Any]:
        content = str(turn.get("content") or "")
        count = 0
        for match in _TOKEN.finditer(content):
            await anyio.sleep(self.delay_s) if self.delay_s else await checkpoint()
            count += 1
            yield TextDelta(match.group(0))
        calls = turn.get("tool_calls") or []
        for index, call in enumerate(calls):
            fn = call.get("function", call)
            args = fn.get("arguments") or {}
            args = json.loads(args) if isinstance(args, str) else args
            yield ToolCallStarted(index, fn["name"])
            yield ToolCallFinished(index, fn["name"], args, json.dumps(args))
            count += 1 + len(json.dumps(args).split())
        yield GenerationDone("tool_calls" if calls else "stop", Usage(self._prompt_tokens(request), count))

    @staticmethod
    def _prompt_tokens(request: GenerateRequest) -> int:
        return len(request.prompt.split()) if request.prompt is not None else _count_words(request.messages)
