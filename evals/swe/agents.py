"""The agents the harness evaluates, behind one small interface.

``EvalAgent.solve`` works on a fresh checkout and returns what it spent; the harness takes the diff itself, so
an agent only has to edit files. Two reference agents validate the harness and a suite: ``GoldAgent`` applies
the task's gold patch (must resolve 100%) and ``EmptyAgent`` changes nothing (must resolve 0%).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio.to_thread
from freetoken_agent.evals.swe.gitops import apply_patch
from freetoken_agent.evals.swe.task import Task


class TaskSkipped(Exception):
    """The task cannot run here (missing repository, environment or gold patch); the message says why."""


@dataclass
class AgentOutcome:
    """What an agent reports after working on one task."""

    turns: int = 0
    """Model calls (agent steps) made."""
    tokens_in: int = 0
    """Prompt tokens over all turns."""
    tokens_out: int = 0
    """Generated tokens over all turns."""
    final_message: str = ""
    """The agent's last message (a summary of what it did)."""
    stopped: str | None = None
    """Why the agent stopped early (a limit, an error), or None when it finished on its own."""
    engine: dict[str, Any] = field(default_factory=dict)
    """Local-engine statistics when the backend has them: ``ttft_s`` per turn, prefix and expert hit rates."""


class EvalAgent(Protocol):
    """Anything that can work on a task in a workspace."""

    name: str

    async def solve(self, task: Task, workspace: Path, log_dir: Path) -> AgentOutcome:
        """Edit files under ``workspace`` to resolve ``task``; write any transcript under ``log_dir``."""
        ...


class GoldAgent:
    """Applies the task's gold ``patch``: a harness or suite where this does not score 100% is broken."""

    name = "gold"

    async def solve(self, task: Task, workspace: Path, log_dir: Path) -> AgentOutcome:
        if not task.patch.strip():
            raise TaskSkipped("the task has no gold patch")
        await anyio.to_thread.run_sync(apply_patch, workspace, task.patch)
        return AgentOutcome(final_message="applied the gold patch")


class EmptyAgent:
    """Changes nothing: every task must stay unresolved."""

    name = "empty"

    async def solve(self, task: Task, workspace: Path, log_dir: Path) -> AgentOutcome:
        return AgentOutcome(final_message="made no changes")
