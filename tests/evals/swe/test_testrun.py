"""The per-test runner on a real pytest project: statuses, collection errors, unknown ids, hung tests."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

from freetoken_agent.evals.swe.grading import is_resolved, split
from freetoken_agent.evals.swe.testrun import default_python, run_commands, run_pytest

FAST = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}

MIX = """
    import pytest


    @pytest.fixture
    def broken():
        raise RuntimeError("fixture fails")


    def test_pass():
        pass


    def test_fail():
        assert False


    def test_error(broken):
        pass


    def test_skip():
        pytest.skip("not here")


    @pytest.mark.xfail(reason="known")
    def test_xfail():
        assert False


    @pytest.mark.parametrize("n", [1, 2])
    def test_param(n):
        assert n == 1
"""


def _project(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def test_statuses_and_collection_errors(tmp_path: Path) -> None:
    ws = _project(tmp_path / "ws", {"tests/test_mix.py": MIX, "tests/test_broken.py": "import does_not_exist\n\n"
                                    "def test_never():\n    pass\n"})
    ids = ["tests/test_mix.py::" + n for n in ("test_pass", "test_fail", "test_error", "test_skip", "test_xfail",
                                               "test_param[1]", "test_param[2]")]
    ids += ["tests/test_broken.py::test_never", "tests/test_mix.py::test_param"]
    run = run_pytest(ids, ws, default_python(), 20, tmp_path / "log", tmp_path / "scratch", FAST)
    name = {i.split("::")[-1]: run.status.get(i) for i in ids}
    assert name == {"test_pass": "PASSED", "test_fail": "FAILED", "test_error": "ERROR", "test_skip": "SKIPPED",
                    "test_xfail": "XFAIL", "test_param[1]": "PASSED", "test_param[2]": "FAILED",
                    "test_never": None, "test_param": "FAILED"}  # a parent id aggregates its children
    assert any("test_broken.py" in note for note in run.notes)
    assert not list(ws.rglob("__pycache__"))  # tests leave no bytecode in the workspace
    # SWE-bench's rule: skipped counts neither way, a missing test fails, xfail passes.
    f2p = split(["tests/test_mix.py::test_xfail", "tests/test_mix.py::test_skip"], run.status)
    assert f2p.success == ["tests/test_mix.py::test_xfail"] and f2p.failure == [] and f2p.rate == 1.0
    p2p = split(["tests/test_broken.py::test_never"], run.status)
    assert p2p.failure == ["tests/test_broken.py::test_never"] and not is_resolved(f2p, p2p)
    assert is_resolved(split([], {}), split([], {}))


def test_unknown_id_does_not_sink_the_others(tmp_path: Path) -> None:
    ws = _project(tmp_path / "ws", {"tests/test_mix.py": MIX})
    ids = ["tests/test_mix.py::test_pass", "tests/test_mix.py::test_gone", "tests/test_mix.py::test_fail"]
    run = run_pytest(ids, ws, default_python(), 20, tmp_path / "log", tmp_path / "scratch", FAST)
    # pytest refuses the whole session for an unknown node id; the runner falls back to one test at a time.
    assert run.status == {"tests/test_mix.py::test_pass": "PASSED", "tests/test_mix.py::test_fail": "FAILED"}


def test_hung_test_is_killed_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    ws = _project(tmp_path / "ws", {"tests/test_hang.py": f"""
        import subprocess, sys, time


        def test_before():
            pass


        def test_hangs():
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            open({str(pid_file)!r}, "w").write(str(child.pid))
            time.sleep(600)


        def test_after():
            pass
    """})
    ids = [f"tests/test_hang.py::{n}" for n in ("test_before", "test_hangs", "test_after")]
    start = time.monotonic()
    run = run_pytest(ids, ws, default_python(), 2.0, tmp_path / "log", tmp_path / "scratch", FAST)
    assert time.monotonic() - start < 20
    assert run.timed_out == ["tests/test_hang.py::test_hangs"]
    assert run.status == {ids[0]: "PASSED", ids[1]: "FAILED", ids[2]: "PASSED"}  # the rest ran again
    _assert_dead(int(pid_file.read_text()))


def test_command_mode(tmp_path: Path) -> None:
    ws = _project(tmp_path / "ws", {"check.py": "import sys, time\nif sys.argv[1] == 'slow': time.sleep(60)\n"
                                    "sys.exit(0 if sys.argv[1] == 'good' else 1)\n"})
    run = run_commands(["good", "bad", "slow"], "{python} check.py {test}", ws, 2.0, tmp_path / "log",
                       default_python())
    assert run.status == {"good": "PASSED", "bad": "FAILED", "slow": "FAILED"} and run.timed_out == ["slow"]


def _assert_dead(pid: int) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        state = Path(f"/proc/{pid}/status")
        if state.exists() and "\nState:\tZ" in state.read_text():
            return  # killed; only its process-table entry waits for the reaper
        time.sleep(0.05)
    raise AssertionError(f"child process {pid} survived the kill")
