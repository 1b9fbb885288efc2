"""``freetoken bench kernels`` through the real entry point (tiny shapes, small working set)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from freetoken_agent.runtime.kernels import build

CLI = [sys.executable, "-m", "freetoken_agent.cli"]


@pytest.mark.skipif(build.load() is None, reason="C kernels unavailable (no compiler)")
def test_bench_kernels_json_schema() -> None:
    cmd = CLI + ["bench", "kernels", "--json", "--no-record", "--threads", "1", "--shapes", "64x256", "--m", "1,16",
                 "--working-set-mb", "2", "--no-moe-layer"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["memory_read_gbps"] > 0
    rows = report["results"]
    kernels = {(r["kernel"], r["format"], r["M"]) for r in rows}
    assert {("freetoken-c", "q4", 1), ("freetoken-c", "q8", 1), ("torch-linear", "fp32", 1)} <= kernels
    assert ("freetoken-dequant-mm", "q4", 16) in kernels
    for r in rows:
        assert set(r) >= {"kernel", "format", "shape", "M", "threads", "gbps", "seconds"}
        assert r["shape"] == "64x256" and r["threads"] == 1 and r["gbps"] > 0 and r["seconds"] > 0
    peer = [r for r in rows if r["kernel"].startswith("ggml")]
    ggml_note = [n for n in report["notes"] if n.startswith("ggml")]
    assert ggml_note and (peer or "not installed" in ggml_note[0] or "cannot" in ggml_note[0])


def test_bench_errors_are_one_line() -> None:
    for args, msg in ((["bench"], "freetoken bench list"), (["bench", "kernels", "--shapes", "64by2"], "NxK")):
        proc = subprocess.run(CLI + args, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and msg in proc.stderr and "Traceback" not in proc.stderr
