"""Bad input at the ``freetoken`` command line, run as real subprocesses: exit status 2, exactly one line on stderr
naming the cause, no traceback. Flag values are refused before any model loads; bad models and prompts after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken_agent.runtime.synthetic import write_synthetic


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "freetoken_agent.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def _assert_one_line(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


FLAG_CASES: list[tuple[list[str], str]] = [
    (["generate", "--temperature", "nan"], "argument --temperature: must be a finite number ≥ 0, got nan"),
    (["generate", "--temperature", "inf"], "argument --temperature: must be a finite number ≥ 0, got inf"),
    (["generate", "--temperature", "-1"], "argument --temperature: must be a finite number ≥ 0, got -1"),
    (["generate", "--temperature", "warm"], "argument --temperature: must be a finite number ≥ 0, got 'warm'"),
    (["generate", "--top-p", "0"], "argument --top-p: must be a finite number in (0, 1], got 0"),
    (["generate", "--top-p", "1.01"], "argument --top-p:"),
    (["generate", "--top-k", "-1"], "argument --top-k: must be an integer ≥ 0, got -1"),
    (["generate", "--max-new-tokens", "-1"], "argument --max-new-tokens: must be an integer ≥ 0, got -1"),
    (["generate", "--max-new-tokens", "2.5"], "argument --max-new-tokens: must be an integer ≥ 0, got '2.5'"),
    (["generate", "--threads", "0"], "argument --threads: must be an integer ≥ 1, got 0"),
    (["generate", "--seed", str(2**70)], "argument --seed: must be an integer in"),
    (["generate", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["generate", "--prompt", "a", "--prompt-ids", "1"], "not allowed with argument"),
    (["generate", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["run", "task", "--max-steps", "0"], "argument --max-steps: must be an integer ≥ 1, got 0"),
    (["run", "task", "--max-wall", "-3"], "argument --max-wall: must be a finite number > 0, got -3"),
    (["run", "task", "--temperature", "nan"], "argument --temperature: must be a finite number ≥ 0, got nan"),
    (["serve", "--port", "70000"], "argument --port: must be an integer in [0, 65535], got 70000"),
    (["serve", "--default-max-tokens", "0"], "argument --default-max-tokens: must be an integer ≥ 1, got 0"),
    (["acp", "--tool-timeout", "nan"], "argument --tool-timeout: must be a finite number > 0, got nan"),
    (["eval", "--workers", "0"], "argument --workers: must be an integer ≥ 1, got 0"),
    (["plan", "--context", "-8"], "argument --context: must be an integer ≥ 1, got -8"),
    (["doctor", "--seconds", "0"], "argument --seconds: must be a finite number > 0, got 0"),
    (["no-such-command"], "invalid choice: 'no-such-command'"),
]


@pytest.mark.parametrize("args, needle", FLAG_CASES, ids=[" ".join(a) for a, _ in FLAG_CASES])
def test_bad_flag_is_one_line(args: list[str], needle: str) -> None:
    _assert_one_line(_cli(*args), needle)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_synthetic("qwen3_moe", tmp_path_factory.mktemp("cli") / "m", num_hidden_layers=2, hidden_size=64,
                             head_dim=16, num_experts=4, moe_intermediate_size=32, vocab_size=300,
                             max_position_embeddings=32)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["synthetic"]  # a plain checkpoint: the CLI prints nothing but the error
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _copy(model_dir: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(model_dir, tmp_path / "m"))


@pytest.mark.parametrize("ids, needle", [("1,-3", "token id -3 is outside the vocabulary"),
                                         (f"1,{2**70}", f"token id {2**70} is outside the vocabulary"),
                                         (",".join(["1"] * 33),
                                          "the prompt has 33 tokens but the model's context is 32"),
                                         ("1,x", "--prompt-ids must be comma-separated integers")])
def test_bad_prompt_ids(model_dir: Path, ids: str, needle: str) -> None:
    _assert_one_line(_cli("generate", "--model", str(model_dir), f"--prompt-ids={ids}"), needle)


def test_config_json_a_list(model_dir: Path, tmp_path: Path) -> None:
    folder = _copy(model_dir, tmp_path)
    (folder / "config.json").write_text("[]")
    _assert_one_line(_cli("inspect", str(folder)), "config.json must hold a JSON object, got a JSON list")


def test_bad_config_value(model_dir: Path, tmp_path: Path) -> None:
    folder = _copy(model_dir, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 9}))
    _assert_one_line(_cli("generate", "--model", str(folder), "--prompt-ids", "1"),
                     "num_experts_per_tok (9) must not exceed the number of experts (num_experts = 4)")


def test_nan_weight(model_dir: Path, tmp_path: Path) -> None:
    folder = _copy(model_dir, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"][5] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"))
    _assert_one_line(_cli("generate", "--model", str(folder), "--prompt-ids", "1"),
                     "tensor 'model.norm.weight' holds 1 NaN")
    # trusted: the check is off, and the NaN that reaches the logits is still one line, not garbage tokens
    trusted = {"FREETOKEN_CHECK_WEIGHTS": "0"}
    _assert_one_line(_cli("generate", "--model", str(folder), "--prompt-ids", "1", env=trusted), "NaN logits")


def test_no_weights_file(model_dir: Path, tmp_path: Path) -> None:
    folder = _copy(model_dir, tmp_path)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    _assert_one_line(_cli("generate", "--model", str(folder), "--prompt-ids", "1"),
                     "no model.safetensors or model.safetensors.index.json", "model-00001-of-00001.safetensors")


def test_integer_norm_weight(model_dir: Path, tmp_path: Path) -> None:
    folder = _copy(model_dir, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int16)
    save_file(tensors, str(folder / "model.safetensors"))
    _assert_one_line(_cli("generate", "--model", str(folder), "--prompt-ids", "1"),
                     "'model.norm.weight' is stored as int16")


def test_bad_threads_env(model_dir: Path) -> None:
    _assert_one_line(_cli("generate", "--model", str(model_dir), "--prompt-ids", "1", env={"FREETOKEN_THREADS": "0"}),
                     "FREETOKEN_THREADS must be an integer ≥ 1, got 0")


def test_unknown_device(model_dir: Path, tmp_path: Path) -> None:
    _assert_one_line(_cli("run", "task", "--model", str(model_dir), "--workspace", str(tmp_path), "--device", "tpu9"),
                     "unknown device 'tpu9'")


def test_missing_model_folder(tmp_path: Path) -> None:
    _assert_one_line(_cli("generate", "--model", str(tmp_path / "absent"), "--prompt-ids", "1"),
                     "model folder not found")
