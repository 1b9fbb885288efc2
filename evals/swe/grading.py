"""SWE-bench's resolved rule, applied to the statuses our test runner reports.

A test *passes* when its status is PASSED or XFAIL, and *fails* when it is missing, FAILED or ERROR; a SKIPPED
test counts as neither. A task is resolved when every FAIL_TO_PASS and every PASS_TO_PASS test that is
counted passes (an empty list counts as all-passed), exactly as ``swebench.harness.grading`` decides FULL.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from freetoken_agent.evals.swe.testrun import ERROR, FAILED, PASSED, XFAIL


@dataclass
class Split:
    """Outcome of one test list (FAIL_TO_PASS or PASS_TO_PASS)."""

    success: list[str] = field(default_factory=list)
    failure: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Fraction that passed among the counted tests; 1.0 when none were counted (SWE-bench's rule)."""
        total = len(self.success) + len(self.failure)
        return 1.0 if total == 0 else len(self.success) / total


def passes(test: str, status: dict[str, str]) -> bool:
    return status.get(test) in (PASSED, XFAIL)


def fails(test: str, status: dict[str, str]) -> bool:
    return test not in status or status[test] in (FAILED, ERROR)


def split(tests: list[str], status: dict[str, str]) -> Split:
    """Sort ``tests`` into passed / failed; skipped tests land in neither."""
    out = Split()
    for test in tests:
        if passes(test, status):
            out.success.append(test)
        elif fails(test, status):
            out.failure.append(test)
    return out


def is_resolved(f2p: Split, p2p: Split) -> bool:
    """SWE-bench's FULL resolution: every counted FAIL_TO_PASS and PASS_TO_PASS test passes."""
    return f2p.rate == 1.0 and p2p.rate == 1.0
