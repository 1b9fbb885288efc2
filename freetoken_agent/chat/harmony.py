"""GPT-OSS *harmony* output: a sequence of messages, each a header and a body.

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{json}<|call|>
    <|start|>assistant<|channel|>final<|message|>answer<|return|>

Generation starts inside the first header (the prompt ends with ``<|start|>assistant``). A header naming a
recipient ``to=functions.NAME`` (in the channel or the role part) makes its body a tool call; other bodies are
text (``analysis`` marked as reasoning).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from freetoken_agent.chat.events import FormatError, ParseEvent, TextDelta, ToolCallFinished, ToolCallStarted
from freetoken_agent.chat.parser import ToolCallParser, held_back

START, MESSAGE, END, CALL, RETURN = "<|start|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"
_TERMINATORS = (END, CALL, RETURN, START)
_RECIPIENT = re.compile(r"to=(?:functions\.)?([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyParser(ToolCallParser):
    """Streaming parser for GPT-OSS harmony output (same event interface as the block parsers)."""

    format_name = "harmony"

    def __init__(self, tools: Sequence[dict[str, Any]] | None = None) -> None:
        self.tools = list(tools or ())
        self._buf = ""
        self._in_header = True
        self._call: tuple[int, str] | None = None  # (index, name) while a tool-call body streams
        self._reasoning = False
        self._index = 0
        self._saw_message = False
        self._seen = 0  # length of the current body already searched for a terminator

    def feed(self, delta: str) -> list[ParseEvent]:
        self._buf += delta
        events: list[ParseEvent] = []
        while True:
            if self._in_header:
                at = self._buf.find(MESSAGE)
                if at < 0:
                    return events
                header, self._buf = self._buf[:at], self._buf[at + len(MESSAGE):]
                events += self._open(header)
                self._in_header, self._seen = False, 0
                continue
            since = max(0, self._seen - 9)  # a terminator is at most 10 characters long
            ends = [(at, t) for t in _TERMINATORS if (at := self._buf.find(t, since)) >= 0]
            self._seen = len(self._buf)
            if ends:
                at, marker = min(ends)
                body, self._buf = self._buf[:at], self._buf[at + len(marker):]
                events += self._close(body, emit_text=True)
                if marker == START:
                    self._buf = START + self._buf  # the header parser reads the role part after it
                self._in_header = True
                continue
            if self._call is None:
                keep = held_back(self._buf, _TERMINATORS)
                if len(self._buf) > keep:
                    events.append(TextDelta(self._buf[: len(self._buf) - keep], self._reasoning))
                    self._buf = self._buf[len(self._buf) - keep:]
                    self._seen = len(self._buf)
            return events

    def finish(self) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        if self._in_header:
            leftover = re.sub(r"<\|[a-z]+\|>", "", self._buf).strip()
            if leftover and not self._saw_message:  # not harmony at all: surface the text as is
                events.append(TextDelta(self._buf))
        else:
            events += self._close(self._buf, emit_text=True)
        self._buf = ""
        return events

    def _open(self, header: str) -> list[ParseEvent]:
        self._saw_message = True
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        self._reasoning = bool(channel and channel.group(1) == "analysis")
        if recipient:
            self._call = (self._index, recipient.group(1))
            self._index += 1
            return [ToolCallStarted(*self._call)]
        self._call = None
        return []

    def _close(self, body: str, emit_text: bool) -> list[ParseEvent]:
        if self._call is None:
            return [TextDelta(body, self._reasoning)] if body and emit_text else []
        index, name = self._call
        self._call = None
        text = body.strip()
        try:
            value = json.loads(text) if text else {}
        except json.JSONDecodeError as exc:
            return [FormatError(f"the tool call arguments are not valid JSON ({exc.msg} at char {exc.pos}): "
                                f"{text[:200]!r}", body, index, name)]
        if not isinstance(value, dict):
            return [FormatError(f"the tool call arguments must be a JSON object, got: {text[:200]!r}", body, index,
                                name)]
        return [ToolCallFinished(index, name, value, body)]
