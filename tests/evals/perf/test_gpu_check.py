"""``evals/perf/gpu_check.py --dry-run``: the GPU check script runs end to end on the CPU and prints one JSON report
whose every section is there, CUDA-only fields marked skipped, and the engine's tokens identical on both sides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from freetoken_agent.evals.perf import gpu_check

TOP = {"mode", "passed", "wall_s", "budget_s", "within_budget", "device", "triton", "engine", "plain", "bandwidth",
       "memory", "planner", "residency", "profile"}
ENGINE = {"status", "model", "expert_format", "reference", "candidate", "tf32", "differences", "prompt_tokens",
          "new_tokens", "tokens_match", "first_mismatch", "reference_tokens", "tokens", "decode_tok_s", "prefill_s",
          "expert_bytes", "device_slots", "planner_paths", "device_hit_rate", "host_hit_rate", "stall_s"}
CUDA_ONLY = {"bandwidth": {"h2d_pinned_gbps", "h2d_pageable_gbps", "device_memory_gbps"},
             "memory": {"nvml_total_bytes", "nvml_baseline_used_bytes", "nvml_peak_used_bytes", "nvml_peak_by_section",
                        "nvml_samples", "torch_peak_allocated_bytes", "torch_peak_reserved_bytes"}}


def test_dry_run_prints_one_json_report(tmp_path: Path) -> None:
    env = dict(os.environ, FREETOKEN_CACHE=str(tmp_path))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "freetoken_agent.evals.perf.gpu_check", "--dry-run"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)  # stdout is the report and nothing else
    assert set(r) == TOP and r["mode"] == "dry-run" and r["passed"] is True and r["wall_s"] < 60
    assert r["device"]["name"] == "cpu"

    eng = r["engine"]
    assert set(eng) == ENGINE and eng["status"] == "ran"
    assert eng["tokens_match"] is True and eng["first_mismatch"] is None
    assert eng["tokens"] == eng["reference_tokens"] and len(eng["tokens"]) == eng["new_tokens"]
    assert eng["planner_paths"]["fetch"] > 0 and eng["planner_paths"]["host"] == 0  # the device tier ran the experts
    assert eng["decode_tok_s"]["reference"] > 0 and eng["decode_tok_s"]["candidate"] > 0

    tri = r["triton"]
    if tri["status"] == "ran":  # triton installed: the interpreter checked every kernel
        assert tri["interpret"] is True and tri["passed"] is True
        assert {k["kernel"] for k in tri["kernels"]} == {"triton-dequant-gemm", "triton-grouped-moe",
                                                         "triton-slots", "triton-paged-attention"}
        assert all(k["max_abs_err"] >= 0 and k["rel_err"] <= tri["rel_tol"] for k in tri["kernels"])
    else:
        assert tri["status"] == "skipped" and tri["reason"]

    for section, fields in CUDA_ONLY.items():
        assert r[section]["status"] == "ran"
        assert all(r[section][f] is None for f in fields) and set(r[section]["skipped"]) == fields
    assert r["bandwidth"]["host_copy_gbps"] > 0 and r["memory"]["host_peak_rss_bytes"] > 0

    pl = r["planner"]
    assert pl["status"] == "ran" and pl["copy_gbps_measured"] > 0
    assert set(pl["rates_before"]) == set(pl["rates_after"]) >= {"copy_gbps", "host_gbps_m1", "device_s_fixed"}
    for part in ("decode", "prefill"):
        assert pl[part]["layer_steps"] > 0 and pl[part]["predicted_s"] > 0 and pl[part]["measured_s"] > 0
    n_moe = eng["model"]["layers"]  # every layer of the synthetic model is MoE
    steps = pl["decode"]["layer_steps"]  # every decode step calls each MoE layer once, each call is timed
    assert steps % n_moe == 0 and n_moe * (eng["new_tokens"] - 2) <= steps < n_moe * eng["new_tokens"]

    assert r["residency"] == {"status": "skipped", "reason": "pass --residency to run it"}
    assert r["plain"]["status"] == "skipped" and "CUDA" in r["plain"]["reason"]
    assert r["profile"] == {"status": "skipped", "reason": "pass --profile to run it"}


def test_residency_section_on_the_dry_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--cpu-dry-run", "--residency", "--skip", "triton,engine,bandwidth", "--phase-turns", "0",
                           "--tokens", "4", "--prompt", "12", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["engine"] == {"status": "skipped", "reason": "--skip"}
    assert report["planner"]["status"] == "skipped"
    rows = {r["run"]: r for r in report["residency"]["rows"]}
    assert set(rows) == {"lru", "heat", "lru-fetch", "lru-fetch-torch", "cpu-moe"}
    assert {r["device_kernel"] for r in rows.values()} == {"torch"}  # a simulated (CPU) tier: no Triton slot kernels
    assert rows["cpu-moe"]["planner"]["fetch"] == 0 and rows["cpu-moe"]["planner"]["resident"] == 0
    assert rows["lru-fetch"]["planner"]["host"] == 0
    assert rows["lru"]["planner"]["fetch"] > 0  # prefill chunks send many tokens per expert: fetched
    assert len({tuple(r["tokens"]) for r in rows.values()}) == 1  # same C kernels on every path: same tokens
    assert report["residency"]["over_budget"] == [] and report["passed"] is True


def test_bad_flags_are_one_line_errors() -> None:
    with pytest.raises(SystemExit, match="unknown section 'gpu'"):
        gpu_check.main(["--dry-run", "--skip", "gpu"])
    with pytest.raises(SystemExit, match="--engine-prompt at least 8"):
        gpu_check.main(["--dry-run", "--engine-prompt", "2"])
    with pytest.raises(SystemExit, match="unknown residency run 'lfu'"):
        gpu_check.main(["--dry-run", "--residency", "--runs", "lru,lfu"])


def test_profile_reports_where_the_engine_threads_steps_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``--profile``: cProfile runs on the engine's own thread (a profiler on the caller's thread sees only a wait);
    the engine candidate's top functions are ours and torch's ops, with their calls and own seconds."""
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    assert gpu_check.main(["--dry-run", "--profile", "--skip", "triton,bandwidth"]) == 0
    r = json.loads(capsys.readouterr().out)
    prof = r["profile"]
    assert prof["status"] == "ran" and "plain" not in prof  # the plain run needs CUDA
    rows = prof["engine"]
    assert 0 < len(rows) <= 25 and all(row["calls"] > 0 and row["tottime_s"] >= 0 for row in rows)
    assert [row["tottime_s"] for row in rows] == sorted((row["tottime_s"] for row in rows), reverse=True)
    assert not any("wait" in row["function"] for row in rows[:3])  # the engine thread's work, not a waiting caller
