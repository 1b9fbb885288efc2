"""Built-in eval suites, by name. A suite is materialized into git repositories plus a SWE-bench JSONL.

``freetoken eval builtin`` runs the built-in suite; ``materialize_suite("builtin", DIR)`` writes it out for any
SWE-bench-style tool.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from freetoken_agent.evals.suites.spec import SuiteTask, materialize
from freetoken_agent.evals.swe.task import EvalError

# suite name -> module holding ``TASKS``
SUITES: dict[str, str] = {"builtin": "freetoken_agent.evals.suites.builtin"}


def suite_tasks(name: str) -> list[SuiteTask]:
    """The task specs of a built-in suite; ``EvalError`` for an unknown name."""
    if name not in SUITES:
        raise EvalError(f"unknown suite {name!r} (built-in suites: {', '.join(sorted(SUITES))})")
    return list(importlib.import_module(SUITES[name]).TASKS)


def materialize_suite(name: str, dest: Path, only: Callable[[str], bool] | None = None) -> Path:
    """Write the suite's repositories under ``dest/repos`` and its tasks to ``dest/<name>.jsonl`` (only the tasks
    whose instance id ``only`` accepts, when given)."""
    specs = [s for s in suite_tasks(name) if only is None or only(f"{name}__{s.name}")]
    return materialize(specs, name, dest)


__all__ = ["SUITES", "SuiteTask", "materialize_suite", "suite_tasks"]
