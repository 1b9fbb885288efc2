"""The Triton GPU check script runs end to end under TRITON_INTERPRET=1 and reports reference agreement."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton cannot be imported")


def test_bench_triton_interpret_smoke() -> None:
    cmd = [sys.executable, "-m", "freetoken_agent.evals.perf.bench_triton", "--interpret", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert {r["kernel"] for r in rows} == {"triton-dequant-gemm", "triton-grouped-moe", "triton-slots",
                                           "triton-paged-attention"}
    assert all(r["rel_err"] < 3e-3 and r["seconds"] > 0 for r in rows)
    slots = [r for r in rows if r["kernel"] == "triton-slots"]
    assert {r["format"] for r in slots} == {"q4_0", "q4_0-tiles", "q8_0", "q8_0-tiles"}
    assert all(r["rel_err"] < 1e-5 and r["torch_path_seconds"] > 0 for r in slots)
