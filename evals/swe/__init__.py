"""SWE-style evals run locally: SWE-bench task format, git workspaces, per-test timeouts, scoring and reports.

Layout: ``task`` (the instance format and loader), ``gitops`` (checkouts, diffs, patches), ``testrun`` (tests with
a per-test watchdog), ``grading`` (SWE-bench's resolved rule), ``agents`` / ``sdk_agent`` (what is evaluated),
``harness`` (one task end to end, many concurrently), ``results`` (the run folder, resume), ``report``.
"""
