"""A self-contained pytest plugin that streams one JSON line per test event to ``$FREETOKEN_EVAL_REPORT``.

The harness copies this file next to the test run (as ``_freetoken_eval_report.py``) and loads it with ``-p``:
it depends only on pytest and the standard library, so it works inside any test environment. The stream lets
the harness see which test is running (to kill exactly the hung one) and read outcomes without parsing logs.
Statuses follow SWE-bench's names: PASSED, FAILED, ERROR, SKIPPED, XFAIL.
"""

from __future__ import annotations

import json
import os
from typing import Any

_OUT: Any = None
_STATUS: dict[str, str] = {}


def _emit(**event: str) -> None:
    global _OUT
    if _OUT is None:
        _OUT = open(os.environ["FREETOKEN_EVAL_REPORT"], "a", encoding="utf-8")  # noqa: SIM115
    _OUT.write(json.dumps(event) + "\n")
    _OUT.flush()


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _emit(event="collect_error", nodeid=report.nodeid)


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _emit(event="start", nodeid=nodeid)


def pytest_runtest_logreport(report: Any) -> None:
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if report.passed:
            status = "PASSED"
        elif report.failed:
            status = "FAILED"
        else:
            status = "XFAIL" if xfail else "SKIPPED"
        _STATUS.setdefault(report.nodeid, status)
    elif report.failed:  # setup or teardown error beats any call outcome
        _STATUS[report.nodeid] = "ERROR"
    elif report.when == "setup" and report.skipped:
        _STATUS[report.nodeid] = "XFAIL" if xfail else "SKIPPED"


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    _emit(event="end", nodeid=nodeid, status=_STATUS.pop(nodeid, "ERROR"))
