"""Engine-level quantization: ``Engine.from_pretrained(..., quant="q8"|"q4")`` on a tiny synthetic MoE checkpoint.

The default expert mode (``auto``) against the dequantized reference: exact mode (every expert through dequantize +
fp32 ``torch.mm``) equals an engine holding the dequantized weights in plain ``TorchExperts`` to <= 1e-3; with the
decode kernels (int8 activations) the logits are no worse than the dequantized reference against fp32 — KL within
1.5x + 0.01, top-1 agreement within 10 points; q8 agrees with fp32 on >= 85% of top-1 tokens. The documented
thresholds and the per-layer match to the int8-activation reference are in ``test_engine_reference.py``.
The checkpoint is random (He init, projections scaled by 0.5 so a 4-layer random net is not chaotic).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.experts.core import set_expert_mode
from freetoken_agent.runtime.kernels import build
from freetoken_agent.runtime.kernels.reference import dequantized_reference
from freetoken_agent.runtime.synthetic import write_synthetic


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_synthetic("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "qwen3_moe", seed=1)
    tensors = load_file(str(folder / "model.safetensors"))
    for name in tensors:
        if "experts" in name or "proj" in name:
            tensors[name] = tensors[name] * 0.5
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 1024, (48,), generator=torch.Generator().manual_seed(3)).tolist()


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    return float(F.kl_div(q_logits.log_softmax(-1), p_logits.log_softmax(-1), log_target=True, reduction="batchmean"))


@pytest.mark.parametrize("quant", ["q8", "q4"])
def test_quantized_engine_matches_dequantized_reference(model_dir: Path, prompt: list[int], quant: str) -> None:
    engine = Engine.from_pretrained(model_dir, quant=quant)
    report = engine.quant
    assert report.layers == 4 and report.quant_bytes < report.float_bytes / (3.5 if quant == "q8" else 6.5)
    reference = Engine.from_pretrained(model_dir, quant=quant)
    dequantized_reference(reference.decoder)
    ref = reference.logits(prompt)
    set_expert_mode(engine.decoder, "exact")
    assert float((engine.logits(prompt) - ref).abs().max()) <= 1e-3
    if not report.kernels:
        pytest.skip(f"C kernels unavailable: {build.status().reason}")
    set_expert_mode(engine.decoder, "auto")
    for backend in engine.decoder.experts:  # fused int8-activation kernels below 32 tokens per expert
        backend.dequant_threshold = 32
    fused = engine.logits(prompt)
    fp32 = Engine.from_pretrained(model_dir).logits(prompt)
    agree_fused = float((fused.argmax(-1) == fp32.argmax(-1)).float().mean())
    agree_ref = float((ref.argmax(-1) == fp32.argmax(-1)).float().mean())
    assert _kl(fp32, fused) <= 1.5 * _kl(fp32, ref) + 0.01
    assert agree_fused >= agree_ref - 0.10
    if quant == "q8":
        assert agree_fused >= 0.85


def test_generation_runs_quantized_and_quant_is_validated(model_dir: Path) -> None:
    engine = Engine.from_pretrained(model_dir, quant="q4")
    out = engine.logits([1, 2, 3])
    assert out.shape == (3, 1024) and torch.isfinite(out).all()
    assert Engine.from_pretrained(model_dir, quant="none").quant is None
    with pytest.raises(FreeTokenError, match="unknown --quant"):
        Engine.from_pretrained(model_dir, quant="q3")
