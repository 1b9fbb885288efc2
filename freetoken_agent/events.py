"""Typed events of an agent run, in the order ``Agent.stream`` yields them.

    RunStarted → (PhaseChanged(plan) → TextDelta* / ToolCallStarted* [PhaseChanged(code)] → StepFinished
                  → [PhaseChanged(tool) → ToolCallFinished]*)* → RunFinished
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Union

from freetoken_agent.phases import Phase

if TYPE_CHECKING:
    from freetoken_agent.result import RunResult


@dataclass(frozen=True)
class Usage:
    """Token counts. Remote backends report the server's numbers; the scripted backend counts words."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.prompt_tokens + other.prompt_tokens, self.completion_tokens + other.completion_tokens)

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class RunStarted:
    """The run began; ``trajectory`` is the JSONL path being written (if any)."""

    task: str
    trajectory: str | None = None


@dataclass(frozen=True)
class PhaseChanged:
    """The loop switched phase (and told the backend). ``expected_s``: how long a tool is expected to run."""

    phase: Phase
    step: int
    expected_s: float | None = None


@dataclass(frozen=True)
class TextDelta:
    """Model text as it streams (outside tool calls). ``reasoning`` marks thinking channels."""

    text: str
    step: int
    reasoning: bool = False


@dataclass(frozen=True)
class ToolCallStarted:
    """The model opened a call to ``name`` (its arguments are still streaming)."""

    step: int
    call_id: str
    name: str


@dataclass(frozen=True)
class ToolCallFinished:
    """A call ended: it ran (``is_error`` if it failed) or it could not be read (``arguments`` is None then)."""

    step: int
    call_id: str
    name: str
    arguments: dict[str, Any] | None
    content: str
    is_error: bool = False
    data: dict[str, Any] | None = None
    duration_s: float = 0.0


@dataclass(frozen=True)
class InvalidOutput:
    """The model wrote something that looked like a tool call but could not be read; ``message`` went back to it."""

    step: int
    message: str


@dataclass(frozen=True)
class StepFinished:
    """One model call finished; ``tool_calls`` is how many calls it made."""

    step: int
    finish_reason: str
    usage: Usage
    tool_calls: int
    duration_s: float


@dataclass(frozen=True)
class RunFinished:
    """The run ended; ``result`` holds the final message, stop reason, usage and engine stats."""

    result: RunResult = field(repr=False)


AgentEvent = Union[RunStarted, PhaseChanged, TextDelta, ToolCallStarted, ToolCallFinished, InvalidOutput,
                   StepFinished, RunFinished]


def event_record(event: AgentEvent) -> dict[str, Any]:
    """A JSON-ready dict for one event (``type`` is the class name in snake case)."""
    name = "".join(f"_{c.lower()}" if c.isupper() else c for c in type(event).__name__).lstrip("_")
    if isinstance(event, RunFinished):
        return {"type": name, **event.result.to_record()}
    body = asdict(event)
    if isinstance(event, PhaseChanged):
        body["phase"] = event.phase.value
    if isinstance(event, StepFinished):
        body["usage"] = asdict(event.usage)
    return {"type": name, **body}
