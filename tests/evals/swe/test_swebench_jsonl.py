"""A SWE-bench-format JSONL (lists as JSON strings, extra fields, ``owner/name`` repos) runs unchanged."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from freetoken_agent.evals.swe.task import EvalError, load_tasks

from tests.evals.swe.support import freetoken, read_results
from tests.evals.swe.test_harness import calc_task, write_jsonl


def swebench_rows(tmp_path: Path) -> list[dict]:
    repos = tmp_path / "clones"
    row = calc_task(repos, "acme__calc")
    row = {  # the shape of a row of princeton-nlp/SWE-bench on Hugging Face
        "repo": "acme/calc", "instance_id": "acme__calc-1", "base_commit": row["base_commit"], "patch": row["patch"],
        "test_patch": row["test_patch"], "problem_statement": row["problem_statement"], "hints_text": "",
        "created_at": "2024-01-01T00:00:00Z", "version": "1.0", "environment_setup_commit": row["base_commit"],
        "FAIL_TO_PASS": json.dumps(row["FAIL_TO_PASS"]), "PASS_TO_PASS": json.dumps(row["PASS_TO_PASS"]),
    }
    plain = tmp_path / "plain"  # a plain folder (no git) whose tests are shell commands
    plain.mkdir()
    (plain / "check.py").write_text("import sys\nsys.exit(0 if sys.argv[1] in open('status').read() else 1)\n")
    (plain / "status").write_text("old\n")
    command_row = {"instance_id": "plain-1", "repo": "plain", "problem_statement": "status should say new",
                   "patch": "--- a/status\n+++ b/status\n@@ -1 +1 @@\n-old\n+new\n",
                   "FAIL_TO_PASS": ["new"], "PASS_TO_PASS": [], "test_command": "{python} check.py {test}"}
    missing = {**row, "instance_id": "acme__gone-1", "repo": "acme/gone"}
    return [row, command_row, missing]


@pytest.mark.parametrize("agent,resolved", [("gold", 2), ("empty", 0)])
def test_swebench_jsonl_with_git_repository(tmp_path: Path, agent: str, resolved: int,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    jsonl = write_jsonl(tmp_path / "swe.jsonl", swebench_rows(tmp_path))
    code, out, err = freetoken("eval", str(jsonl), "--agent", agent, "--repos", str(tmp_path / "clones"),
                               "--workers", "3", "--json", "--out", str(tmp_path / "run"), capsys=capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["resolved"], summary["total"], summary["skipped"]) == (resolved, 3, 1)
    res = read_results(tmp_path / "run")
    assert res["acme__gone-1"]["status"] == "skipped"
    assert "repository acme/gone is not available locally" in res["acme__gone-1"]["reason"]
    # The clone's HEAD reverts the fix; only a checkout at base_commit makes gold pass and empty fail.
    assert res["acme__calc-1"]["status"] == ("resolved" if agent == "gold" else "unresolved")
    assert res["acme__calc-1"]["pass_to_pass"]["success"] == ["tests/test_calc.py::test_ok"]


def test_missing_clone_folder_is_skipped_not_failed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = swebench_rows(tmp_path)
    shutil.rmtree(tmp_path / "clones")
    jsonl = write_jsonl(tmp_path / "swe.jsonl", rows[:1])
    code, out, _ = freetoken("eval", str(jsonl), "--agent", "gold", "--json", "--out", str(tmp_path / "run"),
                             capsys=capsys)
    assert code == 0
    assert json.loads(out)["skipped"] == 1 and json.loads(out)["resolved_rate"] == 0.0
    assert "--repos DIR" in read_results(tmp_path / "run")["acme__calc-1"]["reason"]


@pytest.mark.parametrize("text,message", [
    ('{"instance_id": "x", "repo": "r"}\n', "bad.jsonl:1: field problem_statement: Field required"),
    ('{"instance_id": "x", "repo": "r", "problem_statement": "p"}\nnot json\n', ":2: not valid JSON"),
    ('{"instance_id": "a/b", "repo": "r", "problem_statement": "p"}\n', "without path separators"),
    ('{"instance_id": "x", "repo": "r", "problem_statement": "p", "FAIL_TO_PASS": "[oops"}\n', "not a JSON list"),
    ('{"instance_id": "x", "repo": "r", "problem_statement": "p"}\n' * 2, "duplicate instance_id 'x'"),
    ("\n", "no tasks"),
])
def test_bad_task_files_are_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(EvalError, match=re.escape(message)):
        load_tasks(path)
