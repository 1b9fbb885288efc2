"""``evals/perf/gpu_check.py --cpu-dry-run``: the GPU check script itself runs end to end on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from freetoken_agent.evals.perf import gpu_check


def test_gpu_check_dry_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--cpu-dry-run", "--tokens", "4", "--prompt", "12", "--out", str(out)]) == 0
    rows = {r["run"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"lru", "heat", "lru-fetch", "cpu-moe"}
    assert rows["cpu-moe"]["planner"]["fetch"] == 0 and rows["cpu-moe"]["planner"]["resident"] == 0
    assert rows["lru-fetch"]["planner"]["host"] == 0
    assert rows["lru"]["planner"]["fetch"] > 0  # prefill chunks send many tokens per expert: fetched
    assert len({tuple(r["tokens"]) for r in rows.values()}) == 1  # same C kernels on every path: same tokens
    assert "budgets respected: yes" in capsys.readouterr().out
