"""Process tools: ``run_shell`` and ``run_tests`` (pytest, summarised). Both run in the workspace root, confined by
the OS sandbox of the tool's ``SandboxPolicy`` (``tools/sandbox``; refused where none exists unless ``full-access``)."""

from __future__ import annotations

import re
import shutil
import sys
from typing import Annotated

import anyio.to_thread
import pydantic

from freetoken_agent.tools.context import ToolContext, ToolError, ToolResult
from freetoken_agent.tools.definition import tool
from freetoken_agent.tools.process import ProcessOutcome, clean_terminal_text, run_process
from freetoken_agent.tools.sandbox.command import confined
from freetoken_agent.tools.sandbox.probe import probe

TEST_TAIL_CHARS = 4000
MAX_TIMEOUT_S = 86_400.0
Seconds = Annotated[float, pydantic.Field(gt=0, le=MAX_TIMEOUT_S)]  # NaN and inf are refused before any tool runs
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)\b")
_SUMMARY_LINE = re.compile(r"\b(passed|failed|errors?|skipped|no tests ran)\b.* in [\d.]+s")
_FAILED_ID = re.compile(r"^(FAILED|ERROR) (\S+)")


def _shell() -> str:
    return shutil.which("bash") or "/bin/sh"


def _ended(outcome: ProcessOutcome, timeout_s: float, what: str) -> str:
    if outcome.timed_out:
        return f"{what} timed out after {timeout_s:g} s; its process group was killed."
    if outcome.cancelled:
        return f"{what} was cancelled; its process group was killed."
    return f"exit code: {outcome.exit_code}"


def shell_result_prefix(output: str) -> str:
    """How ``run_shell``'s result starts, given the output so far (streamed or final): the output on whole lines."""
    return output if output.endswith("\n") else output + "\n"


@tool(kind="execute", writes=True, expected_s=5.0)
async def run_shell(ctx: ToolContext, command: str, timeout_s: Seconds | None = None) -> ToolResult:
    """Run a shell command (bash) in the workspace root and return its output (stdout+stderr) and exit code.

    Each call starts a fresh shell in the workspace root: cd and exported variables do not carry over (chain them:
    'cd src && make'). Stdin is closed; background processes are killed when the command ends; long output keeps
    its head and tail.

    Args:
        command: The command line, e.g. 'ls -la' or 'python script.py'.
        timeout_s: Seconds before the command is killed (default: the session's timeout, 120 s unless configured).
    """
    if not command.strip():
        raise ToolError("command is empty")
    limit = ctx.clamp_timeout(timeout_s)
    policy = ctx.sandbox_for("run_shell")
    await anyio.to_thread.run_sync(probe)  # the first probe starts a process: not on the event loop
    with confined([_shell(), "-c", command], policy, ctx.workspace.root, ctx.env, limit) as run:
        outcome = await run_process(
            run.argv,
            cwd=str(ctx.workspace.root),
            env=run.env,
            timeout_s=limit,
            max_chars=ctx.max_output_chars,
            on_output=ctx.on_output,
            cancel_event=ctx.cancel_event,
        )
    output = outcome.output if outcome.output else "(no output)"
    # the output first, the status last: the result then starts with what streamed while the command ran, so a
    # local engine can prefill it during the run (``shell_result_prefix``) and only the status line is left
    return ToolResult(
        content=f"{shell_result_prefix(output)}{_ended(outcome, limit, 'Command')}",
        is_error=outcome.timed_out or outcome.cancelled,
        data={
            "exit_code": outcome.exit_code,
            "timed_out": outcome.timed_out,
            "cancelled": outcome.cancelled,
            "duration_s": round(outcome.duration_s, 3),
            "output_truncated": outcome.truncated,
            "sandbox": policy.mode.value,
            "sandbox_mechanisms": list(run.mechanisms),
        },
    )


def _streamed_prefix(text: str) -> str:
    """The start of ``run_shell``'s result implied by output streamed so far: its whole lines, cleaned like the
    final output (a partial last line may still change)."""
    cleaned = clean_terminal_text(text)
    return cleaned[: cleaned.rfind("\n") + 1]


run_shell.stream_prefix = _streamed_prefix


def summarize_pytest(output: str) -> dict[str, object]:
    """Counts (passed, failed, errors, skipped, ...) and failing test ids from pytest's ``-q -rfE`` output."""
    counts: dict[str, int] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for line in reversed(output.splitlines()):
        if _SUMMARY_LINE.search(line):
            for number, label in _COUNT.findall(line):
                key = {"error": "errors", "warning": "warnings"}.get(label, label)
                counts[key] = int(number)
            break
    failing: list[str] = []
    for line in output.splitlines():
        match = _FAILED_ID.match(line)
        if match and match.group(2) not in failing:
            failing.append(match.group(2))
    return {**counts, "failing": failing}


def _test_targets(ctx: ToolContext, paths: list[str]) -> list[str]:
    targets: list[str] = []
    for item in paths:
        file_part, sep, rest = item.partition("::")
        resolved = ctx.workspace.resolve(file_part)
        if not resolved.exists():
            raise ToolError(f"test path {file_part!r} does not exist")
        targets.append(ctx.workspace.relative(resolved) + sep + rest)
    return targets


@tool(kind="execute", writes=True, expected_s=20.0)  # writes: test code can do anything the user can
async def run_tests(
    ctx: ToolContext, paths: list[str] | None = None, keyword: str | None = None, timeout_s: Seconds | None = None
) -> ToolResult:
    """Run the project's tests with pytest and summarise: passed/failed counts, failing test ids, output tail.

    Args:
        paths: Test files, folders or ids ('tests/test_x.py::test_y'); omit to run pytest's default discovery.
        keyword: Only run tests matching this pytest -k expression.
        timeout_s: Seconds before the test run is killed (default: the session's timeout).
    """
    argv = [ctx.python or sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=short", "--color=no"]
    argv += ["-p", "no:cacheprovider"]  # leave no .pytest_cache behind in the user's repository
    argv += _test_targets(ctx, paths or [])
    if keyword:
        argv += ["-k", keyword]
    limit = ctx.clamp_timeout(timeout_s)
    policy = ctx.sandbox_for("run_tests")
    await anyio.to_thread.run_sync(probe)
    # no bytecode: an edit within the second of the last run (same size, same mtime second) would otherwise run the
    # stale .pyc; and the user's repository gets no __pycache__ folders
    env = {"PYTHONDONTWRITEBYTECODE": "1", **ctx.env}
    with confined(argv, policy, ctx.workspace.root, env, limit) as run:
        outcome = await run_process(
            run.argv,
            cwd=str(ctx.workspace.root),
            env=run.env,
            timeout_s=limit,
            max_chars=max(ctx.max_output_chars, TEST_TAIL_CHARS * 2),
            on_output=ctx.on_output,
            cancel_event=ctx.cancel_event,
        )
    summary = summarize_pytest(outcome.output)
    failing = summary["failing"]
    assert isinstance(failing, list)
    counts = ", ".join(
        f"{summary[key]} {'error' if key == 'errors' and summary[key] == 1 else key}"
        for key in ("passed", "failed", "errors", "skipped")
        if summary[key]
    )
    if outcome.timed_out or outcome.cancelled:
        head = _ended(outcome, limit, "The test run")
    elif "No module named pytest" in outcome.output:
        head = f"pytest is not installed for {argv[0]}; install it (pip install pytest) or run the tests with run_shell"
    elif outcome.exit_code == 5:
        head = "pytest: no tests were collected (exit code 5)"
    else:
        head = f"pytest: {counts or 'no results'} (exit code {outcome.exit_code})"
    parts = [head]
    if failing:
        parts.append("Failing tests:\n" + "\n".join(f"  {name}" for name in failing[:50]))
        if len(failing) > 50:
            parts.append(f"  ... and {len(failing) - 50} more")
    tail = outcome.output[-TEST_TAIL_CHARS:]
    parts.append("Output (tail):\n" + (tail if tail.strip() else "(no output)"))
    return ToolResult(
        content="\n".join(parts),
        # failing or uncollectable tests are a normal result; only a run that could not report is an error
        is_error=outcome.timed_out
        or outcome.cancelled
        or outcome.exit_code not in (0, 1, 2, 5)
        or "No module named pytest" in outcome.output,
        data={
            **summary,
            "exit_code": outcome.exit_code,
            "timed_out": outcome.timed_out,
            "duration_s": round(outcome.duration_s, 3),
            "sandbox": policy.mode.value,
        },
    )
