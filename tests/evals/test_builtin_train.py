"""Smoke test of the built-in model's training script: a tiny model on synthetic sessions, in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .builtin_sessions import write_session

transformers = pytest.importorskip("transformers")  # the training script is a dev tool

TINY = ["--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--experts", "4", "--top-k", "2",
        "--expert-hidden", "16", "--vocab", "384", "--seq-len", "64", "--batch", "4", "--lr", "1e-2",
        "--warmup", "3", "--stdlib-chars", "20000", "--log-every", "1", "--eval-windows", "4", "--holdout-every", "4"]


def _sessions(folder: Path) -> Path:
    folder.mkdir()
    for i in range(8):
        write_session(folder, f"proj__proj-{i}", turns=[
            (f"THOUGHT: I need to inspect module{i}.py first.", f"cat module{i}.py", f"def f{i}(x):\n    return x + {i}"),
            ("THOUGHT: Now run the tests to see the failure.", "python -m pytest -q", f"1 failed, {i} passed"),
        ])
    return folder


def _log(work: Path) -> list[dict]:
    return [json.loads(line) for line in (work / "loss_log.jsonl").read_text().splitlines()]


def test_training_reduces_loss_resumes_and_exports_a_hf_folder(tmp_path: Path) -> None:
    from freetoken_agent.evals.builtin.train import run

    data, work, out = _sessions(tmp_path / "data"), tmp_path / "work", tmp_path / "out"
    common = ["--data-dir", str(data), "--work-dir", str(work), "--out", str(out), *TINY]
    first = run([*common, "--max-steps", "25"])
    steps = [r for r in _log(work) if "loss" in r]
    assert steps[0]["step"] == 1 and steps[-1]["step"] == 25
    early = sum(r["loss"] for r in steps[:3]) / 3
    late = sum(r["loss"] for r in steps[-3:]) / 3
    assert late < early - 0.5, (early, late)
    assert first["held_out_ppl"] > 1 and first["held_out_tokens_scored"] > 0
    assert {p.name for p in out.iterdir()} == {"config.json", "generation_config.json", "model.safetensors",
                                              "tokenizer.json", "tokenizer_config.json", "training.json"}

    # rerunning with a larger budget continues from the checkpoint instead of starting over
    second = run([*common, "--max-steps", "30"])
    resumed = [r["step"] for r in _log(work) if "loss" in r][len(steps):]
    assert resumed[0] == 26 and second["step"] == 30

    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 4
    assert json.loads((out / "config.json").read_text())["num_experts"] == 4
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<tool_call>") < 384
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert "<tool_call>" in config["chat_template"]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode("<|im_start|><tool_call>", add_special_tokens=False) == [1, tok.convert_tokens_to_ids("<tool_call>")]


def test_missing_data_folder_is_a_clear_error(tmp_path: Path) -> None:
    from freetoken_agent.evals.builtin.train import run

    with pytest.raises(SystemExit, match="does not exist"):
        run(["--data-dir", str(tmp_path / "nope"), "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o")])
