"""The harness end to end on real git repositories: hung tests, crashing agents, timeouts, resume."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import pytest
from freetoken_agent.evals.swe.agents import AgentOutcome, GoldAgent
from freetoken_agent.evals.swe.harness import HarnessConfig, run_pending
from freetoken_agent.evals.swe.results import RunStore
from freetoken_agent.evals.swe.task import Task, load_tasks

from tests.evals.swe.support import diff, freetoken, make_repo, read_results

FAST = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def calc_task(root: Path, name: str, extra_tests: str = "", **fields: object) -> dict:
    """A repository whose ``add`` subtracts; the gold patch fixes it, the test patch adds ``test_add``."""
    repo = root / name
    base = make_repo(repo, {"calc/__init__.py": "def add(a, b):\n    return a - b\n",
                            "tests/test_calc.py": "def test_ok():\n    assert True\n" + extra_tests})
    fixed = make_repo(repo, {"calc/__init__.py": "def add(a, b):\n    return a + b\n"}, "fix")
    make_repo(repo, {"tests/test_add.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 2) == 4\n"},
              "tests")
    head = make_repo(repo, {"calc/__init__.py": "def add(a, b):\n    return a - b  # upstream reverted\n"}, "later")
    return {"instance_id": name, "repo": str(repo), "base_commit": base, "problem_statement": "add() subtracts",
            "patch": diff(repo, base, fixed), "test_patch": diff(repo, fixed, f"{head}~1"),
            "FAIL_TO_PASS": ["tests/test_add.py::test_add"], "PASS_TO_PASS": ["tests/test_calc.py::test_ok"],
            "env": FAST, **fields}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


HANG = """

def test_hangs():
    import time
    time.sleep(600)


def test_later():
    assert True
"""


def test_hung_test_fails_within_its_timeout_and_the_run_continues(tmp_path: Path) -> None:
    rows = [calc_task(tmp_path, "hangs", HANG, test_timeout_s=2,
                      PASS_TO_PASS=["tests/test_calc.py::test_ok", "tests/test_calc.py::test_hangs",
                                    "tests/test_calc.py::test_later"]),
            calc_task(tmp_path, "fine")]
    start = time.monotonic()
    code, _, _ = freetoken("eval", str(write_jsonl(tmp_path / "t.jsonl", rows)), "--agent", "gold",
                           "--workers", "2", "--out", str(tmp_path / "run"), "--json")
    assert code == 0 and time.monotonic() - start < 40
    res = read_results(tmp_path / "run")
    assert res["fine"]["status"] == "resolved"
    hung = res["hangs"]
    assert hung["status"] == "unresolved" and hung["timed_out_tests"] == ["tests/test_calc.py::test_hangs"]
    assert hung["fail_to_pass"] == {"success": ["tests/test_add.py::test_add"], "failure": []}
    assert hung["pass_to_pass"]["success"] == ["tests/test_calc.py::test_ok", "tests/test_calc.py::test_later"]
    assert "1 timed out" in hung["reason"]


class Crashing:
    """An agent that fails on one task and hangs on another."""

    name = "crashing"

    async def solve(self, task: Task, workspace: Path, log_dir: Path) -> AgentOutcome:
        if task.instance_id == "boom":
            raise RuntimeError("backend exploded")
        if task.instance_id == "slow":
            await anyio.sleep(600)
        return await GoldAgent().solve(task, workspace, log_dir)


def test_agent_crash_and_timeout_are_contained(tmp_path: Path) -> None:
    tasks = load_tasks(write_jsonl(tmp_path / "t.jsonl", [calc_task(tmp_path, "boom"), calc_task(tmp_path, "ok"),
                                                          calc_task(tmp_path, "slow", agent_timeout_s=1)]))
    store = RunStore(tmp_path / "run")
    store.start({"agent": "crashing"}, resume=False)
    results = {r.instance_id: r for r in anyio.run(run_pending, tasks, Crashing(), store, HarnessConfig(workers=3))}
    assert results["boom"].status == "error" and "backend exploded" in results["boom"].reason
    assert results["ok"].status == "resolved"
    # The timed-out agent's (empty) diff is still scored, like any other.
    assert results["slow"].status == "unresolved" and results["slow"].agent_stopped.startswith("agent timed out")
    assert results["slow"].agent_s < 10


class Recording(GoldAgent):
    def __init__(self) -> None:
        self.seen: list[str] = []

    async def solve(self, task: Task, workspace: Path, log_dir: Path) -> AgentOutcome:
        self.seen.append(task.instance_id)
        return await super().solve(task, workspace, log_dir)


def test_resume_reruns_only_missing_tasks(tmp_path: Path) -> None:
    tasks = load_tasks(write_jsonl(tmp_path / "t.jsonl", [calc_task(tmp_path, n) for n in ("a", "b", "c")]))
    meta = {"agent": "gold", "tasks": "t.jsonl", "model": None}
    first = Recording()
    store = RunStore(tmp_path / "run")
    store.start(meta, resume=False)
    anyio.run(run_pending, tasks, first, store, HarnessConfig(workers=3))
    assert sorted(first.seen) == ["a", "b", "c"]
    # Interrupt: keep task a's line, tear b's line in half (a crash mid-write), lose c.
    lines = store.results_path.read_text().splitlines()
    kept = next(ln for ln in lines if json.loads(ln)["instance_id"] == "a")
    torn = next(ln for ln in lines if json.loads(ln)["instance_id"] == "b")[:40]
    store.results_path.write_text(kept + "\n" + torn)
    with pytest.raises(Exception, match="already holds a run"):
        RunStore(tmp_path / "run").start(meta, resume=False)
    with pytest.raises(Exception, match="was run with agent='gold'"):
        RunStore(tmp_path / "run").start({**meta, "agent": "empty"}, resume=True)
    again = Recording()
    store = RunStore(tmp_path / "run")
    assert list(store.start(meta, resume=True)) == ["a"]
    results = anyio.run(run_pending, tasks, again, store, HarnessConfig(workers=3))
    assert sorted(again.seen) == ["b", "c"]
    assert [r.status for r in results] == ["resolved"] * 3
    lines = store.results_path.read_text().splitlines()
    assert len(lines) == 3 and lines[0] == kept


def test_cli_resume_and_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    jsonl = write_jsonl(tmp_path / "t.jsonl", [calc_task(tmp_path, n) for n in ("a", "b")])
    out = tmp_path / "run"
    assert freetoken("eval", str(jsonl), "--agent", "gold", "--out", str(out), capsys=capsys)[0] == 0
    first = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").write_text(first[0] + "\n")
    code, stdout, err = freetoken("eval", str(jsonl), "--agent", "gold", "--out", str(out), "--resume", "--json",
                                  capsys=capsys)
    assert code == 0 and "1 of 2 tasks already have results" in err
    assert err.count("] ") == 1  # one progress line: only the missing task ran
    summary = json.loads(stdout)
    assert summary["resolved"] == summary["total"] == 2
    for argv, message in [
        ((str(jsonl), "--agent", "gold", "--out", str(out)), "already holds a run"),
        ((str(jsonl), "--agent", "empty", "--out", str(out), "--resume"), "was run with agent='gold'"),
        (("nope.jsonl", "--agent", "gold"), "neither a built-in suite"),
        ((str(jsonl), "--agent", "nomodule"), "expected gold, empty, agent, or MODULE:FUNCTION"),
        ((str(jsonl), "--agent", "agent", "--model", "m", "--url", "http://x"), "not both"),
        ((str(jsonl), "--agent", "gold", "--model", "m"), "are for --agent agent"),
        ((str(jsonl), "--workers", "0"), "--workers: must be an integer ≥ 1"),
        (("--compare", str(out), str(tmp_path)), "not a run folder"),
    ]:
        code, _, err = freetoken("eval", *argv, capsys=capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


FACTORY = '''
import json

from freetoken_agent import Agent
from freetoken_agent.backends.scripted import ScriptedBackend


def call(name, arguments):
    return "<tool_call>\\n" + json.dumps({"name": name, "arguments": arguments}) + "\\n</tool_call>"


def make_agent(task, workspace):
    edit = {"path": "calc/__init__.py", "old_string": "a - b", "new_string": "a + b"}
    return Agent.coding(ScriptedBackend([call("edit_file", edit), "done"]), workspace=workspace)
'''


def test_cli_runs_a_user_agent_factory_from_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "my_agent.py").write_text(FACTORY)
    jsonl = write_jsonl(tmp_path / "t.jsonl", [calc_task(tmp_path, "calc")])
    code, out, err = freetoken("eval", str(jsonl), "--agent", f"{tmp_path / 'my_agent.py'}:make_agent", "--json",
                               "--out", str(tmp_path / "run"), capsys=capsys)
    assert code == 0, err
    assert json.loads(out)["resolved"] == 1
    assert read_results(tmp_path / "run")["calc"]["turns"] == 2
    code, _, err = freetoken("eval", str(jsonl), "--agent", f"{tmp_path / 'my_agent.py'}:nope", capsys=capsys)
    assert code == 2 and "has no function 'nope'" in err


SETUP_TEST = """

def test_setup_ran():
    assert open("generated.txt").read() == "from setup\\n"
"""


def test_setup_commands_run_in_both_checkouts_and_never_count_as_changes(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    ok = calc_task(tmp_path, "setup_ok", SETUP_TEST, setup=["echo 'from setup' > generated.txt"],
                   PASS_TO_PASS=["tests/test_calc.py::test_ok", "tests/test_calc.py::test_setup_ran"])
    broken = calc_task(tmp_path, "setup_broken", setup=["echo building; exit 3"])
    jsonl = write_jsonl(tmp_path / "t.jsonl", [ok, broken])
    code, out, _ = freetoken("eval", str(jsonl), "--agent", "gold", "--workers", "2", "--json",
                             "--out", str(tmp_path / "run"), capsys=capsys)
    assert code == 0 and json.loads(out)["resolved"] == 1 and json.loads(out)["skipped"] == 1
    res = read_results(tmp_path / "run")
    assert res["setup_ok"]["status"] == "resolved"
    patch = (tmp_path / "run" / "tasks" / "setup_ok" / "model.patch").read_text()
    assert "calc/__init__.py" in patch and "generated.txt" not in patch
    assert res["setup_broken"]["status"] == "skipped"
    assert res["setup_broken"]["reason"] == "setup command 'echo building; exit 3' exited 3 (see setup.log)"
    assert "building" in (tmp_path / "run" / "tasks" / "setup_broken" / "setup.log").read_text()


ESCAPE = """

def test_contained():
    import os
    try:
        with open(os.environ["OUTSIDE_FILE"], "w") as f:
            f.write("escaped")
        wrote = True
    except OSError:
        wrote = False
    assert not wrote, "the test wrote outside the workspace"
    assert "FT_TEST_SECRET" not in os.environ, "the harness's secret reached the test"
"""


@pytest.mark.parametrize("sandboxed", [True, False])
def test_tests_run_the_agents_code_in_the_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  sandboxed: bool) -> None:
    """The task's tests run code the agent wrote: confined, they can neither write outside the workspace nor read
    the harness's secrets, so ``test_contained`` passes; unconfined (``sandbox=None``) both escapes happen."""
    from freetoken_agent.tools.sandbox import probe

    if sandboxed and not probe().can_sandbox(False):
        pytest.skip("this machine has no sandbox mechanism (Landlock or namespaces)")
    monkeypatch.setenv("FT_TEST_SECRET", "hunter2")
    outside = tmp_path / "outside" / "escaped.txt"
    outside.parent.mkdir()
    row = calc_task(tmp_path, "escape", ESCAPE, env={**FAST, "OUTSIDE_FILE": str(outside)},
                    PASS_TO_PASS=["tests/test_calc.py::test_ok", "tests/test_calc.py::test_contained"])
    store = RunStore(tmp_path / "run")
    store.start({"agent": "gold"}, resume=False)
    config = HarnessConfig() if sandboxed else HarnessConfig(sandbox=None)
    [result] = anyio.run(run_pending, load_tasks(write_jsonl(tmp_path / "t.jsonl", [row])), GoldAgent(), store, config)
    assert result.status == ("resolved" if sandboxed else "unresolved"), result.reason
    assert outside.exists() is not sandboxed
