"""The harness: for each task a fresh checkout, the agent, its diff, the test patch, the tests, the score.

The agent works in one checkout; its diff is then applied to a second fresh checkout at the same commit, where
the test patch is applied and the tests run, so only the diff counts (as in SWE-bench). Tasks run concurrently
on one event loop (an in-process engine can then batch several agents); blocking work (git, tests) runs in
worker threads. Any failure inside one task becomes that task's result; it never stops the run.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.to_thread
from freetoken_agent.tools.sandbox import SandboxPolicy
from freetoken_agent.evals.swe.agents import AgentOutcome, EvalAgent, TaskSkipped
from freetoken_agent.evals.swe.gitops import GitError, apply_patch, checkout, diff_against, snapshot
from freetoken_agent.evals.swe.grading import is_resolved, split
from freetoken_agent.evals.swe.results import ERROR, RESOLVED, SKIPPED, UNRESOLVED, RunStore, TaskResult
from freetoken_agent.evals.swe.task import Task
from freetoken_agent.evals.swe.testrun import (
    ExecutedTests,
    default_python,
    run_commands,
    run_pytest,
    run_watched,
    subprocess_env,
)


@dataclass
class HarnessConfig:
    """How tasks are run (the task file may set per-task timeouts; values here override them when set)."""

    workers: int = 1
    """Tasks worked on at the same time."""
    repos_dir: Path | None = None
    """Where SWE-bench ``owner/name`` repositories are cloned (as ``owner__name``, ``owner/name`` or ``name``)."""
    python: str | None = None
    """Interpreter for setup and tests (default: the task's ``python``, else the harness's own)."""
    test_timeout_s: float | None = None
    agent_timeout_s: float | None = None
    model_name: str = ""
    """Written as ``model_name_or_path`` in predictions.jsonl."""
    sandbox: SandboxPolicy | None = field(default_factory=SandboxPolicy)
    """The OS sandbox the tests (the agent's code) run under: ``workspace-write`` without network by default;
    ``None`` runs them unconfined. A machine that cannot enforce it refuses the task (an error naming why)."""


def resolve_repo(task: Task, repos_dir: Path | None) -> str:
    """Where to clone the task's repository from, or ``TaskSkipped`` saying why it is unavailable."""
    repo = task.repo
    if "://" in repo or repo.startswith("git@") or Path(repo).exists():
        return repo
    if repos_dir is not None:
        for candidate in (repos_dir / repo.replace("/", "__"), repos_dir / repo, repos_dir / repo.split("/")[-1]):
            if candidate.is_dir():
                return str(candidate)
    hint = f" (pass --repos DIR with a clone at DIR/{repo.replace('/', '__')})" if repo.count("/") == 1 else ""
    raise TaskSkipped(f"repository {repo} is not available locally{hint}")


@functools.lru_cache(maxsize=8)
def _has_pytest(python: str) -> bool:
    try:
        proc = subprocess.run([python, "-c", "import pytest"], check=False, capture_output=True, timeout=120)
        return proc.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _prepare(repo: str, commit: str, dest: Path, task: Task, python: str, log: Path) -> tuple[str, str]:
    """Fresh checkout + setup commands; an environment that cannot be built makes the task skipped. Returns the
    checked-out commit and the commit of the tree after setup (the same when there is no setup), so files the
    setup writes never count as the agent's changes."""
    try:
        base = checkout(repo, commit, dest)
    except GitError as exc:
        raise TaskSkipped(f"checkout failed: {exc}") from exc
    for command in task.setup:
        cmd = command.replace("{python}", python)
        run = run_watched(["bash", "-c", cmd], dest, subprocess_env(task.env), log, idle_timeout_s=1800.0)
        if run.returncode != 0:
            status = "timed out" if run.returncode is None else f"exited {run.returncode}"
            raise TaskSkipped(f"setup command {command!r} {status} (see setup.log)")
    if task.test_command is None and not _has_pytest(python):
        raise TaskSkipped(f"pytest is not installed for {python}")
    return base, snapshot(dest, "after setup") if task.setup else base


def _run_tests(task: Task, ws: Path, python: str, timeout_s: float, log: Path, scratch: Path,
               sandbox: SandboxPolicy | None) -> ExecutedTests:
    if task.test_command is not None:
        return run_commands(task.tests, task.test_command, ws, timeout_s, log, python, task.env, sandbox)
    return run_pytest(task.tests, ws, python, timeout_s, log, scratch, task.env, sandbox)


async def evaluate_task(task: Task, agent: EvalAgent, store: RunStore,
                        config: HarnessConfig) -> tuple[TaskResult, bytes | None]:
    """Run one task end to end; returns its result and the agent's patch, the exact bytes of its diff (None
    when the agent never ran)."""
    start = time.monotonic()
    result = TaskResult(instance_id=task.instance_id, status=ERROR)
    patch: bytes | None = None
    tdir = store.task_dir(task.instance_id)
    python = config.python or task.python or default_python()
    tmp = Path(tempfile.mkdtemp(prefix=f"ft-eval-{task.instance_id[:40]}-"))
    try:
        repo = resolve_repo(task, config.repos_dir)
        ws = tmp / "workspace"
        base, ready = await anyio.to_thread.run_sync(_prepare, repo, task.base_commit, ws, task, python,
                                                     tdir / "setup.log")
        await _work(task, agent, ws, tdir, config.agent_timeout_s or task.agent_timeout_s, result)
        patch = diff = await anyio.to_thread.run_sync(diff_against, ws, ready)
        (tdir / "model.patch").write_bytes(diff)
        result.patch_bytes = len(diff)
        shutil.rmtree(ws, ignore_errors=True)

        t_tests = time.monotonic()
        ev = tmp / "eval"
        await anyio.to_thread.run_sync(_prepare, repo, base, ev, task, python, tdir / "setup.log")
        try:
            await anyio.to_thread.run_sync(apply_patch, ev, diff)
        except GitError as exc:
            result.status, result.reason = UNRESOLVED, f"the agent's patch does not apply: {exc}"
            return result, patch
        try:
            await anyio.to_thread.run_sync(apply_patch, ev, task.test_patch)
        except GitError as exc:
            result.reason = f"the test patch does not apply after the agent's patch: {exc}"
            return result, patch
        (tdir / "tests.log").unlink(missing_ok=True)
        run = await anyio.to_thread.run_sync(_run_tests, task, ev, python, config.test_timeout_s or task.test_timeout_s,
                                             tdir / "tests.log", tmp / "scratch", config.sandbox)
        result.tests_s = time.monotonic() - t_tests
        _score(task, run, diff, result)
        return result, patch
    except TaskSkipped as exc:
        result.status, result.reason = SKIPPED, str(exc)
        return result, patch
    except Exception as exc:  # noqa: BLE001 - one task's failure is recorded, never lost or propagated
        result.status, result.reason = ERROR, f"{type(exc).__name__}: {exc}".splitlines()[0]
        return result, patch
    finally:
        result.wall_s = time.monotonic() - start
        shutil.rmtree(tmp, ignore_errors=True)


async def _work(task: Task, agent: EvalAgent, ws: Path, tdir: Path, timeout_s: float, result: TaskResult) -> None:
    """Let the agent work on the task; record what it spent in ``result``."""
    t_agent = time.monotonic()
    outcome = AgentOutcome()
    try:
        # Agents that can stop themselves get the timeout in the task (SDKAgent makes it the Agent's wall limit,
        # so usage is still reported); the harness cancels the others a little later.
        with anyio.fail_after(timeout_s * 1.1 + 1.0):
            outcome = await agent.solve(task.model_copy(update={"agent_timeout_s": timeout_s}), ws, tdir)
    except TimeoutError:
        outcome.stopped = f"agent timed out after {timeout_s:g}s"
    result.agent_s = time.monotonic() - t_agent
    result.turns, result.tokens_in, result.tokens_out = outcome.turns, outcome.tokens_in, outcome.tokens_out
    result.agent_stopped, result.engine = outcome.stopped, outcome.engine
    if outcome.final_message:
        (tdir / "final_message.txt").write_text(outcome.final_message, encoding="utf-8")


def _score(task: Task, run: ExecutedTests, patch: bytes, result: TaskResult) -> None:
    """SWE-bench's verdict from the test statuses, with a one-line reason when unresolved."""
    f2p, p2p = split(task.FAIL_TO_PASS, run.status), split(task.PASS_TO_PASS, run.status)
    result.fail_to_pass = {"success": f2p.success, "failure": f2p.failure}
    result.pass_to_pass = {"success": p2p.success, "failure": p2p.failure}
    result.timed_out_tests = run.timed_out
    reasons: list[str] = []
    if not patch.strip():
        result.status = UNRESOLVED
        reasons.append("empty patch")
    elif is_resolved(f2p, p2p):
        result.status = RESOLVED
    else:
        result.status = UNRESOLVED
        if f2p.failure:
            reasons.append(f"{len(f2p.failure)}/{len(task.FAIL_TO_PASS)} FAIL_TO_PASS failed")
        if p2p.failure:
            reasons.append(f"{len(p2p.failure)}/{len(task.PASS_TO_PASS)} PASS_TO_PASS failed")
        if run.timed_out:
            reasons.append(f"{len(run.timed_out)} timed out")
    result.reason = "; ".join([*reasons, *run.notes])


async def run_tasks(tasks: list[Task], agent: EvalAgent, store: RunStore, config: HarnessConfig,
                    on_result: Callable[[TaskResult], None] | None = None) -> list[TaskResult]:
    """Evaluate ``tasks`` with up to ``config.workers`` at a time; each result is appended to the store as
    soon as its task finishes. Returns the results in task order."""
    limiter = anyio.CapacityLimiter(max(1, config.workers))
    results: dict[str, TaskResult] = {}

    async def one(task: Task) -> None:
        async with limiter:
            result, patch = await evaluate_task(task, agent, store, config)
        store.append(result, patch, config.model_name or agent.name)
        results[task.instance_id] = result
        if on_result is not None:
            on_result(result)

    async with anyio.create_task_group() as tg:
        for task in tasks:
            tg.start_soon(one, task)
    return [results[t.instance_id] for t in tasks]


async def run_pending(tasks: list[Task], agent: EvalAgent, store: RunStore, config: HarnessConfig,
                      on_result: Callable[[TaskResult], None] | None = None) -> list[TaskResult]:
    """Run the tasks that have no result in ``store`` yet (all of them in a fresh run; the missing ones when
    resuming), then return every task's result in task order."""
    done = store.load()
    await run_tasks([t for t in tasks if t.instance_id not in done], agent, store, config, on_result)
    results = store.load()
    return [results[t.instance_id] for t in tasks if t.instance_id in results]
