"""``Agent``: a typed configuration plus the loop that runs it.

    agent = Agent.coding(ScriptedBackend([...]), workspace="repo")
    async for event in agent.stream("make the failing test pass"): ...
    result = await agent.run("make the failing test pass")      # consumes the same stream
"""

from __future__ import annotations

import os
from contextlib import aclosing
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from freetoken_agent.backends.base import Backend
from freetoken_agent.events import AgentEvent, RunFinished
from freetoken_agent.result import RunResult

if TYPE_CHECKING:
    from freetoken_agent.tools.sandbox import SandboxPolicy

CODING_INSTRUCTIONS = (
    "You are a careful coding agent working inside a repository. Use the tools to read files, make small exact "
    "edits and run the tests. Call one tool at a time when a result decides the next step. When the task is done, "
    "reply with a short summary of what you changed and do not call a tool."
)


@dataclass
class Limits:
    """When a run must stop even if the model has not finished."""

    max_steps: int = 30
    """Model calls per run."""
    max_tokens: int = 200_000
    """Tokens generated over the whole run."""
    max_tokens_per_step: int = 4096
    """Tokens one model call may generate (a call is also capped by what is left of ``max_tokens``)."""
    max_wall_s: float | None = None
    """Seconds from start to finish, enforced while generating and while tools run (None: no limit)."""


@dataclass
class Sampling:
    """How tokens are chosen."""

    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    seed: int | None = None
    """Seed for reproducible sampling."""


@dataclass
class Agent:
    """A model, tools, instructions and limits. ``stream`` runs it and yields typed events; ``run`` returns a result.

    One ``Agent`` may run several tasks, one after another or concurrently; each run has its own conversation,
    tool context and trajectory file.
    """

    backend: Backend
    """Where tokens come from: ``LocalEngine``, ``OpenAICompatible`` or ``ScriptedBackend``."""
    tools: Sequence[Any] = field(default_factory=list)
    """``Tool`` objects, typed functions, or a ``ToolRegistry``."""
    instructions: str = CODING_INSTRUCTIONS
    """The system prompt."""
    workspace: str | os.PathLike[str] | None = None
    """Root the tools are confined to (default: the current directory)."""
    limits: Limits = field(default_factory=Limits)
    """Step, token and wall-time limits."""
    sampling: Sampling = field(default_factory=Sampling)
    """Sampling settings passed to the backend."""
    trajectory: str | os.PathLike[str] | None = None
    """JSONL file each run appends to (a directory: one ``run-<time>.jsonl`` per run); None writes nothing."""
    tool_timeout_s: float = 120.0
    """Default timeout for process tools (``run_shell``, ``run_tests``)."""
    on_tool_output: Callable[[str, str], None] | None = None
    """Called with ``(call_id, text)`` as a process tool's output streams in (live views); must not block."""
    sandbox: SandboxPolicy | None = None
    """The tools' ``SandboxPolicy`` (``freetoken_agent.tools.sandbox``); None: ``workspace-write``, network off,
    ``.git`` read-only. ``full-access`` must be chosen explicitly to run commands where no sandbox exists."""
    tool_sandbox: dict[str, SandboxPolicy] = field(default_factory=dict)
    """Per-tool ``SandboxPolicy`` overrides by tool name, e.g. ``{"run_tests": SandboxPolicy(network=True)}``."""
    _runs: set[Any] = field(default_factory=set, init=False, repr=False, compare=False)

    @classmethod
    def coding(cls, backend: Backend, workspace: str | os.PathLike[str] = ".", **options: Any) -> Agent:
        """An agent with the standard coding tools (read, write, edit, list, glob, search, shell, tests)."""
        from freetoken_agent.tools import coding_tools

        extra = list(options.pop("tools", []))
        return cls(backend=backend, tools=[*coding_tools(), *extra], workspace=workspace, **options)

    async def stream(self, task: str) -> AsyncIterator[AgentEvent]:
        """Run ``task``, yielding events as they happen; the last one is :class:`RunFinished`."""
        from freetoken_agent.loop import AgentRun

        run = AgentRun(self, task)
        self._runs.add(run)
        try:
            async with aclosing(run.events()) as events:
                async for event in events:
                    yield event
        finally:
            self._runs.discard(run)

    async def run(self, task: str, on_event: Callable[[AgentEvent], Any] | None = None) -> RunResult:
        """Run ``task`` to the end and return its :class:`RunResult` (``on_event`` sees every event)."""
        result: RunResult | None = None
        async for event in self.stream(task):
            if on_event is not None:
                on_event(event)
            if isinstance(event, RunFinished):
                result = event.result
        assert result is not None  # stream always ends with RunFinished unless it raised
        return result

    def run_sync(self, task: str) -> RunResult:
        """``run`` for code that is not async (starts an event loop)."""
        return anyio.run(self.run, task)

    def cancel(self) -> None:
        """Stop every run of this agent promptly (generation and running tools). Safe from any thread.

        Each cancelled run ends with ``stop_reason == "cancelled"`` and a consistent trajectory.
        """
        for run in list(self._runs):
            run.cancel()
