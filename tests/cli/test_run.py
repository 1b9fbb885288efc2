"""``freetoken run`` and ``freetoken replay``: end to end on a tiny local checkpoint, and against a served model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from freetoken_agent import ScriptedBackend
from freetoken_agent import cli as freetoken_cli
from freetoken_agent.server import serve_in_thread
from tests.sdk.conftest import CALC, TEST_CALC, hermes_call
from tests.sdk.tiny_checkpoint import shared_tiny_qwen3_moe


@pytest.fixture
def freetoken():
    """The ``freetoken`` entry point, in process: ``main(argv) -> exit status``."""
    return freetoken_cli.main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tiny_qwen3_moe(tmp_path_factory)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    (root / "calc.py").write_text(CALC)
    (root / "test_calc.py").write_text(TEST_CALC)
    return root


def test_run_on_a_tiny_local_checkpoint_ends_within_limits(freetoken, tiny: Path, workspace: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    traj = tmp_path / "run.jsonl"
    code = freetoken(["run", "Fix the failing test.", "--model", str(tiny), "--workspace", str(workspace),
                      "--max-steps", "2", "--max-step-tokens", "12", "--max-wall", "120", "--json", "--threads", "1",
                      "--trajectory", str(traj)])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records[0]["type"] == "run_started" and records[-1]["type"] == "run_finished"
    final = records[-1]
    assert final["stop_reason"] in ("done", "max_steps") and code == (0 if final["stop_reason"] == "done" else 1)
    assert 1 <= final["steps"] <= 2 and 0 < final["usage"]["completion_tokens"] <= 24
    assert final["engine_stats"]["phase_hints"]["plan"] >= 1
    assert [r["phase"] for r in records if r["type"] == "phase_changed"][0] == "plan"
    # the trajectory was written and replays
    assert traj.is_file()
    assert freetoken(["replay", str(traj)]) == 0
    out = capsys.readouterr().out
    assert "Fix the failing test." in out and final["stop_reason"] in out


def test_live_view_against_a_served_model_fixes_the_bug(freetoken, workspace: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    model = ScriptedBackend([
        hermes_call("read_file", {"path": "calc.py"}),
        hermes_call("edit_file", {"path": "calc.py", "old_string": "a - b", "new_string": "a + b"}),
        "Fixed add().",
    ])
    with serve_in_thread(model, "scripted") as url:
        code = freetoken(["run", "fix add", "--url", url, "--workspace", str(workspace)])
    out = capsys.readouterr().out
    assert code == 0 and "done" in out and "Fixed add()." in out and "edit_file" in out
    assert (workspace / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["run", "x", "--model", "/nonexistent/model"], "model folder not found: /nonexistent/model"),
    (["run", "x", "--url", "http://127.0.0.1:9/v1", "--workspace", "/nonexistent/ws"], "is not a folder"),
    (["run", "x", "--url", "http://127.0.0.1:9/v1", "--max-steps", "0"],
     "argument --max-steps: must be an integer ≥ 1, got 0"),
    (["replay", "/nonexistent/run.jsonl"], "cannot read trajectory"),
])
def test_bad_input_is_one_line(freetoken, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert freetoken(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_unreachable_server_is_a_clear_error(freetoken, workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert freetoken(["run", "x", "--url", "http://127.0.0.1:9/v1", "--workspace", str(workspace), "--json"]) == 2
    assert "cannot talk to http://127.0.0.1:9/v1" in capsys.readouterr().err


def test_replay_of_a_killed_run(freetoken, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "killed.jsonl"
    path.write_text(json.dumps({"type": "run_started", "task": "t", "tools": []}) + "\n"
                    + json.dumps({"type": "message", "step": 1, "message": {"role": "user", "content": "hi"}})
                    + "\n" + '{"type": "mess')  # the writer died mid-line
    assert freetoken(["replay", str(path)]) == 0
    assert "killed" in capsys.readouterr().out


def test_run_on_the_default_model(freetoken, workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No --model: the built-in model (or its random-weight stand-in) runs the agent within its limits."""
    code = freetoken(["run", "Say hi.", "--workspace", str(workspace), "--max-steps", "1", "--max-step-tokens", "4",
                      "--json", "--threads", "1"])
    final = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert final["type"] == "run_finished" and final["stop_reason"] in ("done", "max_steps")
    assert code == (0 if final["stop_reason"] == "done" else 1)
