"""``freetoken eval --agent agent`` as a user runs it: a real subprocess, the real engine (a synthetic
random-weight checkpoint, so the score is 0), the real agent loop and tools — in process, or behind a real
``freetoken serve`` HTTP server reached with ``--url``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CLI = [sys.executable, "-m", "freetoken_agent.cli"]


def test_local_model_agent_runs_the_whole_path(tmp_path: Path) -> None:
    env = {**os.environ, "FREETOKEN_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "run"
    proc = subprocess.run(
        [*CLI, "eval", "builtin", "--agent", "agent",
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


def test_remote_agent_through_an_openai_compatible_server(tmp_path: Path) -> None:
    env = {**os.environ, "FREETOKEN_CACHE": str(tmp_path / "cache")}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([*CLI, "serve", "--model", "synthetic:qwen3_moe", "--port", str(port), "--threads", "1"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "freetoken serve did not start"
            time.sleep(0.2)
        out = tmp_path / "run"
        proc = subprocess.run([*CLI, "eval", "builtin", "--agent", "agent", "--url", url, "--tasks", "tail_zero_lines",
                               "--max-steps", "2", "--max-step-tokens", "8", "--json", "--out", str(out)],
                              check=False, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr
        summary = json.loads(proc.stdout)
        assert summary["total"] == 1 and summary["errors"] == 0 and summary["tokens_out"] > 0
        [result] = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]
        assert 1 <= result["turns"] <= 2 and len(result["engine"]["ttft_s"]) == result["turns"]
        assert json.loads((out / "run.json").read_text())["model"] == url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
