"""Tool-call formats: read the calls a model writes, per model family, while it streams.

    parser = make_parser(detect_format(chat_template, config), tools)
    for delta in stream: events = parser.feed(delta)      # TextDelta / ToolCallStarted / ToolCallFinished / FormatError
    events = parser.finish()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from freetoken_agent.chat.detect import FORMATS, detect_format, make_parser
from freetoken_agent.chat.events import FormatError, ParseEvent, TextDelta, ToolCallFinished, ToolCallStarted
from freetoken_agent.chat.parser import ToolCallParser


@dataclass
class ParsedOutput:
    """A whole output read at once: its text, its well-formed calls, and format errors."""

    text: str = ""
    reasoning: str = ""
    calls: list[ToolCallFinished] = field(default_factory=list)
    errors: list[FormatError] = field(default_factory=list)


def collect(events: Sequence[ParseEvent], into: ParsedOutput | None = None) -> ParsedOutput:
    """Fold parse events into a :class:`ParsedOutput` (merging adjacent text)."""
    out = into if into is not None else ParsedOutput()
    for ev in events:
        if isinstance(ev, TextDelta):
            if ev.reasoning:
                out.reasoning += ev.text
            else:
                out.text += ev.text
        elif isinstance(ev, ToolCallFinished):
            out.calls.append(ev)
        elif isinstance(ev, FormatError):
            out.errors.append(ev)
    return out


def parse_tool_calls(text: str, fmt: str, tools: Sequence[dict[str, Any]] | None = None) -> ParsedOutput:
    """Parse a complete output in format ``fmt``."""
    parser = make_parser(fmt, tools)
    return collect([*parser.feed(text), *parser.finish()])


__all__ = [
    "FORMATS", "FormatError", "ParseEvent", "ParsedOutput", "TextDelta", "ToolCallFinished", "ToolCallParser",
    "ToolCallStarted", "collect", "detect_format", "make_parser", "parse_tool_calls",
]
