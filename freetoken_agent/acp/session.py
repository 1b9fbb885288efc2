"""An ACP session: a workspace, its conversation across prompts, its permission memory and its running turn."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from freetoken_agent.acp.buffers import read_via_client
from freetoken_agent.acp.jsonrpc import INTERNAL_ERROR, INVALID_REQUEST, RpcError
from freetoken_agent.acp.permissions import ALLOW_ALWAYS, ALLOW_ONCE, AcpToolRegistry, permission_options
from freetoken_agent.acp.schema import ContentBlock, MediaBlock, ResourceBlock, ResourceLinkBlock, TextResource
from freetoken_agent.acp.store import SessionStore
from freetoken_agent.acp.updates import ToolCallState, TurnReporter, prefix_hit_tokens
from freetoken_agent.events import RunFinished
from freetoken_agent.loop import AgentRun
from freetoken_agent.result import RunResult
from freetoken_agent.tools import ToolContext, ToolResult, Workspace

if TYPE_CHECKING:
    from freetoken_agent.acp.jsonrpc import Connection
    from freetoken_agent.agent import Agent

STOP_REASONS = {"done": "end_turn", "max_steps": "max_turn_requests", "max_tokens": "max_tokens",
                "wall_time": "max_turn_requests", "cancelled": "cancelled"}


class _ContinuedRun(AgentRun):
    """A run whose conversation starts with an earlier turn's messages (between the system prompt and the task).

    The SDK's ``Agent.stream`` starts every run from scratch; an ACP session is one conversation over many
    prompts, so the earlier messages are replayed into the new run right after its system message. The prefix
    stays identical from turn to turn, which is what lets an engine's prefix cache reuse it.
    """

    def __init__(self, agent: Agent, task: str, history: Sequence[dict[str, Any]]) -> None:
        super().__init__(agent, task)
        self._history = [dict(m) for m in history]

    def _add(self, message: dict[str, Any]) -> None:
        super()._add(message)
        if self._history and message.get("role") == "system" and len(self.messages) == 1:
            history, self._history = self._history, []
            for earlier in history:
                super()._add(earlier)


def repaired_history(messages: list[dict[str, Any]], partial: str = "") -> list[dict[str, Any]]:
    """A run's messages without the system prompt, with a result for every tool call a cancel left unanswered,
    and the ``partial`` answer the user saw before cancelling generation (so turns keep alternating)."""
    out: list[dict[str, Any]] = []
    answered = {m.get("tool_call_id") for m in messages if m.get("role") == "tool"}
    for message in messages:
        if message.get("role") == "system":
            continue
        out.append(message)
        for call in message.get("tool_calls") or []:
            if call.get("id") not in answered:
                out.append({"role": "tool", "tool_call_id": call.get("id"),
                            "name": (call.get("function") or {}).get("name", ""),
                            "content": "The user cancelled this call before it finished."})
    if partial and out and out[-1].get("role") != "assistant":
        out.append({"role": "assistant", "content": partial + " [cancelled by the user]"})
    return out


def prompt_text(blocks: Sequence[ContentBlock], workspace: Workspace) -> str:
    """The task the model reads: text as is, embedded resources as tagged context, links as references."""
    parts: list[str] = []
    for block in blocks:
        if isinstance(block, MediaBlock):
            raise RpcError.invalid_params(f"{block.type} content is not supported by this agent "
                                          f"(promptCapabilities.{block.type} is false)")
        if isinstance(block, ResourceLinkBlock):
            parts.append(f"[{block.title or block.name}]({block.uri}){_local_hint(block.uri, workspace)}")
        elif isinstance(block, ResourceBlock):
            resource = block.resource
            if isinstance(resource, TextResource):
                parts.append(f'<context uri="{resource.uri}">\n{resource.text}\n</context>')
            else:
                parts.append(f"[binary resource {resource.uri} ({resource.mime_type or 'unknown type'}) omitted]")
        else:
            parts.append(block.text)
    return "\n\n".join(part for part in parts if part)


def _local_hint(uri: str, workspace: Workspace) -> str:
    parsed = urlparse(uri)
    if parsed.scheme != "file":
        return ""
    path = Path(unquote(parsed.path))
    try:
        return f" (workspace file: {path.resolve().relative_to(workspace.root).as_posix()})"
    except (ValueError, OSError):
        return ""


@dataclass
class _Turn:
    number: int
    cancelled: bool = False
    run: AgentRun | None = None


class AcpSession:
    """One editor session: ``cwd`` is the workspace root; prompts continue one conversation."""

    def __init__(self, conn: Connection, cwd: Path, session_id: str | None = None, mode: str = "ask",
                 store: SessionStore | None = None) -> None:
        self.conn = conn
        self.id = session_id or f"sess_{uuid.uuid4().hex[:16]}"
        self.workspace = Workspace(cwd)
        self.mode = mode
        self.store = store
        self.history: list[dict[str, Any]] = []
        self.always_allowed: set[str] = set()
        self.turns = 0
        self.reporter: TurnReporter | None = None
        self.registry: AcpToolRegistry | None = None
        self.client_reads_buffers = False  # the client offered fs/read_text_file
        self._turn: _Turn | None = None

    # ------------------------------------------------------------------------------------------ notifications
    def send(self, update: dict[str, Any]) -> None:
        """One ``session/update`` notification for this session."""
        self.conn.notify("session/update", {"sessionId": self.id, "update": update})

    # ------------------------------------------------------------------------------------------------ prompts
    async def prompt(self, task: str, make_agent: Callable[[AcpSession], Awaitable[Agent]],
                     context_size: Callable[[], int]) -> dict[str, Any]:
        """Run one turn; returns the ``session/prompt`` result (``stopReason`` and this turn's ``usage``)."""
        if self._turn is not None:
            raise RpcError(INVALID_REQUEST, f"session {self.id} is already running a prompt; cancel it or wait")
        self.turns += 1
        turn = self._turn = _Turn(self.turns)  # registered before any await, so a cancel that follows finds it
        try:
            agent: Agent = await make_agent(self)
            if turn.cancelled:
                return {"stopReason": "cancelled"}
            assert self.registry is not None
            reporter = self.reporter = TurnReporter(self.send, self.workspace, turn.number, context_size(),
                                                    self.registry.kind_of, agent.backend.stats)
            before = prefix_hit_tokens(agent.backend.stats())
            result = await self._consume(turn, agent, task, reporter)
            partial = "".join(reporter.partial) if result.stop_reason == "cancelled" else ""
        finally:
            if self.reporter is not None:
                self.reporter.close()
            self.reporter = None
            self._turn = None
        self.history = repaired_history(result.messages, partial)
        self.save()
        if result.stop_reason == "backend_error":
            raise RpcError(INTERNAL_ERROR, f"the model failed: {result.error}")
        usage: dict[str, Any] = {"inputTokens": result.usage.prompt_tokens,
                                 "outputTokens": result.usage.completion_tokens,
                                 "totalTokens": result.usage.total_tokens}
        after = prefix_hit_tokens(result.engine_stats)
        if after is not None:  # prompt tokens this turn took from the engine's prefix cache
            usage["cachedReadTokens"] = max(0, after - (before or 0))
        return {"stopReason": STOP_REASONS.get(result.stop_reason, "end_turn"), "usage": usage,
                "_meta": {"freetoken": {"stopReason": result.stop_reason, "steps": result.steps,
                                        "error": result.error}}}

    async def _consume(self, turn: _Turn, agent: Agent, task: str, reporter: TurnReporter) -> RunResult:
        run = turn.run = _ContinuedRun(agent, task, self.history)
        if turn.cancelled:
            run.cancel()
        result: RunResult | None = None
        async with aclosing(run.events()) as events:
            async for event in events:
                reporter.event(event)
                if isinstance(event, RunFinished):
                    result = event.result
        assert result is not None
        return result

    def cancel(self) -> None:
        """``session/cancel``: stop the running turn promptly (it ends with stopReason ``cancelled``)."""
        turn = self._turn
        if turn is None:
            return
        turn.cancelled = True
        if turn.run is not None:
            turn.run.cancel()

    async def permit(self, state: ToolCallState) -> str | None:
        """Ask the editor before a writing/executing call; None to run it, else the message the model reads."""
        if self.mode == "auto" or state.name in self.always_allowed:
            return None
        if self.mode == "read-only":
            return (f"The session is in read-only mode, so '{state.name}' was not run. Tell the user what you "
                    "would change instead.")
        assert self.reporter is not None
        try:
            answer = await self.conn.request("session/request_permission", {
                "sessionId": self.id, "toolCall": self.reporter.permission_view(state),
                "options": permission_options(state.name)})
        except RpcError as exc:
            return f"Permission to run '{state.name}' could not be asked ({exc.message}); the call was not run."
        outcome = answer.get("outcome") if isinstance(answer, dict) else None
        choice = outcome.get("optionId") if isinstance(outcome, dict) and outcome.get("outcome") == "selected" \
            else None
        if choice == ALLOW_ALWAYS:
            self.always_allowed.add(state.name)
        if choice in (ALLOW_ONCE, ALLOW_ALWAYS):
            return None
        if isinstance(outcome, dict) and outcome.get("outcome") == "cancelled":
            return f"The user cancelled the turn before '{state.name}' ran; the call was not run."
        return (f"The user rejected this call to '{state.name}'; it was not run. Do not repeat it; ask the user "
                "or take a different approach.")

    async def read_buffer(self, arguments: dict[str, Any], ctx: ToolContext | None) -> ToolResult | None:
        """``read_file`` from the editor's buffer (unsaved edits included) when the client offers it."""
        if not self.client_reads_buffers:
            return None
        limit = ctx.max_output_chars if ctx is not None else ToolContext.max_output_chars
        return await read_via_client(self.conn, self.id, self.workspace, arguments, limit)

    # ---------------------------------------------------------------------------------------------- storage
    def record(self) -> dict[str, Any]:
        """What is saved: the conversation and the session's settings."""
        first = next((str(m.get("content") or "") for m in self.history if m.get("role") == "user"), "")
        title = " ".join(first.split())[:80]
        return {"id": self.id, "cwd": str(self.workspace.root), "title": title, "mode": self.mode, "turns": self.turns,
                "always_allowed": sorted(self.always_allowed), "history": self.history, "saved": time.time()}

    def save(self) -> None:
        """Save the session (after every turn) so ``session/load`` can resume it later."""
        if self.store is not None:
            self.store.save(self.record())

    def restore(self, record: dict[str, Any]) -> None:
        self.history = list(record.get("history") or [])
        self.always_allowed = set(record.get("always_allowed") or [])
        self.turns = int(record.get("turns") or 0)
        mode = record.get("mode")
        self.mode = mode if isinstance(mode, str) else self.mode

    async def replay(self) -> None:
        """Send the stored conversation as updates (``session/load`` must replay it before answering)."""
        for message in self.history:
            role, content = message.get("role"), str(message.get("content") or "")
            if role == "user" and content:
                self.send({"sessionUpdate": "user_message_chunk", "content": {"type": "text", "text": content}})
            elif role == "assistant":
                if message.get("reasoning_content"):
                    self.send({"sessionUpdate": "agent_thought_chunk",
                               "content": {"type": "text", "text": str(message["reasoning_content"])}})
                if content:
                    self.send({"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": content}})
                for call in message.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    self.send({"sessionUpdate": "tool_call", "toolCallId": f"replay-{call.get('id')}",
                               "title": str(fn.get("name", "tool")), "status": "completed",
                               "rawInput": _loads(fn.get("arguments"))})
            elif role == "tool":
                self.send({"sessionUpdate": "tool_call_update", "toolCallId": f"replay-{message.get('tool_call_id')}",
                           "content": [{"type": "content", "content": {"type": "text", "text": content}}]})


def _loads(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
