"""``freetoken doctor`` and ``freetoken generate --host-memory ... --stats/--json`` through the real entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from freetoken_agent.runtime.checkpoint.reader import load_config
from freetoken_agent.runtime.model.adapters import spec_from_config
from freetoken_agent.runtime.model.workspace import step_bytes

from tests.runtime.checkpoints import save_checkpoint


def _cli(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FREETOKEN_CACHE": str(cache), "FREETOKEN_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "freetoken_agent.cli", *args], capture_output=True, text=True,
                          timeout=240, env=env, check=False)


def test_doctor_probes_caches_and_prints_a_table(tmp_path: Path) -> None:
    r = _cli("doctor", "--seconds", "0.1", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "cpu expert M=1" in r.stdout and "disk read" in r.stdout and "GB/s" in r.stdout
    cached = json.loads((tmp_path / "hardware.json").read_text())
    assert cached["bench"]["cpu_expert_gbps_m1"] > 0 and cached["memory"]["total"] > 0
    r = _cli("doctor", "--json", cache=tmp_path)  # from the cache: same numbers, no new measurement
    assert json.loads(r.stdout)["bench"] == cached["bench"]
    bad = _cli("doctor", "--seconds", "-1", cache=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("olmoe")
    save_checkpoint("olmoe", folder, seed=1)
    return folder


def test_generate_under_a_host_budget_matches_and_reports(model: Path, tmp_path: Path) -> None:
    args = ("generate", "--model", str(model), "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "8", "--json")
    plain = json.loads(_cli(*args, cache=tmp_path).stdout)
    host = 3_000_000 + step_bytes(spec_from_config(load_config(model)))  # + a step's working memory
    r = _cli(*args, "--host-memory", f"{host}B", "--residency-policy", "heat", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == plain["token_ids"]
    res = out["stats"]["residency"]
    assert res["policy"] == "heat" and res["tiers"]["host"]["peak"] <= host
    assert res["tiers"]["disk"]["bytes_read"] > 0
    text = _cli("generate", "--model", str(model), "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--stats",
                "--host-memory", f"{host}B", cache=tmp_path)
    assert "hit rate" in text.stderr and "prefetch" in text.stderr
    bad = _cli(*args, "--host-memory", "lots", cache=tmp_path)
    assert bad.returncode == 2 and "cannot read memory size" in bad.stderr and "Traceback" not in bad.stderr
    small = _cli(*args, "--host-memory", "100KB", cache=tmp_path)
    assert small.returncode == 2 and "budget" in small.stderr and "Traceback" not in small.stderr
