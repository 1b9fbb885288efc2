"""Weight averaging of two built-in model exports (``evals/builtin/average.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken_agent.evals.builtin.average import average_folders, main


def _folder(path: Path, tensors: dict[str, torch.Tensor], info: dict | None = None) -> Path:
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    if info is not None:
        (path / "training.json").write_text(json.dumps(info))
    return path


def test_average_is_alpha_tuned_plus_the_rest_base_and_keeps_the_tuned_folder(tmp_path: Path) -> None:
    base = _folder(tmp_path / "base", {"w": torch.zeros(4, 8, dtype=torch.bfloat16), "b": torch.ones(3)})
    tuned = _folder(tmp_path / "tuned", {"w": torch.ones(4, 8, dtype=torch.bfloat16), "b": torch.full((3,), 5.0)},
                    {"step": 300})
    average_folders(base, tuned, 0.75, tmp_path / "out")
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], torch.full((4, 8), 0.75, dtype=torch.bfloat16))
    assert torch.equal(out["b"], torch.full((3,), 4.0))
    assert (tmp_path / "out" / "config.json").read_text() == '{"model_type": "qwen3_moe"}'
    info = json.loads((tmp_path / "out" / "training.json").read_text())
    assert info["step"] == 300 and info["weight_average"]["alpha"] == 0.75


def test_average_refuses_other_architectures_and_bad_alpha(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = _folder(tmp_path / "base", {"w": torch.zeros(4, 8)})
    tuned = _folder(tmp_path / "tuned", {"w": torch.zeros(4, 9)})
    with pytest.raises(SystemExit) as exc:
        main(["--base", str(base), "--tuned", str(tuned), "--alpha", "0.5", "--out", str(tmp_path / "out")])
    assert exc.value.code == 2 and "not the same architecture" in capsys.readouterr().err
    with pytest.raises(ValueError, match="alpha"):
        average_folders(base, base, 1.5, tmp_path / "out")
