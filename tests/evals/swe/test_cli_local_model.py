"""``freetoken eval`` with ``--agent agent`` on a local model, as a user runs it: a real subprocess, the real
engine (a synthetic random-weight checkpoint, so the score is 0), the real agent loop and tools."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_local_model_agent_runs_the_whole_path(tmp_path: Path) -> None:
    env = {**os.environ, "FREETOKEN_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "freetoken_agent.cli", "eval", "builtin", "--agent", "agent",
         "--model", "synthetic:qwen3_moe", "--tasks", "tail_zero_lines,leap_year", "--max-steps", "2",
         "--max-step-tokens", "8", "--json", "--out", str(out)],
        check=False, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["total"] == 2 and summary["errors"] == 0 and summary["skipped"] == 0
    assert summary["tokens_in"] > 0 and 0 < summary["tokens_out"] <= 2 * 2 * 8
    results = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]
    for r in results:
        assert 1 <= r["turns"] <= 2 and r["engine"]["model_type"] == "qwen3_moe"
        assert r["engine"]["requests"] == r["turns"]  # engine counters are per task (one worker), not cumulative
        assert len(r["engine"]["ttft_s"]) == r["turns"]
        assert (out / "tasks" / r["instance_id"] / "trajectory.jsonl").is_file()
    assert json.loads((out / "run.json").read_text())["model"] == "synthetic:qwen3_moe"
    assert "TTFT s" in (out / "report.md").read_text()
