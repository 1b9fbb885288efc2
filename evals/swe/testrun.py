"""Run a task's tests with a per-test timeout and return one SWE-bench status per test.

pytest mode (the default): all tests run in one ``python -m pytest`` process with our report plugin, which
streams a line as each test starts and ends. A watchdog kills the whole process group when one test runs past
its timeout; that test scores FAILED (timed out) and the tests that had not run yet run again in a new process.
Command mode (``Task.test_command``): one shell command per test, exit status 0 = PASSED.

The tests run the code the agent wrote, so with a ``SandboxPolicy`` they run under the tools' OS sandbox
(``freetoken_agent.tools.sandbox``: workspace and the report's scratch folder writable, network off, ``.git``
read-only, an allow-listed environment plus the variables the harness and the task set, everything killed at the
end). Trusted setup commands run without it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

from freetoken_agent.tools.sandbox import SandboxPolicy, confined

PASSED, FAILED, ERROR, SKIPPED, XFAIL = "PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL"
PLUGIN_MODULE = "_freetoken_eval_report"
POLL_S = 0.05


@dataclass
class ExecutedTests:
    """Outcome of running one task's tests."""

    status: dict[str, str] = field(default_factory=dict)
    """Test id -> PASSED / FAILED / ERROR / SKIPPED / XFAIL (a test that never reported is absent)."""
    timed_out: list[str] = field(default_factory=list)
    """Tests killed at their timeout (they also appear as FAILED in ``status``)."""
    notes: list[str] = field(default_factory=list)
    """Human-readable remarks (collection errors, process exits without results)."""


@dataclass
class _Batch:
    events: list[dict[str, str]]
    returncode: int | None  # None: killed by the watchdog
    running: str | None  # the test that was in flight when the watchdog fired


def subprocess_env(extra: dict[str, str] | None = None, extra_path: Path | None = None) -> dict[str, str]:
    """Environment for setup and test processes: no bytecode files in the workspace, no inherited addopts,
    plus the task's own variables."""
    env = dict(os.environ)
    env.pop("PYTEST_ADDOPTS", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra or {})
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(extra_path), env.get("PYTHONPATH", "")] if p)
    return env


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill a process started with ``start_new_session=True`` together with everything it spawned."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_watched(cmd: list[str], cwd: Path, env: dict[str, str], log: Path, idle_timeout_s: float,
                events_path: Path | None = None, first_timeout_s: float | None = None,
                sandbox: SandboxPolicy | None = None) -> _Batch:
    """Run ``cmd`` in its own process group, output appended to ``log``. With ``events_path`` the watchdog
    restarts its clock at each event and fires ``idle_timeout_s`` after the last one (``first_timeout_s``
    before the first); without it the command gets ``idle_timeout_s`` in total. With ``sandbox`` the command runs
    confined to ``cwd`` (``SandboxUnavailable`` when this machine cannot enforce the policy); of ``env`` it then
    keeps the policy's allow-list plus every variable that differs from this process's environment."""
    if sandbox is None:
        jail = nullcontext(None)
    else:
        extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
        jail = confined(cmd, sandbox, cwd, extra, (first_timeout_s or 0.0) + idle_timeout_s)
    with jail as box:
        argv, run_env = (cmd, env) if box is None else (box.argv, box.env)
        return _watch(cmd, argv, cwd, run_env, log, idle_timeout_s, events_path, first_timeout_s)


def _watch(shown: list[str], cmd: list[str], cwd: Path, env: dict[str, str], log: Path, idle_timeout_s: float,
           events_path: Path | None, first_timeout_s: float | None) -> _Batch:
    events: list[dict[str, str]] = []
    offset = 0
    running: str | None = None
    with log.open("ab") as out:
        out.write(f"$ {shlex.join(shown)}\n".encode())
        out.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + (first_timeout_s or idle_timeout_s)
        while True:
            done = proc.poll() is not None
            if events_path is not None and events_path.exists():
                with events_path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                complete = chunk[: chunk.rfind(b"\n") + 1]
                offset += len(complete)
                for line in complete.decode("utf-8", "replace").splitlines():
                    event = json.loads(line)
                    events.append(event)
                    running = event["nodeid"] if event["event"] == "start" else None
                    deadline = time.monotonic() + idle_timeout_s
            if done:
                return _Batch(events, proc.returncode, None)
            if time.monotonic() > deadline:
                kill_group(proc)
                out.write(f"\n[freetoken eval] killed after {idle_timeout_s:g}s without progress\n".encode())
                return _Batch(events, None, running)
            time.sleep(POLL_S)


def _match(requested: str, reported: dict[str, str]) -> str | None:
    """Status of a requested id: the exact node, or the aggregate over the nodes under it (file or class)."""
    if requested in reported:
        return reported[requested]
    children = [s for node, s in reported.items() if node.startswith((requested + "::", requested + "["))]
    if not children:
        return None
    if any(s in (FAILED, ERROR) for s in children):
        return FAILED
    if all(s == SKIPPED for s in children):
        return SKIPPED
    return PASSED


def run_pytest(tests: list[str], workspace: Path, python: str, timeout_s: float, log: Path,
               scratch: Path, extra_env: dict[str, str] | None = None,
               sandbox: SandboxPolicy | None = None) -> ExecutedTests:
    """Run pytest node ids with the report plugin and the per-test watchdog (see module docstring)."""
    scratch.mkdir(parents=True, exist_ok=True)
    if sandbox is not None:  # the report plugin writes its events next to itself
        sandbox = replace(sandbox, writable=(*sandbox.writable, str(scratch.resolve())))
    plugin_src = Path(__file__).with_name("pytest_report_plugin.py")
    (scratch / f"{PLUGIN_MODULE}.py").write_text(plugin_src.read_text(encoding="utf-8"), encoding="utf-8")
    env = subprocess_env(extra_env, scratch)
    result = ExecutedTests()
    reported: dict[str, str] = {}
    pending = list(tests)
    one_by_one = False
    noted: set[str] = set()
    attempt = 0
    while pending:
        batch = pending[:1] if one_by_one else pending
        attempt += 1
        events_path = scratch / f"events-{attempt}.jsonl"
        env["FREETOKEN_EVAL_REPORT"] = str(events_path)
        cmd = [python, "-m", "pytest", "-p", PLUGIN_MODULE, "-p", "no:cacheprovider", "--rootdir", str(workspace),
               "--continue-on-collection-errors", "-q", "-rfE", *batch]
        # Startup and collection get more time than one test: large repositories import slowly.
        run = run_watched(cmd, workspace, env, log, timeout_s, events_path, first_timeout_s=max(timeout_s, 120.0),
                          sandbox=sandbox)
        new = {e["nodeid"]: e["status"] for e in run.events if e["event"] == "end"}
        reported.update(new)
        broken = {e["nodeid"] for e in run.events if e["event"] == "collect_error"}
        result.notes += [f"collection error in {b or 'session'}" for b in sorted(broken) if b not in noted]
        noted |= broken
        if run.running is not None:
            reported[run.running] = FAILED
            result.timed_out.append(run.running)
        resolved_now = [t for t in batch if _match(t, reported) is not None]
        if not resolved_now and run.returncode is not None and len(batch) > 1 and not one_by_one:
            # pytest ran nothing: a node id in a file that failed to import, or an unknown id, aborts the whole
            # session. Drop the tests of broken files (they stay unreported = failed) and retry the rest; with
            # no broken file to blame, run each test alone.
            unrunnable = [t for t in batch if t.split("::")[0] in broken]
            if unrunnable:
                pending = [t for t in pending if t not in unrunnable]
            else:
                one_by_one = True
            continue
        if run.running is None:
            # The process finished (or hung outside any test): whatever did not report is settled as missing.
            hung = [t for t in batch if t not in resolved_now]
            if run.returncode is None and hung:
                result.notes.append(f"killed after {timeout_s:g}s with no test running (collection hang?)")
                result.timed_out.extend(hung)
            elif not resolved_now:
                result.notes.append(f"pytest exited {run.returncode} without running {batch[0]}")
            pending = [t for t in pending if t not in batch]
        else:
            pending = [t for t in pending if _match(t, reported) is None]
    for t in tests:
        status = _match(t, reported)
        if status is not None:
            result.status[t] = status
    return result


def run_commands(tests: list[str], template: str, workspace: Path, timeout_s: float, log: Path,
                 python: str, extra_env: dict[str, str] | None = None,
                 sandbox: SandboxPolicy | None = None) -> ExecutedTests:
    """Command mode: ``template`` with ``{test}`` (shell-quoted) and ``{python}`` run once per test."""
    result = ExecutedTests()
    env = subprocess_env(extra_env)
    for t in tests:
        cmd = template.replace("{test}", shlex.quote(t)).replace("{python}", shlex.quote(python))
        run = run_watched(["bash", "-c", cmd], workspace, env, log, timeout_s, sandbox=sandbox)
        if run.returncode is None:
            result.timed_out.append(t)
        result.status[t] = PASSED if run.returncode == 0 else FAILED
    return result


def default_python() -> str:
    """The interpreter the harness itself runs under."""
    return sys.executable
