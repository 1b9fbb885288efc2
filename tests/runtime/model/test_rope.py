"""Every rope type of transformers' ``ROPE_INIT_FUNCTIONS`` (and Hunyuan's NTK-alpha, PhiMoE's fixed longrope) at
the logits level against transformers, on sequences that cross the original context where the type changes there:
``dynamic`` grows its base with the length of each forward, ``longrope`` switches from its short to its long factors.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken_agent.runtime.engine import Engine, Request
from freetoken_agent.runtime.errors import ConfigError
from freetoken_agent.runtime.model.adapters import ROPE_TYPES, spec_from_config
from freetoken_agent.runtime.model.rope import Rotary

warnings.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from tests.runtime.arch_configs import make_config, save_checkpoint  # noqa: E402

ORIGINAL = 16  # the original (pretraining) context of every case: prompts and decodes cross it


def _factors(n: int, lo: float, step: float) -> list[float]:
    return [round(lo + step * i, 4) for i in range(n)]


# (case id, model type, rope_parameters, other config fields)
CASES: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("linear", "qwen3_moe", {"rope_type": "linear", "factor": 2.0}, {"max_position_embeddings": ORIGINAL}),
    ("dynamic", "qwen3_moe", {"rope_type": "dynamic", "factor": 3.0}, {"max_position_embeddings": ORIGINAL}),
    ("yarn", "qwen3_moe", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                           "beta_fast": 16.0, "beta_slow": 2.0}, {"max_position_embeddings": 4 * ORIGINAL}),
    ("longrope", "qwen3_moe", {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
                               "short_factor": _factors(8, 1.0, 0.05), "long_factor": _factors(8, 1.5, 0.9)},
     {"max_position_embeddings": 8 * ORIGINAL}),
    ("llama3", "qwen3_moe", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": ORIGINAL}, {"max_position_embeddings": 64}),
    ("proportional", "qwen3_moe", {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0}, {}),
    # partial rotary (glm4_moe rotates half of each head) with a length-dependent base
    ("dynamic-partial", "glm4_moe", {"rope_type": "dynamic", "factor": 2.0, "partial_rotary_factor": 0.5},
     {"max_position_embeddings": ORIGINAL}),
    # MLA: interleaved rotary key shared by the heads
    ("dynamic-mla", "deepseek_v3", {"rope_type": "dynamic", "factor": 2.0}, {"max_position_embeddings": ORIGINAL}),
    # per-layer base thetas (0: a NoPE layer) keep the rope type (it was silently dropped to the default)
    ("dynamic-layer-theta", "granitemoe_swa", {"rope_type": "dynamic", "factor": 2.0},
     {"max_position_embeddings": ORIGINAL, "layer_rope_theta": [10000.0, 0, 500.0]}),
    # Hunyuan-A13B publishes {"type": "dynamic", "alpha": 1000.0}: a fixed NTK stretch, not length-dependent
    ("ntk-alpha", "hunyuan_v1_moe", {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0},
     {"max_position_embeddings": 4 * ORIGINAL}),
    ("dynamic-hunyuan", "hunyuan_v1_moe", {"rope_type": "dynamic", "factor": 2.0},
     {"max_position_embeddings": ORIGINAL}),
    # PhiMoE: frequencies from the short factors always; cos/sin scaled by short_/long_mscale around the original
    ("longrope-phimoe", "phimoe", {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
                                   "short_factor": _factors(8, 1.0, 0.05), "long_factor": _factors(8, 1.5, 0.9),
                                   "short_mscale": 1.1, "long_mscale": 1.3}, {"max_position_embeddings": 8 * ORIGINAL}),
]


def test_every_transformers_rope_type_is_known() -> None:
    assert set(ROPE_INIT_FUNCTIONS) | {"default"} == set(ROPE_TYPES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rope_type_matches_transformers(case: tuple[str, str, dict[str, Any], dict[str, Any]], tmp_path: Path) -> None:
    name, model_type, rope, fields = case
    torch.set_num_threads(1)
    model = save_checkpoint(model_type, tmp_path, rope_parameters={"rope_theta": 10000.0, **rope}, **fields)
    engine = Engine.from_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(1)
    long = torch.randint(0, 512, (ORIGINAL + 12,), generator=gen)
    # the original context first: transformers' dynamic rope keeps the frequencies of the longest forward it has
    # seen until a forward shorter than the original, so a fresh model is the history-free reference
    for seq in (long[:ORIGINAL], long):
        with torch.no_grad():
            ref = model(seq[None]).logits[0].float()
        assert (engine.logits(seq) - ref).abs().max().item() <= 1e-4

    # a prompt inside the original context whose greedy decode crosses it (one forward per decode step); PhiMoE's
    # generate re-prefills the whole sequence at the crossing (not done here), so its decode starts beyond it
    prompt = long[: ORIGINAL - 4] if model_type != "phimoe" else long[: ORIGINAL + 2]
    with torch.no_grad():
        hf = model.generate(prompt[None], do_sample=False, max_new_tokens=12, min_new_tokens=12)[0, len(prompt):]
    assert engine.generate(prompt, max_new_tokens=12, temperature=0.0).token_ids == hf.tolist()

    # the rope type matters on these sequences: its cos/sin differ from the default rope's
    spec = spec_from_config(model.config.to_dict())
    rope_spec = next(layer.attention.rope for layer in spec.layers if layer.attention.rope is not None)
    default = Rotary(type(rope_spec)(dim=rope_spec.dim, theta=rope_spec.theta, style=rope_spec.style))
    positions = torch.arange(len(long))
    assert not torch.allclose(Rotary(rope_spec).cos_sin(positions)[0][:, : default.inv_freq.numel()],
                              default.cos_sin(positions)[0], atol=1e-3), name


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("dynamic", "longrope")], ids=["dynamic", "longrope"])
def test_chunked_prefill_turns_like_one_forward(case: tuple[str, str, dict[str, Any], dict[str, Any]],
                                                tmp_path: Path) -> None:
    """A prompt past the original context prefilled in chunks turns every chunk with the frequencies of the whole
    prompt, as transformers' single prefill forward does (not of each chunk's end)."""
    _, model_type, rope, fields = case
    torch.set_num_threads(1)
    model = save_checkpoint(model_type, tmp_path, rope_parameters={"rope_theta": 10000.0, **rope}, **fields)
    engine = Engine.from_pretrained(tmp_path)
    engine.scheduler.token_budget = 6  # chunks of 6 tokens: most of them end inside the original context
    prompt = torch.randint(0, 512, (ORIGINAL + 10,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(prompt[None]).logits[0].float()
        hf = model.generate(prompt[None], do_sample=False, max_new_tokens=6, min_new_tokens=6)[0, len(prompt):]
    assert (engine.logits(prompt) - ref).abs().max().item() <= 1e-4
    assert engine.generate(prompt, max_new_tokens=6, temperature=0.0).token_ids == hf.tolist()


def test_length_dependent_rope_per_sequence_in_a_batch(tmp_path: Path) -> None:
    """In one batched step each sequence gets the frequencies for its own length, as it would alone."""
    torch.set_num_threads(1)
    save_checkpoint("qwen3_moe", tmp_path, rope_parameters={"rope_type": "dynamic", "factor": 3.0,
                                                             "rope_theta": 10000.0}, max_position_embeddings=ORIGINAL)
    engine = Engine.from_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (ORIGINAL + 9, 5, ORIGINAL + 2)]
    handles = [engine.submit(Request(p, kind="logits", reuse=False)) for p in prompts]
    for prompt, handle in zip(prompts, handles):
        assert (handle.result().logits - engine.logits(prompt)).abs().max().item() <= 1e-5


def test_unknown_rope_type_is_a_config_error_naming_it() -> None:
    cfg = make_config("qwen3_moe").to_dict()
    cfg["rope_parameters"] = {"rope_type": "su-scaled", "rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="su-scaled"):
        spec_from_config(cfg)
    cfg["rope_parameters"] = None
    cfg["rope_scaling"] = {"type": "ntk-by-parts", "factor": 2.0}
    with pytest.raises(ConfigError, match="ntk-by-parts"):
        spec_from_config(cfg)
