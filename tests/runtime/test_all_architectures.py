"""Every MoE causal-LM model type in the installed transformers: logits and greedy parity, or a written reason.

The parametrization is discovered from transformers' registries (``arch_configs.moe_causal_lm_types``), never
hand-kept: a new MoE architecture in a newer transformers fails ``test_every_type_is_supported_or_explained`` until it
gets an adapter or a reason in ``UNSUPPORTED``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.model.adapters import supported_architectures

warnings.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")

from tests.runtime.arch_configs import moe_causal_lm_types, save_checkpoint  # noqa: E402

# Model types without an adapter yet, and why (mirrored in the README support table).
UNSUPPORTED: dict[str, str] = {}

TYPES = moe_causal_lm_types()


def test_discovery_finds_the_moe_architectures() -> None:
    assert len(TYPES) >= 62
    assert {"mixtral", "deepseek_v3", "qwen3_next", "jamba", "llama4_text", "dbrx"} <= set(TYPES)
    assert "llama" not in TYPES and "qwen3" not in TYPES  # dense models are not MoE


def test_every_type_is_supported_or_explained() -> None:
    supported = set(supported_architectures())
    unexplained = [t for t in TYPES if t not in supported and t not in UNSUPPORTED]
    assert not unexplained, f"MoE model types with neither an adapter nor a reason: {unexplained}"
    stale = [t for t in UNSUPPORTED if t in supported]
    assert not stale, f"types listed as unsupported that now have an adapter: {stale}"


@pytest.mark.parametrize("model_type", TYPES)
def test_parity_with_transformers(model_type: str, tmp_path: Path) -> None:
    if model_type not in supported_architectures():
        pytest.skip(UNSUPPORTED.get(model_type, "no adapter"))
    torch.set_num_threads(1)
    model = save_checkpoint(model_type, tmp_path)
    engine = Engine.from_pretrained(tmp_path)
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(1))
    experts_seen: dict[int, set[int]] = {}
    engine.decoder.routing_observers.append(
        lambda layer, topk: experts_seen.setdefault(layer, set()).update(topk.flatten().tolist())
    )
    with torch.no_grad():
        ref = model(ids[None]).logits[0].float()
    ours = engine.logits(ids)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4
    assert experts_seen and all(len(s) >= 3 for s in experts_seen.values()), "routing not exercised"

    with torch.no_grad():
        hf = model.generate(ids[None], do_sample=False, max_new_tokens=32, min_new_tokens=32)[0, len(ids):].tolist()
    result = engine.generate(ids, max_new_tokens=32, temperature=0.0)
    assert result.token_ids == hf
    assert len(set(result.token_ids)) > 4, "degenerate test model: greedy output repeats one token"
