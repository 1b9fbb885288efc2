"""The CLI on a GGUF file: ``freetoken inspect`` describes it, ``freetoken generate --model FILE.gguf`` runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from freetoken_agent.runtime.builtin import builtin_model_dir

from tests.runtime.checkpoints import save_checkpoint
from tests.runtime.gguf.writer import write_gguf


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "freetoken_agent.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_inspect_gguf(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    save_checkpoint("qwen3_moe", folder, seed=6, hidden_size=256, moe_intermediate_size=256, head_dim=64)
    file = write_gguf(folder, tmp_path / "m.gguf", experts="Q4_K", down="Q5_0", dense="Q8_0")
    proc = _cli("inspect", str(file), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["architecture"] == "qwen3_moe" and info["format"].endswith("llama.cpp architecture qwen3moe)")
    assert info["tensor_formats"]["experts gate"] == "Q4_K×3" and info["tensor_formats"]["experts down"] == "Q5_0×3"
    assert info["tensor_formats"]["attention"] == "Q8_0×12"
    conv = "\n".join(info["expert_conversion"])
    assert "gate: Q4_K → Q4_K as stored" in conv and "down: Q5_0 → Q8_0 requantized, relative RMS error" in conv
    assert "run as Q4_K+Q8_0" in info["plan"]
    table = _cli("inspect", str(file))
    assert table.returncode == 0 and "tensor formats" in table.stdout


@pytest.mark.parametrize(("experts", "down"), [("Q5_K", "Q6_K"), ("MXFP4", "MXFP4")])  # a Q5_K_M file's; GPT-OSS's
def test_inspect_shows_native_blocks_as_stored(experts: str, down: str, tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    save_checkpoint("qwen3_moe", folder, seed=6, hidden_size=256, moe_intermediate_size=256, head_dim=64)
    file = write_gguf(folder, tmp_path / "m.gguf", experts=experts, down=down)
    proc = _cli("inspect", str(file), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["tensor_formats"]["experts gate"] == f"{experts}×3"
    assert info["tensor_formats"]["experts down"] == f"{down}×3"
    conv = "\n".join(info["expert_conversion"])
    assert f"gate: {experts} → {experts} as stored" in conv and f"down: {down} → {down} as stored" in conv
    assert "requantized" not in conv
    assert f"run as {experts if experts == down else experts + '+' + down}" in info["plan"]


@pytest.mark.parametrize("kind", ["Q4_0"])
def test_generate_from_gguf(kind: str, tmp_path: Path) -> None:
    src = builtin_model_dir()
    file = write_gguf(src, tmp_path / "b.gguf", experts=kind, tokenizer=src)
    proc = _cli("generate", "--model", str(file), "--prompt", "def add(a, b):", "--max-new-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["token_ids"]) == 8 and out["text"]
