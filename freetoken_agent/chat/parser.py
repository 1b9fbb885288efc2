"""The streaming machinery shared by every block-shaped tool-call format.

A *block format* says which marker opens a tool-call block, which marker closes it (or that it runs to the end
of the output), and how to read the calls inside a (possibly still growing) block body. The parser turns text
deltas into :mod:`events <freetoken_agent.chat.events>`, holding back any tail that could be the start of a
marker so that no marker fragment ever leaks out as text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from freetoken_agent.chat.events import FormatError, ParseEvent, TextDelta, ToolCallFinished, ToolCallStarted


@dataclass(frozen=True)
class CallDraft:
    """One call as read so far from a block body.

    ``name`` is set once the whole tool name has been read; ``done`` once the call can no longer change; then
    exactly one of ``arguments`` (success) or ``error`` (a message for the model) is set.
    """

    name: str | None = None
    done: bool = False
    arguments: dict[str, Any] | None = None
    error: str | None = None
    raw: str = ""


class BlockFormat(Protocol):
    """A tool-call syntax where calls live in delimited blocks inside ordinary text."""

    name: str
    start: str
    end: str | None  # None: the block runs to the end of the output
    single_call: bool  # one call per block: once it has started, only the block's end can tell more
    triggers: str  # characters after which a growing body is worth scanning again (they close names and calls)

    def scan(self, body: str, complete: bool, tools: Sequence[dict[str, Any]] | None) -> list[CallDraft]:
        """Read the calls in ``body``; ``complete`` says no more text will come for this block."""
        ...


def held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers``."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class ToolCallParser:
    """Streaming parser: ``feed(delta)`` and finally ``finish()``, each returning the events now known."""

    format_name: str = "?"

    def feed(self, delta: str) -> list[ParseEvent]:
        raise NotImplementedError

    def finish(self) -> list[ParseEvent]:
        raise NotImplementedError


class BlockParser(ToolCallParser):
    """:class:`ToolCallParser` for any :class:`BlockFormat`."""

    def __init__(self, fmt: BlockFormat, tools: Sequence[dict[str, Any]] | None = None) -> None:
        self.fmt = fmt
        self.format_name = fmt.name
        self.tools = list(tools or ())
        self._buf = ""
        self._inside = False
        self._next_index = 0  # index of the first call of the current block
        self._started = 0  # calls of the current block announced with ToolCallStarted
        self._done = 0  # calls of the current block finished (or failed)
        self._seen = 0  # length of the block body already searched and scanned (keeps streaming linear)

    def feed(self, delta: str) -> list[ParseEvent]:
        self._buf += delta
        events: list[ParseEvent] = []
        fmt = self.fmt
        while True:
            if not self._inside:
                at = self._buf.find(fmt.start)
                if at >= 0:
                    if at:
                        events.append(TextDelta(self._buf[:at]))
                    self._buf = self._buf[at + len(fmt.start):]
                    self._inside, self._started, self._done, self._seen = True, 0, 0, 0
                    continue
                keep = held_back(self._buf, [fmt.start])
                if len(self._buf) > keep:
                    events.append(TextDelta(self._buf[: len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                return events
            if fmt.end is not None:
                at = self._buf.find(fmt.end, max(0, self._seen - len(fmt.end) + 1))
                if at >= 0:
                    body, self._buf = self._buf[:at], self._buf[at + len(fmt.end):]
                    events += self._close(body)
                    continue
            new, self._seen = self._buf[self._seen:], len(self._buf)
            if not (fmt.single_call and self._started) and any(c in new for c in fmt.triggers):
                events += self._progress(self._buf, complete=False)
            return events

    def finish(self) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        if self._inside:
            events += self._close(self._buf)
        elif self._buf:
            events.append(TextDelta(self._buf))
        self._buf = ""
        return events

    def _close(self, body: str) -> list[ParseEvent]:
        events = self._progress(body, complete=True)
        if self._started == 0 and self._done == 0:
            snippet = (self.fmt.start + body)[:200]
            events.append(FormatError(f"a {self.fmt.name} tool-call block holds no readable call: {snippet!r}", body))
        self._next_index += self._done
        self._inside = False
        return events

    def _progress(self, body: str, complete: bool) -> list[ParseEvent]:
        drafts = self.fmt.scan(body, complete, self.tools)
        if complete:  # whatever is still open can no longer be finished
            drafts = [d if d.done else CallDraft(d.name, True, None, d.error or "the call is incomplete", d.raw)
                      for d in drafts]
        events: list[ParseEvent] = []
        for k, draft in enumerate(drafts):
            if k < self._done:
                continue
            index = self._next_index + k
            if k == self._started and draft.name:
                events.append(ToolCallStarted(index, draft.name))
                self._started += 1
            if not draft.done or k != self._done:
                break
            announced = k < self._started
            if draft.error is None and draft.name and draft.arguments is not None:
                events.append(ToolCallFinished(index, draft.name, draft.arguments, draft.raw))
            else:
                message = draft.error or "the call has no tool name"
                name = draft.name if announced else None
                events.append(FormatError(message, draft.raw, index if announced else None, name))
                if not announced:
                    self._started += 1  # the slot is used: later calls keep their own index
            self._done += 1
        return events
