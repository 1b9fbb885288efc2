"""``freetoken replay`` on trajectory files left by crashes: torn lines are one warning line each on stderr, the
transcript shows both runs; corruption inside a run is a one-line error."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from freetoken_agent import Agent, ScriptedBackend
from freetoken_agent import cli as freetoken_cli
from tests.sdk.conftest import CALC, hermes_call


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    (root / "calc.py").write_text(CALC)
    return root


def test_replay_shows_a_killed_run_and_the_run_appended_after_it(repo: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    script = [hermes_call("read_file", {"path": "calc.py"}), "first done"]
    anyio.run(Agent.coding(ScriptedBackend(script), workspace=repo, trajectory=path).run, "first task")
    data = path.read_bytes()
    path.write_bytes(data[: data.rindex(b'"type": "run_finished"')])  # killed while writing run_finished
    torn_line = data.count(b"\n")
    anyio.run(Agent.coding(ScriptedBackend(["second done"]), workspace=repo, trajectory=path).run, "second task")
    assert freetoken_cli.main(["replay", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == f"warning: {path}:{torn_line}: skipped a torn line (a writer was killed mid-record)"
    assert out.index("first task") < out.index("first done") < out.index("the run above ends without run_finished")
    assert out.index("the run above") < out.index("second task") < out.index("second done")
    assert "the run was killed" not in out  # the file ends with the second run's run_finished


def test_replay_of_a_file_corrupt_inside_a_run_is_one_line(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"type": "run_started", "task": "x"}\n{"type": "mess\n{"type": "run_finished"}\n')
    assert freetoken_cli.main(["replay", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"freetoken replay: error: {path}:2: not a JSON line") and len(err.splitlines()) == 1
