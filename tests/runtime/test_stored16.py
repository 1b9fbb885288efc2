"""A bf16 checkpoint's SiLU experts stay bf16 under fp32 compute (``experts.core.stored_experts_dtype``): the kernels
widen each weight exactly in registers, so the logits are bitwise those of fp32 copies and transformers' fp32 logits
stay within the oracle's 1e-4, at half the experts' memory and half the bytes a decode step streams."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.experts.core import STORED16_ENV
from freetoken_agent.runtime.generation.sampling import SamplingParams
from freetoken_agent.runtime.kernels import build
from freetoken_agent.runtime.model.moe import TorchExperts
from tests.runtime.checkpoints import make_model

pytestmark = pytest.mark.skipif(build.load() is None, reason="C kernels unavailable (no compiler)")

PROMPT = [3, 17, 9, 4, 22, 31, 8, 15, 3, 17, 9, 4, 40, 12]


def _experts(engine: Engine) -> list[TorchExperts]:
    return [b for b in engine.decoder.experts if isinstance(b, TorchExperts)]


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("qwen3_moe_bf16")
    make_model("qwen3_moe", seed=7).to(torch.bfloat16).save_pretrained(folder)
    # the oracle: transformers in fp32 over the stored bf16 values
    return folder, transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_experts_stay_bf16_and_give_the_bits_of_fp32_copies(bf16_checkpoint: tuple[Path, torch.nn.Module],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    folder, model = bf16_checkpoint
    stored = Engine.from_pretrained(folder, threads=1)  # torch on one thread, as the reference below
    kept = _experts(stored)
    assert kept and all(e.gate_up.dtype is torch.bfloat16 and e.down.dtype is torch.bfloat16 for e in kept)
    monkeypatch.setenv(STORED16_ENV, "0")  # the switch: widened to fp32 at load, as before
    wide = Engine.from_pretrained(folder, threads=1)
    assert all(e.gate_up.dtype is torch.float32 and e.down.dtype is torch.float32 for e in _experts(wide))
    assert sum(e.gate_up.nbytes + e.down.nbytes for e in kept) * 2 == sum(
        e.gate_up.nbytes + e.down.nbytes for e in _experts(wide))
    logits = stored.logits(PROMPT)
    assert torch.equal(logits, wide.logits(PROMPT))
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].float()
    assert float((logits - ref).abs().max()) <= 1e-4
    params = SamplingParams(max_new_tokens=16)
    for engine in (stored, wide):
        engine.speculation = False
    out = stored.generate(PROMPT, params).token_ids
    assert out == wide.generate(PROMPT, params).token_ids
    stored.speculation = True  # verify rows over bf16 experts: the same tokens
    assert stored.generate(PROMPT, params).token_ids == out
    stored.close()
    wide.close()


def test_fp32_checkpoints_and_other_experts_are_widened_as_before(tmp_path: Path) -> None:
    """Only experts stored in bf16 and computed by the fp32 MoE kernel stay 16-bit: an fp32 checkpoint's experts and
    a bf16 checkpoint's biased experts (gpt-oss: biases and a clamped activation) load as fp32."""
    fp32 = tmp_path / "fp32"
    make_model("qwen3_moe", seed=2).save_pretrained(fp32)
    engine = Engine.from_pretrained(fp32)
    assert all(e.gate_up.dtype is torch.float32 for e in _experts(engine))
    engine.close()
    biased = tmp_path / "gpt_oss"
    make_model("gpt_oss", seed=2).to(torch.bfloat16).save_pretrained(biased)
    engine = Engine.from_pretrained(biased)
    assert _experts(engine) and all(e.gate_up.dtype is torch.float32 for e in _experts(engine))
    engine.close()
