"""What a streaming tool-call parser emits: text, call started, call finished, format error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union


@dataclass(frozen=True)
class TextDelta:
    """Plain model text (not part of a tool call). ``reasoning`` marks thinking channels (harmony ``analysis``)."""

    text: str
    reasoning: bool = False


@dataclass(frozen=True)
class ToolCallStarted:
    """The model has opened a call and its tool name is known; arguments are still streaming."""

    index: int
    name: str


@dataclass(frozen=True)
class ToolCallFinished:
    """A complete, well-formed call. ``arguments`` is the decoded JSON object; ``raw`` the text it came from."""

    index: int
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""


@dataclass(frozen=True)
class FormatError:
    """A call the parser could not read. The agent turns ``message`` into a message the model sees.

    ``index``/``name`` are set when a :class:`ToolCallStarted` for this call was already emitted.
    """

    message: str
    raw: str = ""
    index: int | None = None
    name: str | None = None


ParseEvent = Union[TextDelta, ToolCallStarted, ToolCallFinished, FormatError]
