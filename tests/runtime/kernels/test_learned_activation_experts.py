"""Experts with a learned activation (PReLU, xIELU) through every expert backend: the quantized experts (mapped from
the expert cache file, or quantized in place) and the budgeted residency store compute with the layer's own
activation parameters, as the plain-torch experts do. A backend that lost them would raise (``activation_fn`` needs
a learned activation's parameters), so agreement here means they were applied; the fused C MoE step (SiLU only) is
never taken."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from freetoken_agent.evals.fuzz.tiny import save_checkpoint
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.experts.capabilities import capabilities_of
from freetoken_agent.runtime.experts.core import install, set_expert_mode
from freetoken_agent.runtime.experts.quantized import from_weights
from freetoken_agent.runtime.kernels import build
from freetoken_agent.runtime.kernels.reference import dequantized_reference
from freetoken_agent.runtime.memory import Budget

PROMPT = [3, 77, 200, 9, 100, 41, 5, 260, 18, 70, 11, 400]


@pytest.fixture(scope="module", params=["prelu", "xielu"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp(request.param)
    save_checkpoint("mixtral", folder, hidden_act=request.param)  # per-layer act_fn tensors, randomized
    return folder


def test_quantized_experts_apply_the_learned_activation(model: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    mapped = Engine.from_pretrained(model, quant="q8")  # experts from the expert cache file
    assert mapped.quant is not None and mapped.quant.layers > 0
    assert not any(capabilities_of(b).fused for b in mapped.decoder.experts if b is not None)
    reference = Engine.from_pretrained(model, quant="q8")
    dequantized_reference(reference.decoder)  # TorchExperts over the dequantized weights
    want = reference.logits(PROMPT)
    set_expert_mode(mapped.decoder, "exact")
    assert float((mapped.logits(PROMPT) - want).abs().max()) <= 1e-4
    in_place = Engine.from_pretrained(model)
    install(in_place.decoder, from_weights(in_place.decoder.weights, "q8_0", build.load() is not None)[0])
    set_expert_mode(in_place.decoder, "exact")
    assert float((in_place.logits(PROMPT) - want).abs().max()) <= 1e-4
    plain = Engine.from_pretrained(model).logits(PROMPT)  # q8 stays near the float model
    assert float((plain.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.8


def test_budgeted_experts_apply_the_learned_activation(model: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    plain = Engine.from_pretrained(model)
    managed = Engine.from_pretrained(model, budget=Budget())
    assert managed.residency is not None
    assert torch.allclose(managed.logits(PROMPT), plain.logits(PROMPT), rtol=0, atol=1e-5)
    quantized = Engine.from_pretrained(model, quant="q8")  # quantized slots: QuantizedExperts over the pool
    managed_q8 = Engine.from_pretrained(model, quant="q8", budget=Budget())
    assert torch.allclose(managed_q8.logits(PROMPT), quantized.logits(PROMPT), rtol=0, atol=1e-5)
