"""Configs as they are published on the Hugging Face hub, shrunk only in size, load and match transformers.

Each fixture in ``published_configs/`` keeps the exact key set and values of a real ``config.json`` (nested
sub-configs, quirky fields, absent ``layer_types`` included); only sizes are small (hidden size, layers, heads,
experts, vocabulary, intermediate sizes). transformers builds a random checkpoint from it and saves it; the folder's
``config.json`` is then the published one, as a user downloads it, and our engine must match the model's logits
(fp32, <= 1e-4) and greedy tokens.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken_agent.runtime.engine import Engine

warnings.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "published_configs"
PUBLISHED = sorted(p.stem for p in FIXTURES.glob("*.json"))
MULTIMODAL = {"llama4", "qwen3_5_moe"}  # wrappers whose text model sits under ``text_config``
INIT_RANGE = {"granitemoe": 0.8}
"""Granite's tied embeddings x embedding_multiplier 12 with residual_multiplier 0.22 make a random model at the
usual test init echo its last input token; larger weights give a non-trivial greedy path."""


def _build(published: dict[str, Any], seed: int = 0) -> Any:
    """A transformers model with random weights from the published config (a larger init range than the
    published 0.02 so greedy decoding does not collapse; routers get a strong signal)."""
    config = transformers.AutoConfig.for_model(**published)
    if published["model_type"] == "dbrx" and not published.get("rope_parameters"):
        # transformers 5 rotates DBRX with its top-level default theta (10^4) and never reads attn_config's
        # rope_theta (5·10^5 in dbrx-instruct), which its 4.x modeling used: the checkpoint's value is the right one
        config.rope_parameters = {"rope_type": "default", "rope_theta": float(published["attn_config"]["rope_theta"])}
    for sub in (config, getattr(config, "text_config", None)):
        if sub is not None and hasattr(sub, "initializer_range"):
            sub.initializer_range = INIT_RANGE.get(published["model_type"], 0.15)
        if sub is not None and (getattr(sub, "pad_token_id", None) or 0) >= getattr(sub, "vocab_size", 1 << 62):
            sub.pad_token_id = None  # the published pad id lies beyond the shrunk vocabulary (an embedding index)
    torch.manual_seed(seed)
    auto = transformers.AutoModelForImageTextToText if published["model_type"] in MULTIMODAL else \
        transformers.AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                p.copy_(torch.randn_like(p) * 0.1)
            elif (".gate.weight" in name or "router" in name or ".gate.wg." in name) and p.dim() == 2:
                p.copy_(torch.randn_like(p) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.copy_(torch.randn_like(b) * 0.1)
    model.generation_config.eos_token_id = None  # published special ids lie beyond the shrunk vocabulary
    model.generation_config.pad_token_id = None
    model.generation_config.use_mtp = False  # plain greedy decoding, not MTP-assisted generation
    return model.eval()


def test_fixtures_cover_the_published_families() -> None:
    types = {json.loads((FIXTURES / f"{name}.json").read_text())["model_type"] for name in PUBLISHED}
    assert {"qwen3_next", "qwen3_5_moe", "llama4", "kimi_linear", "hunyuan_v1_moe", "phimoe", "deepseek_v3",
            "qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "olmoe", "granitemoe", "minimax_m2", "minimax", "jamba",
            "dbrx"} <= types


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_config_matches_transformers(name: str, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    text = (FIXTURES / f"{name}.json").read_text()
    model = _build(json.loads(text))
    model.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(text)  # the published form, not transformers' re-serialization
    engine = Engine.from_pretrained(tmp_path, threads=1)  # torch on the reference's one thread (see all_architectures)
    vocab = engine.spec.vocab_size
    ids = torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(1))
    lm = model.language_model if hasattr(getattr(model, "language_model", None), "lm_head") else model
    with torch.no_grad():  # (transformers' Llama4ForConditionalGeneration fails on text-only input: its text model)
        ref = lm(input_ids=ids[None]).logits[0].float()
    ours = engine.logits(ids)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4

    with torch.no_grad():
        hf = lm.generate(input_ids=ids[None], do_sample=False, max_new_tokens=16)[0, len(ids):].tolist()
    assert engine.generate(ids, max_new_tokens=16, temperature=0.0).token_ids == hf
    assert len(set(hf)) > 2, "degenerate test model: greedy output repeats one token"
