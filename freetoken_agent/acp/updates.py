"""One prompt turn's agent events as ACP ``session/update`` notifications, in the order they happen.

``TextDelta`` → ``agent_message_chunk`` (``agent_thought_chunk`` for reasoning), ``ToolCallStarted`` →
``tool_call`` (pending), the permission/run stages → ``tool_call_update`` (title, kind, locations, raw input,
proposed diff, live output), ``ToolCallFinished`` → ``tool_call_update`` (completed/failed, output, diff),
``StepFinished`` → ``usage_update`` (context tokens; engine stats such as the prefix hit rate in ``_meta``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freetoken_agent.acp import presentation as show
from freetoken_agent.events import AgentEvent, StepFinished, TextDelta, ToolCallFinished, ToolCallStarted, Usage
from freetoken_agent.tools import Workspace

OUTPUT_TAIL_CHARS = 8000  # live output shown while a process tool runs
OUTPUT_INTERVAL_S = 0.1  # at most one live-output update per interval


@dataclass
class ToolCallState:
    """What we told the client about one tool call."""

    acp_id: str
    name: str
    kind: str = "other"
    arguments: dict[str, Any] = field(default_factory=dict)
    claimed: bool = False
    path: Path | None = None
    before: str | None = None
    output: list[str] = field(default_factory=list)
    last_output_s: float = 0.0
    done: bool = False


def prefix_hit_tokens(stats: dict[str, Any] | None) -> int | None:
    """Prompt tokens served from the engine's prefix cache so far (None when the backend has no engine)."""
    if not stats:
        return None
    kv = stats.get("kv")
    if isinstance(kv, dict) and "prefix_hit_tokens" in kv:
        return int(kv["prefix_hit_tokens"] or 0)
    return int(stats["reused_tokens"]) if "reused_tokens" in stats else None


def engine_summary(stats: dict[str, Any] | None) -> dict[str, Any] | None:
    """Engine stats for ``_meta``, with the prefix hit rate (cached / all prompt tokens) at the top level."""
    if not stats:
        return None
    summary = dict(stats)
    kv = stats.get("kv")
    if isinstance(kv, dict) and kv.get("prefix_hit_rate") is not None:
        summary["prefix_hit_rate"] = kv["prefix_hit_rate"]
    else:
        reused, prefilled = int(stats.get("reused_tokens") or 0), int(stats.get("prompt_tokens") or 0)
        summary["prefix_hit_rate"] = round(reused / (reused + prefilled), 4) if reused + prefilled else 0.0
    return summary


class TurnReporter:
    """Sends the updates of one ``session/prompt`` turn through ``send(update)`` (the ``update`` object)."""

    def __init__(self, send: Callable[[dict[str, Any]], None], workspace: Workspace, turn: int,
                 context_size: int, kind_of: Callable[[str], str], stats: Callable[[], dict[str, Any] | None]) -> None:
        self.send = send
        self.workspace = workspace
        self.turn = turn
        self.context_size = context_size
        self.kind_of = kind_of
        self.stats = stats
        self.calls: dict[str, ToolCallState] = {}  # by the loop's call id
        self.usage = Usage()
        self.partial: list[str] = []  # answer text of the step in progress (kept if the turn is cancelled)

    # ------------------------------------------------------------------------------------------- agent events
    def event(self, event: AgentEvent) -> None:
        if isinstance(event, TextDelta):
            kind = "agent_thought_chunk" if event.reasoning else "agent_message_chunk"
            if not event.reasoning:
                self.partial.append(event.text)
            self.send({"sessionUpdate": kind, "content": {"type": "text", "text": event.text}})
        elif isinstance(event, ToolCallStarted):
            state = self.calls[event.call_id] = ToolCallState(f"t{self.turn}-{event.call_id}", event.name,
                                                              show.acp_kind(event.name, self.kind_of(event.name)))
            self.send({"sessionUpdate": "tool_call", "toolCallId": state.acp_id, "title": event.name,
                       "kind": state.kind, "status": "pending"})
        elif isinstance(event, ToolCallFinished):
            self._finished(event)
        elif isinstance(event, StepFinished):
            self.partial.clear()
            self.usage = self.usage + event.usage
            update: dict[str, Any] = {"sessionUpdate": "usage_update", "used": event.usage.total_tokens,
                                      "size": self.context_size}
            meta: dict[str, Any] = {"step": event.step, "turnUsage": _usage(self.usage),
                                    "finishReason": event.finish_reason}
            engine = engine_summary(self.stats())
            if engine is not None:
                meta["engine"] = engine
            update["_meta"] = {"freetoken": meta}
            self.send(update)

    def close(self) -> None:
        """The turn ended: calls still open (cancelled mid-run) are reported as failed."""
        for state in self.calls.values():
            if not state.done:
                state.done = True
                self._update(state, status="failed", content=[show.text_content("Cancelled.")])

    # --------------------------------------------------------------------------- stages the registry reports
    def claim(self, name: str, arguments: dict[str, Any]) -> ToolCallState:
        """The call the loop is about to run (the oldest started, unclaimed call named ``name``)."""
        for state in self.calls.values():
            if not state.claimed and not state.done and state.name == name:
                break
        else:  # a call run without a start event (a loop that sends calls whole): introduce it now
            kind = show.acp_kind(name, self.kind_of(name))
            state = ToolCallState(f"t{self.turn}-extra-{len(self.calls)}", name, kind)
            self.calls[state.acp_id] = state
            self.send({"sessionUpdate": "tool_call", "toolCallId": state.acp_id, "title": name, "kind": state.kind,
                       "status": "pending"})
        state.claimed = True
        state.arguments = arguments
        if name in ("write_file", "edit_file"):
            state.path = show.absolute_path(self.workspace, arguments.get("path"))
            state.before = show.read_text(state.path)
        self._update(state, title=show.tool_title(name, arguments), rawInput=arguments,
                     locations=show.locations(self.workspace, arguments))
        return state

    def permission_view(self, state: ToolCallState) -> dict[str, Any]:
        """The ``toolCall`` shown in a permission request: title, kind, input and the proposed diff."""
        view: dict[str, Any] = {"toolCallId": state.acp_id, "title": show.tool_title(state.name, state.arguments),
                                "kind": state.kind, "status": "pending", "rawInput": state.arguments,
                                "locations": show.locations(self.workspace, state.arguments)}
        diff = show.proposed_diff(self.workspace, state.name, state.arguments)
        if diff is not None:
            view["content"] = [diff]
        return view

    def running(self, state: ToolCallState) -> None:
        self._update(state, status="in_progress")

    def output(self, state: ToolCallState, text: str) -> None:
        """Live output of a process tool (throttled; the full result comes when the call finishes)."""
        state.output.append(text)
        now = time.monotonic()
        if now - state.last_output_s >= OUTPUT_INTERVAL_S:
            state.last_output_s = now
            tail = "".join(state.output)[-OUTPUT_TAIL_CHARS:]
            self._update(state, content=[show.text_content(tail)])

    # ------------------------------------------------------------------------------------------------ helpers
    def _finished(self, event: ToolCallFinished) -> None:
        state = self.calls.get(event.call_id)
        if state is None or state.done:
            return
        state.done = True
        content: list[dict[str, Any]] = []
        if not event.is_error and state.name in ("write_file", "edit_file") and state.path is not None:
            after = show.read_text(state.path)
            if after is not None:
                content.append(show.diff_content(state.path, state.before, after))
        content.append(show.text_content(event.content))
        fields: dict[str, Any] = {"status": "failed" if event.is_error else "completed", "content": content,
                                  "rawOutput": {"content": event.content, "isError": event.is_error,
                                                "data": event.data, "durationS": event.duration_s}}
        if event.arguments is not None:
            fields["locations"] = show.locations(self.workspace, event.arguments, event.data)
        if event.arguments is None:
            fields["title"] = f"{state.name} (unreadable call)"
        self._update(state, **fields)

    def _update(self, state: ToolCallState, **fields: Any) -> None:
        self.send({"sessionUpdate": "tool_call_update", "toolCallId": state.acp_id, **fields})


def _usage(usage: Usage) -> dict[str, int]:
    return {"inputTokens": usage.prompt_tokens, "outputTokens": usage.completion_tokens,
            "totalTokens": usage.total_tokens}
