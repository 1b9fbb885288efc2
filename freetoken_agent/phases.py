"""Agent phases: ``plan`` (short reasoning), ``code`` (writing code or edits), ``tool`` (a tool runs, the model idles).

The runtime owns the enum (it never imports the SDK); the SDK re-exports it here. The agent loop switches phase
explicitly and tells the backend before each switch, so a local engine can stage the experts and KV a phase needs.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from freetoken_agent.runtime.phase import Phase

__all__ = ["Phase", "PromptStaging", "ToolOutputStaging"]


@runtime_checkable
class PromptStaging(Protocol):
    """A backend that can warm the known start of a conversation's next prompt while a tool runs (KV pre-staging).

    Before each tool call the agent loop passes the conversation as the next prompt will render it, the running
    tool's message last (its content not known yet); ``LocalEngine`` warms the tokens before that content during
    the tool pause.
    """

    def expect_prompt(self, session: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
        """Conversation ``session``'s next prompt renders ``messages``; the last one's content is still unknown."""
        ...


@runtime_checkable
class ToolOutputStaging(Protocol):
    """A backend that can prefill a running tool's output as it streams (``LocalEngine``): when the tool ends only
    the tail of its result (e.g. the exit-status line) is left to prefill."""

    def stream_tool_output(
        self, session: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> None:
        """Conversation ``session``'s next prompt renders ``messages``; the last one's content *starts with* the
        text given (the tool's result so far)."""
        ...
