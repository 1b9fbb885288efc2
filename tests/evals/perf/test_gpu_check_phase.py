"""The GPU check's phase-aware run (``phase_gpu``) in its CPU dry-run mode: a synthetic agent session through a
simulated device tier in front of a host tier at 40% of the expert bytes, phase scheduling vs LRU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from freetoken_agent.evals.perf import gpu_check, phase_gpu


def test_phase_run_on_the_cpu_dry_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    torch.set_num_threads(1)
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--cpu-dry-run", "--residency", "--skip", "triton,engine,bandwidth", "--runs", "lru",
                           "--tokens", "2", "--prompt", "8", "--phase-turns", "8", "--out", str(out)]) == 0
    phase = json.loads(out.read_text())["residency"]["phase"]
    rows = {r["run"]: r for r in phase["rows"]}
    assert set(rows) == set(phase_gpu.ROWS)
    for r in rows.values():
        assert r["switches"] == {"plan": 5, "code": 5}  # 8 turns, 3 of them warm-up: only the counted ones
        assert r["switch_total"] == sum(r["switch_misses"].values()) and 0 < r["switch_total"] <= r["host_misses"]
        assert all(r["peak"][t] <= r["limits"][t] for t in ("host", "device"))
    assert rows["agent-lru"]["staged"] == {} and sum(rows["agent-phase"]["staged"].values()) > 0
    assert isinstance(phase["phase_switch_miss_reduction"], float)
    printed = json.loads(capsys.readouterr().out)  # the report, as JSON, on stdout
    assert printed["residency"]["phase"]["rows"][1]["run"] == "agent-phase" and printed["passed"] is True


def test_phase_flags_are_checked() -> None:
    with pytest.raises(SystemExit, match="--phase-warm must be smaller"):
        gpu_check.main(["--cpu-dry-run", "--runs", "lru", "--tokens", "1", "--prompt", "4", "--phase-turns", "2",
                        "--phase-warm", "2"])
