"""The quantized-expert core: ``build_experts`` picks each source from format, placement, budget and kernels, the
backends it builds say what they are through ``capabilities``, and every source computes what its reference does.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from freetoken_agent.runtime.checkpoint.reader import load_config
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.errors import FreeTokenError, OptionError
from freetoken_agent.runtime.experts.capabilities import REFERENCE, capabilities_of
from freetoken_agent.runtime.experts.core import ExpertsRequest, build_experts, choose_source, set_expert_mode
from freetoken_agent.runtime.gguf import open_gguf
from freetoken_agent.runtime.kernels import build
from freetoken_agent.runtime.kernels.reference import dequantized_reference
from freetoken_agent.runtime.memory import Budget
from freetoken_agent.runtime.model.adapters import spec_from_config
from freetoken_agent.runtime.model.decoder import Decoder
from freetoken_agent.runtime.quant.native import open_checkpoint
from freetoken_agent.runtime.synthetic import write_synthetic

PROMPT = [3, 77, 512, 9, 1000, 41, 5, 260, 18, 700]
SMALL = {"num_hidden_layers": 2, "hidden_size": 128, "moe_intermediate_size": 96, "num_experts": 8}
KERNELS = [False, True] if build.load() is not None else [False]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic("qwen3_moe", tmp_path_factory.mktemp("core") / "m", seed=3, **SMALL)


@pytest.fixture(scope="module")
def float_logits(folder: Path) -> torch.Tensor:
    return Engine.from_pretrained(folder).logits(PROMPT)


def request(folder: Path, **kwargs: Any) -> ExpertsRequest:
    spec = spec_from_config(load_config(folder))
    return ExpertsRequest(folder, spec, open_checkpoint(folder), torch.float32, "cpu", **kwargs)


def engine_of(req: ExpertsRequest, kernels: bool) -> tuple[Engine, Any]:
    """An engine over what ``build_experts`` built (what ``Engine.from_pretrained`` does, minus the tokenizer)."""
    built = build_experts(req, kernels)
    engine = Engine(req.spec, Decoder(req.spec, built.weights, req.device), None, None)
    built.install(engine.decoder)
    return engine, built


def moe_backends(engine: Engine) -> list[Any]:
    return [b for b, layer in zip(engine.decoder.experts, engine.spec.layers, strict=True) if layer.moe is not None]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize(
    "options,source,placement,fmt",
    [
        ({}, "float", "resident", None),
        ({"quant": "q4_0", "placement": "resident"}, "quantize", "resident", "q4_0"),
        ({"quant": "q8_0"}, "mapped", "mapped", "q8_0"),
        ({"quant": "q8_0", "budget": Budget()}, "managed", "managed", "q8_0"),
        ({"budget": Budget()}, "managed", "managed", "float32"),
    ],
)
def test_build_experts_chooses_each_source_and_its_capabilities(
    folder: Path, float_logits: torch.Tensor, kernels: bool, options: dict[str, Any], source: str, placement: str,
    fmt: str | None,
) -> None:  # fmt: skip
    req = request(folder, **options)
    assert choose_source(req) == source
    engine, built = engine_of(req, kernels)
    assert built.source == source
    caps = [capabilities_of(b) for b in moe_backends(engine)]
    assert len(caps) == 2 and all(c.placement == placement for c in caps)
    quantized = fmt is not None and fmt.startswith("q")
    if fmt is None:  # the loaded TorchExperts compute: the reference, with no backend of their own
        assert not built.backends and all(c is REFERENCE for c in caps) and built.report is None
    else:
        assert all(c.formats == (fmt,) and c.quantized == quantized for c in caps)
        assert all(c.kernels == (kernels and quantized) for c in caps)
    assert (built.store is not None) == (source == "managed")
    if source == "managed":  # tiers: no modes to switch, nothing to dequantize; prefetch to the next MoE layer
        assert set_expert_mode(engine.decoder, "exact") == 0
        assert [c.can_prefetch for c in caps] == [True, False] and not any(c.modes or c.dequantize for c in caps)
    logits = engine.logits(PROMPT)
    if built.store is not None:
        built.store.close()
    if not quantized:
        assert torch.allclose(logits, float_logits, rtol=0, atol=1e-5)
        return
    if source != "managed":
        assert built.report is not None and built.report.fmt == fmt and built.report.kernels == kernels
        assert all(c.modes and c.dequantize for c in caps)
        assert set_expert_mode(engine.decoder, "exact") == 2
        reference, _ = engine_of(req, kernels)
        dequantized_reference(reference.decoder)  # plain torch over the same bytes
        assert all(capabilities_of(b) is REFERENCE for b in moe_backends(reference))
        assert float((engine.logits(PROMPT) - reference.logits(PROMPT)).abs().max()) <= 1e-4
    assert float((logits.argmax(-1) == float_logits.argmax(-1)).float().mean()) >= 0.7


@pytest.mark.parametrize("kernels", KERNELS)
def test_the_sources_agree_on_the_same_bytes(folder: Path, kernels: bool) -> None:
    """In-memory quantization, the mapped cache file and the managed tiers hold the same q8 bytes and compute the
    same logits (the tiers bitwise, as the unbudgeted engine)."""
    resident, _ = engine_of(request(folder, quant="q8_0", placement="resident"), kernels)
    mapped, _ = engine_of(request(folder, quant="q8_0"), kernels)
    managed, built = engine_of(request(folder, quant="q8_0", budget=Budget()), kernels)
    for a, b in zip(moe_backends(resident), moe_backends(mapped), strict=True):
        assert capabilities_of(a).fused == capabilities_of(b).fused == kernels  # SiLU, no biases
        for x, y in zip(a.dequantize(), b.dequantize(), strict=True):
            assert torch.equal(x, y)
    want = mapped.logits(PROMPT)
    assert torch.equal(resident.logits(PROMPT), want)
    assert torch.equal(managed.logits(PROMPT), want)
    built.store.close()


def test_bf16_decoder_gets_bf16_experts_output(folder: Path) -> None:
    """Quantized backends compute in fp32 and return the input's dtype: nothing wraps them."""
    engine, _ = engine_of(replace(request(folder, quant="q4_0"), dtype=torch.bfloat16),
                          build.load() is not None)
    backend = moe_backends(engine)[0]
    x = torch.randn(5, SMALL["hidden_size"], dtype=torch.bfloat16)
    ids = torch.randint(0, SMALL["num_experts"], (5, 2))
    out = backend.forward(x, ids, torch.rand(5, 2, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == x.shape and bool(torch.isfinite(out).all())


def test_gguf_blocks_are_a_source(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    from tests.runtime.gguf.models import varied_checkpoint
    from tests.runtime.gguf.writer import write_gguf

    hf = tmp_path / "hf"
    varied_checkpoint("qwen3_moe", hf, seed=1)
    model = open_gguf(write_gguf(hf, tmp_path / "q4.gguf", experts="Q4_0"))
    req = ExpertsRequest(model.path, model.spec, model.reader, torch.float32, "cpu", gguf=model)
    assert choose_source(req) == "gguf"
    engine, built = engine_of(req, build.load() is not None)
    assert built.report is not None and built.report.fmt == "q4_0"
    caps = {capabilities_of(b) for b in moe_backends(engine)}
    assert {(c.placement, c.formats) for c in caps} == {("resident", ("q4_0",))}
    assert choose_source(replace(req, budget=Budget())) == "managed"  # a budget manages a GGUF file's experts too
    with pytest.raises(OptionError, match="not mapped"):
        choose_source(replace(req, placement="mapped"))
    f32 = open_gguf(write_gguf(hf, tmp_path / "f32.gguf"))  # float experts: loaded as a folder's are
    assert choose_source(ExpertsRequest(f32.path, f32.spec, f32.reader, torch.float32, "cpu", gguf=f32)) == "float"


def test_bad_requests_end_in_one_clear_line(folder: Path) -> None:
    with pytest.raises(OptionError, match="unknown expert placement 'disk'"):
        choose_source(request(folder, quant="q4_0", placement="disk"))
    with pytest.raises(OptionError, match="pass a --quant format"):
        choose_source(request(folder, placement="mapped"))
    with pytest.raises(OptionError, match="cannot load them resident"):
        choose_source(request(folder, quant="q4_0", placement="resident", budget=Budget()))
    engine, _ = engine_of(request(folder, quant="q4_0", placement="resident"), False)
    with pytest.raises(FreeTokenError, match="int8 expert mode needs the C kernels"):
        set_expert_mode(engine.decoder, "int8")
    with pytest.raises(FreeTokenError, match="unknown expert mode"):
        set_expert_mode(engine.decoder, "fast")
