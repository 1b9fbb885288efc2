"""What ``Agent.run`` returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from freetoken_agent.events import Usage


@dataclass
class RunResult:
    """The outcome of one run.

    ``stop_reason`` is ``done`` (the model answered without calling a tool), ``max_steps``, ``max_tokens``,
    ``wall_time``, ``cancelled`` or ``backend_error`` (then ``error`` says why).
    """

    final_message: str
    stop_reason: str
    steps: int
    usage: Usage
    duration_s: float
    messages: list[dict[str, Any]] = field(default_factory=list, repr=False)
    trajectory: str | None = None
    error: str | None = None
    engine_stats: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        """True when the model finished on its own."""
        return self.stop_reason == "done"

    def to_record(self) -> dict[str, Any]:
        """A JSON-ready summary (without the message list, which the trajectory already holds)."""
        return {"final_message": self.final_message, "stop_reason": self.stop_reason, "steps": self.steps,
                "usage": asdict(self.usage), "duration_s": round(self.duration_s, 4), "error": self.error,
                "engine_stats": self.engine_stats}
