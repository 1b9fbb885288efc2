"""The built-in suite: small, self-contained Python bug-fix tasks written for this project.

Each task is a tiny package with tests; the bugs vary (off-by-one, wrong condition, missing case, wrong API use,
fixes that span several files). ``TASKS`` lists them in a stable order.
"""

from __future__ import annotations

from freetoken_agent.evals.suites.builtin import api_misuse, conditions, missing_case, multi_file, off_by_one
from freetoken_agent.evals.suites.spec import SuiteTask

TASKS: list[SuiteTask] = [
    *off_by_one.TASKS,
    *conditions.TASKS,
    *missing_case.TASKS,
    *api_misuse.TASKS,
    *multi_file.TASKS,
]
