"""``freetoken generate`` and ``freetoken inspect`` run as real subprocesses on a real checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken_agent.runtime.engine import Engine
from tests.runtime.checkpoints import save_checkpoint

pytest.importorskip("transformers")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "freetoken_agent.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("deepseek")
    save_checkpoint("deepseek_v3", folder)
    return folder


def test_generate_json_equals_api(model_dir: Path) -> None:
    proc = _cli("generate", "--model", str(model_dir), "--prompt-ids", "3,1,4,1,5,9,2,6",
                "--max-new-tokens", "12", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    expected = Engine.from_pretrained(model_dir).generate([3, 1, 4, 1, 5, 9, 2, 6], max_new_tokens=12)
    assert out["token_ids"] == expected.token_ids
    assert out["prompt_ids"] == [3, 1, 4, 1, 5, 9, 2, 6] and out["finish_reason"] == "length"


def test_generate_streams_text_on_synthetic_model(tmp_path: Path) -> None:
    env = {**__import__("os").environ, "FREETOKEN_CACHE": str(tmp_path)}
    proc = _cli("generate", "--model", "synthetic:qwen3_moe", "--prompt", "def f(x):", "--max-new-tokens", "8",
                "--temperature", "0.7", "--seed", "1", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM weights" in proc.stderr and "8 tokens" in proc.stderr
    assert (tmp_path / "synthetic" / "qwen3_moe-v1" / "model.safetensors").is_file()


def test_inspect_reports_layout(model_dir: Path) -> None:
    proc = _cli("inspect", str(model_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["architecture"] == "deepseek_v3"
    assert info["layers"] == 3 and info["moe_layers"] == 2 and info["experts_per_layer"] == 8
    assert info["params_total"] == info["params_dense"] + info["params_experts"]
    # 8 experts × 2 MoE layers, each gate/up/down of 64×32 fp32
    assert info["bytes_per_expert"] == 3 * 64 * 32 * 4
    assert "MLA" in info["attention"] and "groups=4/2" in info["router"]
    table = _cli("inspect", str(model_dir))
    assert table.returncode == 0 and "deepseek_v3" in table.stdout


def test_generate_with_quantized_experts_and_dense_weights_equals_api(model_dir: Path, tmp_path: Path) -> None:
    env = {**__import__("os").environ, "FREETOKEN_CACHE": str(tmp_path)}
    proc = _cli("generate", "--model", str(model_dir), "--prompt-ids", "3,1,4,1,5,9,2,6", "--max-new-tokens", "8",
                "--quant", "q4", "--quant-dense", "q8", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    engine = Engine.from_pretrained(model_dir, quant="q4", dense_quant="q8")
    assert json.loads(proc.stdout)["token_ids"] == engine.generate([3, 1, 4, 1, 5, 9, 2, 6], max_new_tokens=8).token_ids
    bad = _cli("generate", "--model", str(model_dir), "--prompt-ids", "1", "--quant-dense", "q3", env=env)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
