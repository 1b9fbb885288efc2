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
    assert {r["kernel"] for r in rows} == {"triton-dequant-gemm", "triton-grouped-moe", "triton-paged-attention"}
    assert all(r["rel_err"] < 3e-3 and r["seconds"] > 0 for r in rows)
