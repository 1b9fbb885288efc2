"""``bench_overhead``: the time split on a real (tiny, synthetic) engine, the callgrind file parser on a real format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken_agent.evals.perf.bench_overhead import classify, parse_callgrind
from freetoken_agent.runtime.kernels import build, ops
from freetoken_agent.runtime.synthetic import write_synthetic

CALLGRIND = """# callgrind format
version: 1
creator: callgrind-3.22.0
events: Ir
ob=(1) /cache/kernels/ft_kernels-0123.so
fl=(1) ft_dense.h
fn=(1) gemv_item
10 500
12 250
ob=(2) /usr/lib/libpython3.11.so.1.0
fl=(2) ceval.c
fn=(2) _PyEval_EvalFrameDefault
5 300
cob=(1)
cfi=(1)
cfn=(1)
calls=3 10
5 750
+1 40
fn=(3) ???
* 7
ob=(3) ???
fn=(4) 0x000000001234
0 90
"""


def test_parse_callgrind_sums_self_costs_and_skips_inclusive_call_costs(tmp_path: Path) -> None:
    path = tmp_path / "cg.out"
    path.write_text(CALLGRIND)
    costs = parse_callgrind(path)
    kernels = ("/cache/kernels/ft_kernels-0123.so", "gemv_item")
    python = ("/usr/lib/libpython3.11.so.1.0", "_PyEval_EvalFrameDefault")
    assert costs[kernels] == 750  # the call's 750 is inclusive cost of gemv_item, already counted as its own
    assert costs[python] == 340
    assert costs[("/usr/lib/libpython3.11.so.1.0", "???")] == 7
    assert costs[("???", "0x000000001234")] == 90
    assert classify(*kernels) == "kernels" and classify(*python) == "outside"
    assert classify("/usr/lib/libtorch_cpu.so", "mkl_blas_avx2_sgemm_kernel") == "blas"
    assert classify("???", "0x000000001234") == "blas"  # JIT code (oneDNN's GEMMs); Python 3.11 has no JIT


@pytest.mark.skipif(build.load() is None, reason="C kernels unavailable (no compiler)")
def test_time_mode_splits_a_real_decode(tmp_path: Path) -> None:
    folder = write_synthetic("qwen3_moe", tmp_path / "m", seed=1)
    cmd = [sys.executable, "-m", "freetoken_agent.evals.perf.bench_overhead", "--model", str(folder), "--quant",
           "q4", "--tokens", "4", "--rounds", "1", "--threads", "1", "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (r,) = json.loads(proc.stdout)
    assert r["layers"] == 4 and r["ms_per_token"] > 0 and r["ms_in_kernels"] > 0
    # a decode step calls the kernels for its layers (all 4 in one fused call: model/fused.py's FusedStep.layers)
    # and for the final norm and the lm_head
    assert r["timed_calls_per_token"] >= 1 + 1
    parts = r["ms_in_kernels"] + r["ms_in_torch_ops"] + r["ms_outside"]
    assert parts == pytest.approx(r["ms_per_token"], abs=0.01)
    assert r["ms_outside"] == pytest.approx(r["ms_outside_in_forward"] + r["ms_outside_in_step"]
                                            + r["ms_outside_steps"], abs=0.01)


@pytest.mark.skipif(build.load() is None, reason="C kernels unavailable (no compiler)")
def test_timed_kernels_counts_calls_and_restores_the_library() -> None:
    import torch

    before = ops.fast()
    with ops.timed_kernels() as clock:
        ops.rms_norm(torch.randn(3, 64), torch.ones(64), 1e-6)
        ops.rms_norm(torch.randn(3, 64), torch.ones(64), 1e-6)
    assert clock.calls == {"ft_rms_norm": 2} and clock.total > 0
    assert ops.fast() is before
