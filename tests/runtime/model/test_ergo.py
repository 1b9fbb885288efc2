"""Ergo beyond the parity test: its per-route expert norms through every expert backend (quantized C kernels, the
expert tiers under a memory budget), its checkpoints under either tensor naming, and the renaming reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken_agent.runtime.checkpoint.reader import CheckpointReader, load_config
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.errors import CorruptCheckpointError
from freetoken_agent.runtime.experts.core import set_expert_mode
from freetoken_agent.runtime.kernels.reference import dequantized_reference
from freetoken_agent.runtime.experts.setup import minimum_memory
from freetoken_agent.runtime.memory import Budget
from freetoken_agent.runtime.model.adapters import spec_from_config
from freetoken_agent.runtime.model.families.ergo import ERGO_RENAMES
from freetoken_agent.runtime.quant.native import open_checkpoint
from tests.runtime.arch_configs import save_checkpoint

PROMPT = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.fixture(scope="module")
def ergo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("ergo")
    model = save_checkpoint("ergo", folder, seed=2)
    return folder, model


def test_the_checkpoint_is_in_the_released_layout(ergo: tuple[Path, object]) -> None:
    """transformers writes Ergo back under the released names (its conversion mapping reversed): router and shared
    expert stored transposed; the engine reads them under transformers' names."""
    names = set(load_file(str(ergo[0] / "model.safetensors")))
    assert {"tok_embeddings.weight", "layers.1.feed_forward.gate_kernel",
            "layers.1.feed_forward.shared_up_proj"} <= names
    reader = CheckpointReader(ergo[0], renames=ERGO_RENAMES)
    gate = "model.layers.1.mlp.gate.linear.weight"
    assert reader.shape(gate) == (8, 64) and gate in reader.transposed
    stored = load_file(str(ergo[0] / "model.safetensors"))["layers.1.feed_forward.gate_kernel"]
    assert torch.equal(reader.get(gate), stored.t())
    assert torch.equal(reader.get_row(gate, 3), stored[:, 3]) and torch.equal(reader.get_rows(gate, 2, 4),
                                                                              stored[:, 2:4].t())


def test_a_checkpoint_under_transformers_names_loads_too(ergo: tuple[Path, object], tmp_path: Path) -> None:
    folder, model = ergo
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    state = {k: v.contiguous() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    want = Engine.from_pretrained(folder).logits(PROMPT)
    assert torch.equal(Engine.from_pretrained(tmp_path).logits(PROMPT), want)


@pytest.mark.parametrize("quant", ["q8", "q4"])
def test_quantized_experts_keep_their_own_norms(ergo: tuple[Path, object], quant: str) -> None:
    """Each route runs alone through the C kernels (weight 1), then its expert's norm: exact mode matches plain
    torch over the dequantized experts; the int8-activation kernels stay close."""
    engine = Engine.from_pretrained(ergo[0], quant=quant)
    reference = Engine.from_pretrained(ergo[0], quant=quant)
    dequantized_reference(reference.decoder)
    ref = reference.logits(PROMPT)
    set_expert_mode(engine.decoder, "exact")
    assert float((engine.logits(PROMPT) - ref).abs().max()) <= 1e-3
    set_expert_mode(engine.decoder, "auto")
    got = engine.logits(PROMPT)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("quant", ["none", "q4"])
def test_experts_under_a_memory_budget_give_the_same_tokens(ergo: tuple[Path, object], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch, quant: str) -> None:
    """Ungated experts in slots (a blob holds up [I, D] and down, no gate rows): the tiers give the tokens of the
    unbudgeted engine, float or q4."""
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    reference = Engine.from_pretrained(ergo[0], quant=quant)
    want = reference.generate(PROMPT, max_new_tokens=8).token_ids
    spec = spec_from_config(load_config(ergo[0]))
    minimum = minimum_memory(spec, open_checkpoint(ergo[0], spec.checkpoint_renames), torch.float32, "cpu", quant)
    assert minimum is not None
    engine = Engine.from_pretrained(ergo[0], quant=quant, budget=Budget(host=minimum.need("host") + 3 * 2**14))
    assert engine.generate(PROMPT, max_new_tokens=8).token_ids == want
    tiers = engine.stats()["residency"]["tiers"]["host"]
    assert tiers["misses"] > 0 and tiers["slots"] < 16  # fewer slots than the 2 x 8 experts


def test_renames_refuse_ambiguous_or_impossible_layouts(tmp_path: Path) -> None:
    save_file({"a.weight": torch.ones(2, 3), "b.weight": torch.ones(2, 3), "c": torch.ones(2, 3, 4)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(CorruptCheckpointError, match="'a.weight' and 'b.weight' are both read as 'x.weight'"):
        CheckpointReader(tmp_path, renames=((r"^[ab]\.", "x.", False),))
    with pytest.raises(CorruptCheckpointError, match="'c' should be a matrix stored transposed"):
        CheckpointReader(tmp_path, renames=((r"^c$", "c2", True),))


def test_inspect_counts_the_experts_under_their_released_names(ergo: tuple[Path, object]) -> None:
    from freetoken_agent.cli.inspect import describe

    info = describe(ergo[0])
    assert info["architecture"] == "ergo" and info["moe_layers"] == 2 and info["dense_layers"] == 1
    assert info["params_experts"] == 2 * (8 * 2 * 32 * 64 + 8 * 64)  # up + down, and each expert's output norm
