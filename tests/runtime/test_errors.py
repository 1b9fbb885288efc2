"""Bad input gives a specific exception in the API and one clear line (no traceback) at the CLI.

The full matrix (model folder, config values, weights, prompt, sampling, options) is test_bad_input.py and
tests/cli/test_bad_flags.py; these are the checkpoint-tensor and tokenizer cases."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.errors import (
    ConfigError,
    CorruptCheckpointError,
    MissingTensorError,
    PromptError,
    ShapeMismatchError,
    TokenizerError,
    UnexpectedTensorError,
    UnsupportedArchitectureError,
)
from freetoken_agent.runtime.synthetic import write_synthetic

TARGET = "model.layers.1.mlp.experts.3.down_proj.weight"


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    folder = write_synthetic("qwen3_moe", tmp_path / "m", num_hidden_layers=2, hidden_size=64, head_dim=16,
                             num_experts=4, moe_intermediate_size=32, vocab_size=300)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["synthetic"]  # a plain checkpoint: the CLI prints nothing but the error
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _edit(folder: Path, fn) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "freetoken_agent.cli", *args], capture_output=True, text=True,
                          timeout=120)


def _assert_one_line(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0]


def test_missing_tensor(model_dir: Path) -> None:
    _edit(model_dir, lambda t: t.pop(TARGET))
    with pytest.raises(MissingTensorError, match=TARGET.replace(".", r"\.")):
        Engine.from_pretrained(model_dir)
    _assert_one_line(_cli("generate", "--model", str(model_dir), "--prompt-ids", "1,2"), "missing tensor", TARGET)


def test_wrong_shape(model_dir: Path) -> None:
    _edit(model_dir, lambda t: t.__setitem__(TARGET, torch.zeros(64, 31)))
    with pytest.raises(ShapeMismatchError, match=r"\[64, 31\].*\[64, 32\]"):
        Engine.from_pretrained(model_dir)
    _assert_one_line(_cli("generate", "--model", str(model_dir), "--prompt-ids", "1"), "shape", TARGET)


def test_unexpected_tensor(model_dir: Path) -> None:
    _edit(model_dir, lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(2)))
    with pytest.raises(UnexpectedTensorError, match="mystery"):
        Engine.from_pretrained(model_dir)


def test_unknown_architecture_lists_supported(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["model_type"] = "llama_moe_9000"
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="llama_moe_9000.*deepseek_v3.*qwen3_moe"):
        Engine.from_pretrained(model_dir)
    _assert_one_line(_cli("inspect", str(model_dir)), "unsupported architecture", "mixtral")


def test_corrupt_safetensors_header(model_dir: Path) -> None:
    blob = (model_dir / "model.safetensors").read_bytes()
    (model_dir / "model.safetensors").write_bytes(blob[:8] + b"{not json" + blob[17:])
    with pytest.raises(CorruptCheckpointError, match="model.safetensors"):
        Engine.from_pretrained(model_dir)
    (model_dir / "model.safetensors").write_bytes(b"\xff" * 8 + blob[8:64])  # absurd header length
    with pytest.raises(CorruptCheckpointError, match="header"):
        Engine.from_pretrained(model_dir)
    _assert_one_line(_cli("generate", "--model", str(model_dir), "--prompt-ids", "1"), "corrupt")


def test_missing_tokenizer_files(model_dir: Path) -> None:
    (model_dir / "tokenizer.json").unlink()
    engine = Engine.from_pretrained(model_dir)  # ids-only use still works
    assert engine.generate([1, 2, 3], max_new_tokens=2).token_ids
    with pytest.raises(TokenizerError, match="no tokenizer"):
        engine.tokenizer.encode("hi")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Engine.from_pretrained(model_dir, require_tokenizer=True)
    _assert_one_line(_cli("generate", "--model", str(model_dir), "--prompt", "hi"), "tokenizer")


def test_missing_config_and_bad_ids(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        Engine.from_pretrained(tmp_path)
    engine = Engine.from_pretrained(model_dir)
    with pytest.raises(PromptError, match="token id 99999 is outside the vocabulary"):
        engine.generate([1, 99999])
    _assert_one_line(_cli("generate", "--model", str(model_dir), "--prompt-ids", "5,99999"), "outside the vocabulary")
