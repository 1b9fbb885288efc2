"""What a tool receives (``ToolContext``) and what a call returns (``ToolResult``)."""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from freetoken_agent.tools.definition import Tool
    from freetoken_agent.tools.sandbox.policy import SandboxPolicy
    from freetoken_agent.tools.workspace import Workspace


class ToolError(Exception):
    """An expected tool failure; its message is shown to the model as is (no traceback, no exception type)."""


@dataclass
class ToolResult:
    """The outcome of one tool call.

    ``content`` is the text the model reads; ``is_error`` marks failures (bad arguments, unknown tool, the tool
    refused or raised); ``data`` carries structured extras for clients (``diff``, ``exit_code``, ``paths``, ...).
    """

    content: str
    is_error: bool = False
    data: dict[str, Any] | None = None

    @classmethod
    def error(cls, message: str, data: dict[str, Any] | None = None) -> ToolResult:
        """A failed call whose ``message`` the model will read."""
        return cls(content=message, is_error=True, data=data)


@dataclass
class ToolContext:
    """Per-run state handed to every tool that declares a parameter annotated ``ToolContext``.

    The parameter is recognized by its type annotation and never appears in the JSON schema the model sees.
    """

    workspace: Workspace
    """Root that file and process tools are confined to."""
    timeout_s: float = 120.0
    """Default wall-clock limit for process tools (``run_shell``, ``run_tests``) when the call gives none."""
    max_timeout_s: float = 1800.0
    """Upper bound on any timeout a model may ask for."""
    max_output_chars: int = 20_000
    """Cap on the text a tool returns to the model (longer output keeps its head and tail)."""
    python: str | None = None
    """Interpreter that ``run_tests`` runs pytest with (default: the one running the agent)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for processes started by tools."""
    approve: Callable[[Tool, dict[str, Any]], Awaitable[bool] | bool] | None = None
    """Asked before every call of a tool with ``writes=True`` (validated arguments given); False refuses the call
    and the model is told the user declined. None: no permission step."""
    on_output: Callable[[str], None] | None = None
    """Called with output chunks as a process tool produces them (for live views); must not block."""
    cancel_event: threading.Event = field(default_factory=threading.Event)
    """Set by :meth:`cancel`; long-running tools check it (process tools kill their process group)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form values for user tools (API clients, settings)."""
    sandbox: SandboxPolicy | None = None
    """The agent's sandbox policy for tools that run code or write files; None: the default ``SandboxPolicy()``
    (``workspace-write``, network off, ``.git`` read-only)."""
    tool_sandbox: dict[str, SandboxPolicy] = field(default_factory=dict)
    """Per-tool overrides of :attr:`sandbox`, by tool name (e.g. ``{"run_tests": SandboxPolicy(network=True)}``)."""

    def sandbox_for(self, tool_name: str) -> SandboxPolicy:
        """The sandbox policy that applies to the tool called ``tool_name``."""
        from freetoken_agent.tools.sandbox.policy import SandboxPolicy

        return self.tool_sandbox.get(tool_name) or self.sandbox or SandboxPolicy()

    def cancel(self) -> None:
        """Ask running tools to stop as soon as they can. Thread-safe."""
        self.cancel_event.set()

    @property
    def cancelled(self) -> bool:
        """True once :meth:`cancel` was called."""
        return self.cancel_event.is_set()

    async def allowed(self, tool: Tool, arguments: dict[str, Any]) -> bool:
        """Run the ``approve`` hook for a writing tool; True when no hook is set or the tool does not write."""
        if self.approve is None or not tool.writes:
            return True
        answer = self.approve(tool, arguments)
        if inspect.isawaitable(answer):
            answer = await answer
        return bool(answer)

    def clamp_timeout(self, timeout_s: float | None) -> float:
        """The timeout to use for a call: the call's own value (bounded) or the context default."""
        if timeout_s is None or not math.isfinite(timeout_s) or timeout_s <= 0:  # NaN would disable the timeout
            return self.timeout_s
        return min(float(timeout_s), self.max_timeout_s)
