"""The built-in suite through the real CLI: gold resolves every task, empty resolves none (and every task's
FAIL_TO_PASS tests really fail at the base commit while its PASS_TO_PASS tests pass), reports, comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from freetoken_agent.evals.suites import suite_tasks
from freetoken_agent.evals.swe.gitops import patch_files
from freetoken_agent.evals.swe.task import load_tasks

from tests.evals.swe.support import freetoken, read_results

KINDS = {"off-by-one", "wrong-condition", "missing-case", "wrong-api", "multi-file"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Gold and empty runs over the whole suite, each through ``freetoken eval builtin --json``."""
    base = tmp_path_factory.mktemp("runs")
    out: dict[str, Path] = {}
    for agent in ("gold", "empty"):
        out[agent] = base / agent
        code, _, _ = freetoken("eval", "builtin", "--agent", agent, "--workers", "4", "--json", "--out", str(out[agent]))
        assert code == 0
    return out


def test_suite_shape(runs: dict[str, Path]) -> None:
    specs = suite_tasks("builtin")
    assert len(specs) >= 20
    assert {s.kind for s in specs} == KINDS
    assert len({s.name for s in specs}) == len(specs)
    tasks = load_tasks(runs["gold"] / "suite" / "builtin.jsonl")
    again = load_tasks(runs["empty"] / "suite" / "builtin.jsonl")
    # Fixed author and dates: the base commits are the same on every machine and every build.
    assert len(tasks) == len(specs) and [t.base_commit for t in tasks] == [t.base_commit for t in again]
    multi = [t for t in tasks if t.kind == "multi-file"]
    assert len(multi) >= 4 and all(len(patch_files(t.patch)) >= 2 for t in multi)
    for t in tasks:
        assert t.FAIL_TO_PASS and t.PASS_TO_PASS and t.patch and t.test_patch
        # The gold patch never touches tests, and the test patch only touches tests.
        assert not any(f.startswith("tests/") for f in patch_files(t.patch))
        assert all(f.startswith("tests/") for f in patch_files(t.test_patch))


def test_gold_resolves_every_task(runs: dict[str, Path]) -> None:
    results = read_results(runs["gold"])
    assert len(results) == len(suite_tasks("builtin"))
    assert {r["status"] for r in results.values()} == {"resolved"}, \
        {i: r["reason"] for i, r in results.items() if r["status"] != "resolved"}
    report = json.loads((runs["gold"] / "report.json").read_text())
    assert report["summary"]["resolved"] == report["summary"]["total"] == len(results)
    assert report["summary"]["resolved_rate"] == 1.0
    md = (runs["gold"] / "report.md").read_text()
    assert all(f"| {i} | resolved |" in md for i in results)
    preds = [json.loads(ln) for ln in (runs["gold"] / "predictions.jsonl").read_text().splitlines()]
    assert {p["instance_id"] for p in preds} == set(results) and all(p["model_patch"] for p in preds)


def test_empty_resolves_nothing_and_the_suite_is_valid(runs: dict[str, Path]) -> None:
    results = read_results(runs["empty"])
    tasks = {t.instance_id: t for t in load_tasks(runs["empty"] / "suite" / "builtin.jsonl")}
    assert len(results) == len(tasks)
    for i, r in results.items():
        assert r["status"] == "unresolved" and r["reason"] == "empty patch"
        # At the base commit every FAIL_TO_PASS test fails and every PASS_TO_PASS test passes.
        assert sorted(r["fail_to_pass"]["failure"]) == sorted(tasks[i].FAIL_TO_PASS), i
        assert sorted(r["pass_to_pass"]["success"]) == sorted(tasks[i].PASS_TO_PASS), i


def test_compare_two_runs(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    code, out, _ = freetoken("eval", "--compare", str(runs["gold"]), str(runs["empty"]), "--json", capsys=capsys)
    assert code == 0
    cmp = json.loads(out)
    n = len(suite_tasks("builtin"))
    assert len(cmp["only_a"]) == n and cmp["only_b"] == [] and cmp["both"] == []
    assert cmp["a"]["summary"]["resolved"] == n and cmp["b"]["summary"]["resolved"] == 0
    code, out, _ = freetoken("eval", "--compare", str(runs["gold"]), str(runs["empty"]), "--out",
                             str(runs["gold"].parent / "cmp"), capsys=capsys)
    assert code == 0 and "only A: " + str(n) in out
    md = (runs["gold"].parent / "cmp" / "compare.md").read_text()
    assert f"only A: {n}" in md and md.count("| resolved | ") == n and md.count("| unresolved | ") == n
