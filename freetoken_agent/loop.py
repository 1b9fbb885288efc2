"""One run of an :class:`~freetoken_agent.agent.Agent`: ``limits → phase hint → generate → run tools``, repeated.

A step is one model call. Tool calls that parse are run in order; calls that cannot be read, unknown tools,
invalid arguments and tool failures all come back to the model as messages and the run goes on. Limits,
cancellation and backend failures end the run with a :class:`~freetoken_agent.result.RunResult` that says why.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.lowlevel

from freetoken_agent import chat
from freetoken_agent.backends.base import GenerateRequest, GenerationDone, SessionBackend
from freetoken_agent.errors import (
    BackendError, RunCancelled, RunEnded, StepLimitExceeded, TimeLimitExceeded, TokenLimitExceeded,
)
from freetoken_agent.events import (
    AgentEvent, InvalidOutput, PhaseChanged, RunFinished, RunStarted, StepFinished, TextDelta, ToolCallFinished,
    ToolCallStarted, Usage, event_record,
)
from freetoken_agent.phases import Phase, PromptStaging, ToolOutputStaging
from freetoken_agent.result import RunResult
from freetoken_agent.trajectory import TrajectoryWriter

if TYPE_CHECKING:
    from freetoken_agent.agent import Agent

STREAM_PREFILL_CHARS = 512
"""New characters of a running tool's output between two background prefills of it (``ToolOutputStaging``)."""


@dataclass
class _Call:
    call_id: str
    name: str
    arguments: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class _Step:
    """What one model call produced so far."""

    started: float
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, _Call] = field(default_factory=dict)  # by the parser's index
    unreadable: list[str] = field(default_factory=list)  # format errors not tied to a started call
    done: GenerationDone = GenerationDone("stop")


def _trajectory_path(target: str | os.PathLike[str] | None) -> Path | None:
    if target is None:
        return None
    path = Path(target)
    if path.is_dir() or str(target).endswith(os.sep):
        return path / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{time.monotonic_ns() % 10**6}.jsonl"
    return path


class AgentRun:
    """The state of one run: conversation, usage, current phase, trajectory and cancellation."""

    def __init__(self, agent: Agent, task: str) -> None:
        from freetoken_agent.tools import ToolContext, ToolRegistry, Workspace

        self.agent = agent
        self.task = task
        self.run_id = f"run-{uuid.uuid4().hex[:12]}"
        tools = agent.tools
        self.registry = tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools)
        self.schemas = self.registry.schemas()
        self.ctx = ToolContext(workspace=Workspace(agent.workspace or os.getcwd()), timeout_s=agent.tool_timeout_s,
                               sandbox=agent.sandbox, tool_sandbox=dict(agent.tool_sandbox))
        self.messages: list[dict[str, Any]] = []
        self.usage = Usage()
        self.step = 0
        self.phase: Phase | None = None
        self.final_message = ""
        self._path = _trajectory_path(agent.trajectory)
        self._trajectory: TrajectoryWriter | None = None
        self._scope: anyio.CancelScope | None = None
        self._cancelled = False
        self._deadline = math.inf
        self._started = 0.0
        self._loop: tuple[int, Any] | None = None  # (thread id, event-loop token) of the running run
        self._done = False
        self._pending_note: str | None = None  # a format-error note sent after this step's tool results

    # ----------------------------------------------------------------------------------------------- control
    def cancel(self) -> None:
        """Stop generation or the running tool now; the run ends with ``stop_reason == "cancelled"``.

        Safe from any thread: from another thread the cancellation is handed to the run's event loop.
        """
        self._cancelled = True
        self.ctx.cancel()  # thread-safe: process tools watch this event
        if self._loop is None or threading.get_ident() == self._loop[0]:
            self._cancel_scope()
            return
        try:
            anyio.from_thread.run_sync(self._cancel_scope, token=self._loop[1])
        except RuntimeError:  # the loop has already finished: nothing left to interrupt
            pass

    def _cancel_scope(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    async def events(self) -> AsyncIterator[AgentEvent]:
        """The run, as events."""
        limits = self.agent.limits
        self._started = time.monotonic()
        self._loop = (threading.get_ident(), anyio.lowlevel.current_token())
        if limits.max_wall_s is not None:
            self._deadline = anyio.current_time() + limits.max_wall_s
        if self._path is not None:
            self._trajectory = TrajectoryWriter(self._path)
            self._trajectory.write({"type": "run_started", "run_id": self.run_id, "task": self.task,
                                    "tools": self.registry.names,
                                    "backend": type(self.agent.backend).__name__, "limits": asdict(limits),
                                    "sampling": asdict(self.agent.sampling)})
        self._add({"role": "system", "content": self.agent.instructions})
        self._add({"role": "user", "content": self.task})
        stop_reason, error = "done", None
        try:
            yield self._note(RunStarted(self.task, str(self._path) if self._path else None))
            while True:
                self._check_limits()
                self.step += 1
                calls: list[_Call] = []
                async for event in self._model_step(calls):
                    yield event
                if self._done:
                    break
                async for event in self._run_tools(calls):
                    yield event
        except RunEnded as exc:
            stop_reason, error = exc.reason, str(exc)
        except BaseException:  # the consumer stopped iterating, or an outer cancel scope / Ctrl-C hit
            self._finish("interrupted", "the run was interrupted before it finished")
            raise
        yield self._note(RunFinished(self._finish(stop_reason, error)))

    # ------------------------------------------------------------------------------------------------ steps
    def _check_limits(self) -> None:
        limits = self.agent.limits
        if self._cancelled:
            raise RunCancelled("the run was cancelled")
        if self.step >= limits.max_steps:
            raise StepLimitExceeded(f"the run reached its step limit ({limits.max_steps} model calls)")
        if self.usage.completion_tokens >= limits.max_tokens:
            raise TokenLimitExceeded(f"the run generated {self.usage.completion_tokens} tokens "
                                     f"(limit {limits.max_tokens})")
        if anyio.current_time() >= self._deadline:
            raise TimeLimitExceeded(f"the run reached its wall-time limit ({limits.max_wall_s} s)")

    async def _model_step(self, calls: list[_Call]) -> AsyncIterator[AgentEvent]:
        """One model call: stream its events, then record the assistant message and what to run."""
        limits, sampling = self.agent.limits, self.agent.sampling
        self._done = False
        event = self._set_phase(Phase.PLAN, always_hint=True)  # every model call is announced, even plan → plan
        if event:
            yield event
        budget = min(limits.max_tokens_per_step, limits.max_tokens - self.usage.completion_tokens)
        request = GenerateRequest(messages=list(self.messages), tools=self.schemas, max_tokens=budget,
                                  temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                                  session=self.run_id)
        step = _Step(started=time.monotonic())
        stream = self.agent.backend.generate(request).__aiter__()
        try:
            while (item := await self._next(stream)) is not None:
                for out in self._absorb(item, step):
                    yield out
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()  # type: ignore[attr-defined]
        for out in self._conclude(step, calls):
            yield out

    def _absorb(self, item: Any, step: _Step) -> list[AgentEvent]:
        """Fold one backend event into the step; return the agent events it causes."""
        out: list[Any] = []
        if isinstance(item, chat.TextDelta):
            (step.reasoning if item.reasoning else step.text).append(item.text)
            if self._trajectory:
                self._trajectory.text(self.step, item.text)
            out.append(TextDelta(item.text, self.step, item.reasoning))
            if self.phase is Phase.PLAN and "`" in item.text and "".join(step.text).count("```") % 2 == 1:
                out.append(self._set_phase(Phase.CODE))  # a code block opened
        elif isinstance(item, chat.ToolCallStarted):
            call = step.calls[item.index] = _Call(f"call_{self.step}_{item.index}", item.name)
            out.append(self._note(ToolCallStarted(self.step, call.call_id, call.name)))
            if self.phase is Phase.PLAN and item.name in self.registry and self.registry.get(item.name).kind == "edit":
                out.append(self._set_phase(Phase.CODE))  # the model is writing code into an edit/write call
        elif isinstance(item, chat.ToolCallFinished):
            if item.index not in step.calls:  # a backend that sends calls whole
                step.calls[item.index] = _Call(f"call_{self.step}_{item.index}", item.name)
                out.append(self._note(ToolCallStarted(self.step, step.calls[item.index].call_id, item.name)))
            step.calls[item.index].arguments = item.arguments
        elif isinstance(item, chat.FormatError):
            if item.index is not None and item.index in step.calls:
                step.calls[item.index].error = item.message
            else:
                step.unreadable.append(item.message)
        elif isinstance(item, GenerationDone):
            step.done = item
        return out

    def _conclude(self, step: _Step, calls: list[_Call]) -> list[AgentEvent]:
        """After generation: the assistant message, events for unreadable calls, and what happens next."""
        done = step.done
        self.usage = self.usage + done.usage
        good = [c for c in step.calls.values() if c.error is None and c.arguments is not None]
        bad = [c for c in step.calls.values() if c not in good]
        message: dict[str, Any] = {"role": "assistant", "content": "".join(step.text)}
        if step.reasoning:  # thinking channels stay out of the answer (the vLLM/OpenAI-compatible field name)
            message["reasoning_content"] = "".join(step.reasoning)
        if good:
            message["tool_calls"] = [{"id": c.call_id, "type": "function", "function": {
                "name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}} for c in good]
        self._add(message)
        out: list[Any] = [self._note(StepFinished(self.step, done.finish_reason, done.usage, len(good),
                                                  round(time.monotonic() - step.started, 4)))]
        for call in bad:
            reason = call.error or "the call is incomplete"
            out.append(self._note(ToolCallFinished(self.step, call.call_id, call.name, None,
                                                   f"The call to '{call.name}' could not be read: {reason}", True)))
        out += [self._note(InvalidOutput(self.step, reason)) for reason in step.unreadable]
        calls.extend(good)
        problems = [f"your call to '{c.name}' could not be read: {c.error or 'it is incomplete'}" for c in bad]
        problems += [f"a tool call could not be read: {reason}" for reason in step.unreadable]
        self._pending_note = None
        if problems:  # sent after this step's tool results, so each result still follows its call
            self._pending_note = ("Tool-call format error: " + "; ".join(problems) +
                                  ". Write each call exactly in the tool-call format, with JSON object arguments.")
        elif not good and done.finish_reason == "length":
            self._pending_note = "Your reply was cut off at the token limit of one step. Continue, or call a tool."
        elif not good:
            self.final_message = message["content"]
            self._done = True
        if self._pending_note and not good:
            self._add({"role": "user", "content": self._pending_note})
            self._pending_note = None
        return out

    async def _run_tools(self, calls: list[_Call]) -> AsyncIterator[AgentEvent]:
        for call in calls:
            tool = self.registry.get(call.name) if call.name in self.registry else None
            expected = tool.expected_s if tool is not None else None
            backend = self.agent.backend
            if isinstance(backend, PromptStaging):  # KV pre-staging: the result's framing is warmed while it runs
                result_slot = {"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": ""}
                backend.expect_prompt(self.run_id, [*self.messages, result_slot], self.schemas)
            event = self._set_phase(Phase.TOOL, expected, always_hint=True)
            if event:
                yield event
            started = time.monotonic()
            self.ctx.on_output = self._output_watcher(call, tool)
            result = await self._call_tool(call)
            self._add({"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": result.content})
            yield self._note(ToolCallFinished(self.step, call.call_id, call.name, call.arguments, result.content,
                                              result.is_error, result.data, round(time.monotonic() - started, 4)))
        if self._pending_note:
            self._add({"role": "user", "content": self._pending_note})
            self._pending_note = None

    def _output_watcher(self, call: _Call, tool: Any) -> Any:
        """``ctx.on_output`` for one call: the agent's ``on_tool_output`` callback, and — when the backend prefills
        streamed tool output (``ToolOutputStaging``) and the tool says how its result starts — the conversation
        with the result so far, every ``STREAM_PREFILL_CHARS`` new characters."""
        watcher = self.agent.on_tool_output
        backend = self.agent.backend
        prefix_of = getattr(tool, "stream_prefix", None)
        staging = isinstance(backend, ToolOutputStaging) and prefix_of is not None
        if watcher is None and not staging:
            return None
        seen: list[str] = []
        size = [0, 0]  # characters seen, characters seen at the last send
        # past the output cap the result keeps only a head and a tail: streaming more cannot match it
        cap = self.ctx.max_output_chars

        def on_output(text: str) -> None:
            if watcher is not None:
                watcher(call.call_id, text)
            if not staging or size[0] > cap:
                return
            seen.append(text)
            size[0] += len(text)
            if size[0] - size[1] < STREAM_PREFILL_CHARS:  # join and clean only every few hundred characters
                return
            size[1] = size[0]
            slot = {"role": "tool", "tool_call_id": call.call_id, "name": call.name,
                    "content": prefix_of("".join(seen))}
            backend.stream_tool_output(self.run_id, [*self.messages, slot], self.schemas)

        return on_output

    async def _call_tool(self, call: _Call) -> Any:
        with anyio.CancelScope(deadline=self._deadline) as scope:
            self._scope = scope
            if self._cancelled:
                scope.cancel()
            try:
                return await self.registry.call(call.name, call.arguments, self.ctx)
            finally:
                self._scope = None
        self.ctx.cancel()
        if self._cancelled:
            raise RunCancelled(f"the run was cancelled while '{call.name}' ran")
        raise TimeLimitExceeded(f"the run reached its wall-time limit ({self.agent.limits.max_wall_s} s) "
                                f"while '{call.name}' ran")

    async def _next(self, stream: Any) -> Any:
        """The backend's next event (None at the end), within the deadline and cancellable."""
        with anyio.CancelScope(deadline=self._deadline) as scope:
            self._scope = scope
            if self._cancelled:
                scope.cancel()
            try:
                return await stream.__anext__()
            except StopAsyncIteration:
                return None
            except RunEnded:
                raise
            except Exception as exc:  # an HTTP or engine failure ends the run with its message
                raise BackendError(f"{type(exc).__name__}: {exc}") from exc
            finally:
                self._scope = None
        if self._cancelled:
            raise RunCancelled("the run was cancelled while the model was generating")
        raise TimeLimitExceeded(f"the run reached its wall-time limit ({self.agent.limits.max_wall_s} s) "
                                "while the model was generating")

    # -------------------------------------------------------------------------------------------- bookkeeping
    def _set_phase(self, phase: Phase, expected_s: float | None = None, always_hint: bool = False) -> Any:
        if phase is self.phase and not always_hint:
            return None
        backend = self.agent.backend
        if isinstance(backend, SessionBackend):
            backend.hint(phase, expected_s, session=self.run_id)
        else:
            backend.hint(phase, expected_s)
        if phase is self.phase:
            return None
        self.phase = phase
        return self._note(PhaseChanged(phase, self.step, expected_s))

    def _add(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        if self._trajectory:
            self._trajectory.write({"type": "message", "step": self.step, "message": message})

    def _note(self, event: Any) -> Any:
        if self._trajectory and not isinstance(event, (RunStarted, RunFinished)):  # both written by the run itself
            self._trajectory.write(event_record(event))
        return event

    def _finish(self, stop_reason: str, error: str | None) -> RunResult:
        if isinstance(self.agent.backend, SessionBackend):
            self.agent.backend.end_session(self.run_id)
        if not self.final_message:
            last = next((m for m in reversed(self.messages) if m["role"] == "assistant"), None)
            self.final_message = str(last["content"]) if last else ""
        result = RunResult(final_message=self.final_message, stop_reason=stop_reason, steps=self.step,
                           usage=self.usage, duration_s=time.monotonic() - self._started, messages=self.messages,
                           trajectory=str(self._path) if self._path else None, error=error,
                           engine_stats=self.agent.backend.stats())
        if self._trajectory:
            self._trajectory.write(event_record(RunFinished(result)))
            self._trajectory.close()
            self._trajectory = None
        return result
