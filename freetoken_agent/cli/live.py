"""The live view of ``freetoken run``: phase, step, tokens/s, the streaming text and the tool calls, drawn by rich."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from freetoken_agent.events import (
    InvalidOutput, PhaseChanged, RunFinished, StepFinished, TextDelta, ToolCallFinished, ToolCallStarted,
)

_PHASE_STYLE = {"plan": "cyan", "code": "magenta", "tool": "yellow"}


def _short(value: Any, limit: int = 70) -> str:
    text = str(value).replace("\n", "⏎")
    return text if len(text) <= limit else text[: limit - 1] + "…"


class LiveView:
    """Folds agent events into a screen: a status line, the current step's text (tail) and a tool-call table."""

    def __init__(self, task: str, text_lines: int = 12) -> None:
        self.task = task
        self.text_lines = text_lines
        self.phase = "plan"
        self.step = 0
        self.text = ""
        self.tokens = 0  # completed steps (usage) plus deltas of the current step
        self._step_deltas = 0
        self._gen_s = 0.0
        self._gen_start: float | None = None
        self.calls: dict[str, list[str]] = {}  # call_id -> [name, arguments, status]
        self.started = time.monotonic()
        self.result: Any = None
        self.tool_output = ""  # tail of the running tool's output

    def on_tool_output(self, call_id: str, text: str) -> None:
        """Receive streamed tool output (``Agent.on_tool_output``)."""
        self.tool_output = (self.tool_output + text)[-4000:]

    def update(self, event: Any) -> None:
        """Take one agent event."""
        if isinstance(event, PhaseChanged):
            self.phase, self.step = event.phase.value, event.step
            if event.phase.value == "plan":
                self.text, self._step_deltas, self._gen_start = "", 0, time.monotonic()
        elif isinstance(event, TextDelta):
            self.text += event.text
            self._step_deltas += 1
        elif isinstance(event, ToolCallStarted):
            self._step_deltas += 1
            self.calls[event.call_id] = [event.name, "…", "writing"]
        elif isinstance(event, ToolCallFinished):
            self.tool_output = ""
            args = _short(event.arguments if event.arguments is not None else "(unreadable)", 60)
            status = ("error: " if event.is_error else "ok: ") + _short(event.content, 60)
            self.calls[event.call_id] = [event.name, args, status]
        elif isinstance(event, InvalidOutput):
            key = f"invalid-{event.step}-{len(self.calls)}"
            self.calls[key] = ["?", "(unreadable)", "error: " + _short(event.message)]
        elif isinstance(event, StepFinished):
            self.tokens += event.usage.completion_tokens
            self._step_deltas = 0
            self._gen_s += event.duration_s
            self._gen_start = None
        elif isinstance(event, RunFinished):
            self.result = event.result

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of generation time."""
        live = time.monotonic() - self._gen_start if self._gen_start is not None else 0.0
        total_s = self._gen_s + live
        return (self.tokens + self._step_deltas) / total_s if total_s > 0 else 0.0

    def __rich__(self) -> RenderableType:
        style = _PHASE_STYLE.get(self.phase, "white")
        status = Text.assemble(("step ", "dim"), str(self.step), ("  phase ", "dim"), (self.phase, f"bold {style}"),
                               ("  tokens ", "dim"), str(self.tokens + self._step_deltas),
                               ("  ", ""), f"{self.tokens_per_s:.1f} tok/s",
                               ("  elapsed ", "dim"), f"{time.monotonic() - self.started:.1f}s")
        tail = "\n".join(self.text.splitlines()[-self.text_lines:])
        parts: list[RenderableType] = [status, Panel(Text(tail or "…"), title=_short(self.task, 60),
                                                     border_style=style)]
        if self.phase == "tool" and self.tool_output:
            lines = self.tool_output.splitlines()[-6:]
            parts.append(Panel(Text("\n".join(lines), style="dim"), title="tool output", border_style="yellow"))
        if self.calls:
            table = Table(show_header=True, header_style="bold", expand=True)
            table.add_column("tool", no_wrap=True)
            table.add_column("arguments")
            table.add_column("result")
            for name, args, result in list(self.calls.values())[-8:]:
                table.add_row(name, args, Text(result, style="red" if result.startswith("error") else ""))
            parts.append(table)
        return Group(*parts)


def summary(result: Any) -> Table:
    """A small table for the end of a run."""
    table = Table(show_header=False, box=None)
    table.add_row("stop reason", Text(result.stop_reason, style="green" if result.ok else "yellow"))
    table.add_row("steps", str(result.steps))
    table.add_row("tokens", f"{result.usage.completion_tokens} generated, {result.usage.prompt_tokens} prompt")
    table.add_row("time", f"{result.duration_s:.1f} s")
    if result.error:
        table.add_row("why", result.error)
    if result.trajectory:
        table.add_row("trajectory", result.trajectory)
    stats = result.engine_stats or {}
    if stats.get("decode_tok_s"):
        table.add_row("engine", f"decode {stats['decode_tok_s']} tok/s, prefill {stats.get('prefill_tok_s')} tok/s")
    return table
