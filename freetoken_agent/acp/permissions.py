"""Permission before tools that write or execute, and the plan tool: the ACP session's tool registry.

:class:`AcpToolRegistry` is a :class:`~freetoken_agent.tools.ToolRegistry` whose ``call`` first reports the call to
the editor (title, input, locations), asks ``session/request_permission`` when the tool writes or executes, and
streams a process tool's output while it runs. A rejection comes back to the model as the tool's error result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel

from freetoken_agent.acp import presentation as show
from freetoken_agent.tools import Tool, ToolContext, ToolRegistry, ToolResult, tool

if TYPE_CHECKING:
    from freetoken_agent.acp.updates import ToolCallState, TurnReporter

ALLOW_ONCE, ALLOW_ALWAYS, REJECT_ONCE = "allow-once", "allow-always", "reject-once"

# Session modes: how writing/executing tools are gated.
MODES: dict[str, tuple[str, str]] = {
    "ask": ("Ask", "Ask before every tool that writes files or runs commands."),
    "auto": ("Auto", "Run every tool without asking."),
    "read-only": ("Read-only", "Refuse tools that write files or run commands; reading and searching still work."),
}


def needs_permission(item: Tool) -> bool:
    """Tools that change files or run processes (MCP tools without a read-only hint count as writing)."""
    return item.writes or item.kind == "execute"


def permission_options(name: str) -> list[dict[str, str]]:
    """The choices offered in ``session/request_permission``."""
    return [{"optionId": ALLOW_ONCE, "name": "Allow", "kind": "allow_once"},
            {"optionId": ALLOW_ALWAYS, "name": f"Always allow {name} in this session", "kind": "allow_always"},
            {"optionId": REJECT_ONCE, "name": "Reject", "kind": "reject_once"}]


class PermissionAsker(Protocol):
    """What the registry needs from its session."""

    reporter: TurnReporter | None

    async def read_buffer(self, arguments: dict[str, Any], ctx: ToolContext | None) -> ToolResult | None:
        """``read_file`` served from the editor's buffer, or None to read from disk."""
        ...

    async def permit(self, state: ToolCallState) -> str | None:
        """None to run the call, or the refusal message the model reads."""
        ...


class AcpToolRegistry(ToolRegistry):
    """A session's tools: each call is reported to the editor and, if it writes or executes, permitted first."""

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]], session: PermissionAsker) -> None:
        super().__init__(tools)
        self.session = session

    def kind_of(self, name: str) -> str:
        """Our kind of tool ``name`` (``other`` when unknown)."""
        return self.get(name).kind if name in self else "other"

    async def call(self, name: str, arguments: dict[str, Any] | str | None, ctx: ToolContext | None) -> ToolResult:
        reporter = self.session.reporter
        if reporter is None or name not in self:
            return await super().call(name, arguments, ctx)
        args = show.decode_arguments(arguments)
        state = reporter.claim(name, args)
        if name == "read_file":
            from_editor = await self.session.read_buffer(args, ctx)
            if from_editor is not None:
                reporter.running(state)
                return from_editor
        if needs_permission(self.get(name)):
            refusal = await self.session.permit(state)
            if refusal is not None:
                return ToolResult.error(refusal)
        reporter.running(state)
        previous = ctx.on_output if ctx is not None else None
        if ctx is not None:
            ctx.on_output = lambda text: reporter.output(state, text)
        try:
            return await super().call(name, arguments, ctx)
        finally:
            if ctx is not None:
                ctx.on_output = previous


class PlanStep(BaseModel):
    """One step of the plan."""

    content: str
    status: Literal["pending", "in_progress", "completed"] = "pending"
    priority: Literal["high", "medium", "low"] = "medium"


def plan_tool(send: Callable[[dict[str, Any]], None]) -> Tool:
    """``update_plan``: the model records its plan; the editor shows it (an ACP ``plan`` update)."""

    def update_plan(steps: list[PlanStep]) -> str:
        """Record or update your plan for the task: the complete list of steps with their status. Call it when
        you start a multi-step task and whenever a step's status changes.

        Args:
            steps: Every step of the plan, in order (the list replaces the previous plan).
        """
        send({"sessionUpdate": "plan", "entries": [step.model_dump() for step in steps]})
        done = sum(step.status == "completed" for step in steps)
        return f"Plan updated: {len(steps)} steps, {done} completed."

    return tool(update_plan)
