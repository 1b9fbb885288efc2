"""Evaluate a real ``freetoken_agent.Agent``: one fresh agent per task, confined to the task's workspace.

The adapter measures time to first token per turn from the agent's event stream (any backend), and adds the
engine statistics a local backend reports (prefix and expert hit rates) to the task's result.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from freetoken_agent.evals.swe.agents import AgentOutcome
from freetoken_agent.evals.swe.task import EvalError, Task

if TYPE_CHECKING:
    from freetoken_agent.agent import Agent
    from freetoken_agent.backends.base import Backend

AgentFactory = Callable[[Task, Path], "Agent"]
"""Builds the agent for one task, given the task and its workspace root."""


class SDKAgent:
    """Runs an ``Agent`` made by ``factory`` on each task's problem statement; its trajectory is kept in the
    task's output folder (unless the factory chose another file)."""

    def __init__(self, factory: AgentFactory, name: str = "agent") -> None:
        self.factory = factory
        self.name = name

    async def solve(self, task: Task, workspace: Path, log_dir: Path) -> AgentOutcome:
        from freetoken_agent.events import RunStarted, StepFinished, TextDelta, ToolCallFinished, ToolCallStarted

        agent = self.factory(task, workspace)
        if agent.trajectory is None:
            agent.trajectory = log_dir / "trajectory.jsonl"
        if agent.limits.max_wall_s is None or agent.limits.max_wall_s > task.agent_timeout_s:
            agent.limits = dataclasses.replace(agent.limits, max_wall_s=task.agent_timeout_s)
        ttft: list[float] = []
        waiting = [True]  # a model call is pending and has produced nothing yet
        last = [time.monotonic()]  # when the pending model call could start (after the last tool finished)

        def on_event(event: Any) -> None:
            now = time.monotonic()
            if isinstance(event, (RunStarted, ToolCallFinished)):
                last[0] = now
            elif isinstance(event, StepFinished):
                last[0], waiting[0] = now, True
            elif isinstance(event, (TextDelta, ToolCallStarted)) and waiting[0]:
                ttft.append(now - last[0])
                waiting[0] = False

        before = _stats(agent.backend)
        result = await agent.run(task.problem_statement, on_event=on_event)
        engine = stats_delta(before, result.engine_stats or {})
        if ttft:
            engine["ttft_s"] = [round(t, 4) for t in ttft]
        stopped = None if result.ok else result.stop_reason + (f": {result.error}" if result.error else "")
        return AgentOutcome(turns=result.steps, tokens_in=result.usage.prompt_tokens,
                            tokens_out=result.usage.completion_tokens, final_message=result.final_message,
                            stopped=stopped, engine=engine)


# Engine statistics that are not cumulative counters: kept as they are at the task's end, never subtracted.
_NOT_COUNTERS = ("_rate", "_ratio", "_tok_s", "_per_s", "_per_token", "_cost", "_sessions", "threads", "phase")


def _stats(backend: Any) -> dict[str, Any]:
    stats = getattr(backend, "stats", None)
    return dict(stats() or {}) if callable(stats) else {}


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per-task engine statistics from the engine's cumulative ones: counters (tokens, seconds, requests, hits)
    become the difference over the task, hit rates are recomputed from those differences when the counters are
    there, and other rates and settings stay as reported at the end. With several workers sharing one engine
    the differences include the other tasks' work."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            out[key] = stats_delta(old, value)
        elif (isinstance(value, (int, float)) and isinstance(old, (int, float)) and not isinstance(value, bool)
              and not str(key).endswith(_NOT_COUNTERS)):  # keys may be ints (speculation's k_hist)
            out[key] = round(value - old, 6)
        else:
            out[key] = value
    _task_rates(out, before)
    return out


def _task_rates(delta: dict[str, Any], before: dict[str, Any]) -> None:
    """Recompute ``<name>_hit_rate`` over the task from its counters when the engine reports them:
    ``<name>_hits`` / ``<name>_misses``, or ``<name>_hit_tokens`` / ``prefill_tokens`` (tokens reused vs computed)."""
    for key in list(delta):
        if not str(key).endswith("_hit_rate") or not before:
            continue
        name = key[: -len("_hit_rate")]
        pairs = [(f"{name}_hits", f"{name}_misses"), (f"{name}_hit_tokens", "prefill_tokens")]
        for hit_key, miss_key in pairs:
            hits, misses = delta.get(hit_key), delta.get(miss_key)
            if isinstance(hits, (int, float)) and isinstance(misses, (int, float)):
                delta[key] = round(hits / (hits + misses), 4) if hits + misses else None
                break


def coding_agent_factory(backend_factory: Callable[[], Backend], **options: Any) -> AgentFactory:
    """A factory making ``Agent.coding(backend, workspace=...)`` per task (one backend object per task)."""

    def make(task: Task, workspace: Path) -> Agent:
        from freetoken_agent.agent import Agent

        return Agent.coding(backend_factory(), workspace=workspace, **options)

    return make


def load_factory(spec: str) -> AgentFactory:
    """``package.module:function`` or ``path/to/file.py:function`` -> the function (``(task, workspace) -> Agent``)."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise EvalError(f"--agent {spec!r}: expected gold, empty, agent, or MODULE:FUNCTION")
    try:
        if target.endswith(".py"):
            import importlib.util

            path = Path(target)
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            if module_spec is None or module_spec.loader is None or not path.exists():
                raise EvalError(f"--agent {spec!r}: no such file {target}")
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ImportError as exc:
        raise EvalError(f"--agent {spec!r}: cannot import {target}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise EvalError(f"--agent {spec!r}: {target} has no function {attr!r}")
    return factory
