"""GGUF files written in the test (llama.cpp's conventions, ``writer.py``) from tiny random transformers checkpoints.

- F32 files of every mapped architecture: logits within 1e-4 of transformers on the same weights;
- Q8_0 / Q4_0 experts: loaded as stored (no conversion), logits within 1e-3 of an engine over an F32 GGUF holding
  the same tensors dequantized by the ``gguf`` package (an independent decoder of the blocks);
- Q4_K gate/up with Q6_K down (a Q4_K_M file's experts), Q5_K and MXFP4 experts: loaded as stored, byte for byte,
  no conversion; logits within 1e-3 of plain torch over our dequantization and over the ``gguf`` package's, and the
  int8 kernels agree with the int8-activation reference;
- other block types (Q4_1, Q5_0): converted at load; the engine equals plain torch over what it runs (≤ 1e-3),
  the reported conversion error equals the error measured here, and ``quant="q8_0"`` converts with less error;
- a split file loads from its first part or its folder with the same logits; ``resolve_model`` finds the file;
- GLM-4.5's multi-token-prediction layer (an extra block in the file) is left unread; GPT-OSS's MXFP4 experts (the
  format its GGUF files ship in) run as stored, with their biases; DeepSeek's split ``attn_k_b`` / ``attn_v_b`` join
  back into ``kv_b_proj`` from block types too, and files from before that split (``attn_kv_b``) load as well.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.errors import ConfigError
from freetoken_agent.runtime.experts.core import set_expert_mode
from freetoken_agent.runtime.kernels.dense import set_dense_mode
from freetoken_agent.runtime.kernels.reference import dequantized_reference
from freetoken_agent.runtime.models import resolve_model

from tests.runtime.checkpoints import save_checkpoint
from tests.runtime.gguf.models import varied_checkpoint
from tests.runtime.gguf.writer import write_gguf

ARCHS = {  # overrides: llama.cpp's qwen2moe has an MoE FFN in every layer; DeepSeek's config.json names its router
    "qwen3_moe": {}, "qwen2_moe": {"mlp_only_layers": []}, "mixtral": {}, "olmoe": {}, "granitemoe": {},
    "glm4_moe": {}, "gpt_oss": {}, "deepseek_v2": {"scoring_func": "softmax"},
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}, "qwen3_next": {},
}
PROMPT = torch.randint(0, 512, (14,), generator=torch.Generator().manual_seed(5)).tolist()  # < Mixtral's window 16


def set_mode(engine: Engine, mode: str) -> None:
    """Experts and the dense weights kept in their stored blocks: ``exact`` (dequantized, fp32) or ``int8``."""
    set_expert_mode(engine.decoder, mode)
    set_dense_mode(engine.decoder.weights, mode)


def dequantized_copy(src: Path, dst: Path) -> Path:
    """``src`` with every tensor dequantized to F32 by the ``gguf`` package (metadata copied as is)."""
    import gguf

    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, vtype)
    for t in r.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        w.add_tensor(t.name, gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    for arch, overrides in ARCHS.items():
        folder = tmp_path_factory.mktemp(arch)
        out[arch] = (folder, varied_checkpoint(arch, folder, seed=1, **overrides))
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_f32_gguf_matches_transformers(arch: str, checkpoints: dict, tmp_path: Path) -> None:
    folder, model = checkpoints[arch]
    engine = Engine.from_pretrained(write_gguf(folder, tmp_path / "m.gguf"))
    assert engine.spec.model_type == arch
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0]
    assert float((engine.logits(PROMPT) - ref).abs().max()) <= 1e-4


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss", "deepseek_v2",
                                  "deepseek_v3", "qwen3_next"])
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_block_experts_load_as_stored(arch: str, kind: str, checkpoints: dict, tmp_path: Path) -> None:
    folder, _ = checkpoints[arch]
    file = write_gguf(folder, tmp_path / "q.gguf", experts=kind, dense="Q8_0")
    engine = Engine.from_pretrained(file)
    assert engine.quant is not None and engine.quant.fmt == kind.lower()
    set_mode(engine, "exact")
    ref = Engine.from_pretrained(dequantized_copy(file, tmp_path / "deq.gguf"))
    assert ref.quant is None  # float experts: plain torch
    assert float((engine.logits(PROMPT) - ref.logits(PROMPT)).abs().max()) <= 1e-3


def _kquant_case(tmp_path: Path, kind: str) -> tuple[Path, Path]:
    folder = tmp_path / "hf"
    save_checkpoint("qwen3_moe", folder, seed=2, hidden_size=256, moe_intermediate_size=256, head_dim=64)
    return folder, write_gguf(folder, tmp_path / f"{kind}.gguf", experts=kind)


def assert_int8_matches(engine: Engine, int8_ref: Engine) -> None:
    """The int8-activation kernels' logits against their plain-torch reference, both under batch-invariant ops (the
    reference's torch GEMMs otherwise change algorithm with the row count). Still, an activation whose int8 rounding
    lies on a tie may round the other way in the kernels' fp32 order than in the reference's (reference.near_ties),
    and on these tiny random models one such flip moves the later logits by ~0.05-0.1: a position whose reference
    top-2 margin is within twice its logit difference may flip (a Xeon flipped two, at margins 0.001 and 0.004);
    every clear position must agree. Such a flip at one position also moves every later one (they attend to its
    keys and values), so the KL over all positions is bounded at 5e-3 (an MXFP4 model flipped one activation at
    position 6 of 14 once the attention kernel's summation order changed: KL 1.6e-3, later logits off by 0.1-0.8),
    while the positions before the first flip must agree to fp32 noise. A wrong scale or block layout moves every
    position by whole units."""
    from freetoken_agent.runtime.kernels import ops
    from freetoken_agent.runtime.kernels.accuracy import kl, top1

    ops.set_deterministic(True)
    try:
        logits, want = engine.logits(PROMPT), int8_ref.logits(PROMPT)
    finally:
        ops.set_deterministic(False)
    top2 = want.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (logits - want).abs().amax(-1)
    assert int(clear.sum()) >= want.shape[0] // 2 and top1(logits[clear], want[clear]) == 1.0
    diff = (logits - want).abs().amax(-1)
    first = int((diff > 1e-3).nonzero()[0]) if bool((diff > 1e-3).any()) else diff.shape[0]
    assert first >= 1 and float(diff[:first].max()) <= 1e-3  # up to the first flip: the same logits
    assert kl(want, logits) <= 5e-3


@pytest.mark.parametrize("kinds", [("Q4_K", "Q6_K"), ("Q5_K", "Q5_K"), ("MXFP4", "MXFP4")])
def test_native_block_experts_run_as_stored(kinds: tuple[str, str], tmp_path: Path) -> None:
    import gguf
    from freetoken_agent.runtime.kernels import build

    folder = tmp_path / "hf"
    save_checkpoint("qwen3_moe", folder, seed=2, hidden_size=256, moe_intermediate_size=512, head_dim=64)
    file = write_gguf(folder, tmp_path / "k.gguf", experts=kinds[0], down=kinds[1], dense="Q8_0")
    engine = Engine.from_pretrained(file)
    formats = tuple(dict.fromkeys(k.lower() for k in kinds))
    assert engine.quant.fmt == "+".join(formats) and engine.quant.kernels == (build.load() is not None)
    report = engine.quant  # no expert was converted: each backend holds the file's blocks as they are
    reader = gguf.GGUFReader(str(file))
    stored = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    for i, backend in enumerate(engine.decoder.experts):
        assert backend.capabilities.formats == formats and backend.capabilities.kernels == report.kernels
        b13, b2 = backend.blocks()
        gate_up = torch.cat([stored[f"blk.{i}.ffn_gate_exps.weight"], stored[f"blk.{i}.ffn_up_exps.weight"]], dim=1)
        assert torch.equal(b13.reshape(gate_up.shape), gate_up)
        assert torch.equal(b2.reshape(stored[f"blk.{i}.ffn_down_exps.weight"].shape),
                           stored[f"blk.{i}.ffn_down_exps.weight"])
    set_mode(engine, "exact")
    ours = engine.logits(PROMPT)
    ref = Engine.from_pretrained(file)
    dequantized_reference(ref.decoder)  # plain torch over our dequantization of the stored blocks
    assert float((ours - ref.logits(PROMPT)).abs().max()) <= 1e-3
    independent = Engine.from_pretrained(dequantized_copy(file, tmp_path / "deq.gguf"))  # the gguf package's values
    assert independent.quant is None
    assert float((ours - independent.logits(PROMPT)).abs().max()) <= 1e-3
    if build.load() is not None:  # the int8-activation kernels (decode's path) against their plain-torch reference
        set_mode(engine, "int8")
        int8_ref = Engine.from_pretrained(file)
        dequantized_reference(int8_ref.decoder, activations="int8")
        assert_int8_matches(engine, int8_ref)


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0"])
def test_converted_experts(kind: str, tmp_path: Path) -> None:
    from freetoken_agent.runtime.gguf.model import GGUFModel
    from freetoken_agent.runtime.gguf.reader import dequantize
    from freetoken_agent.runtime.quant.blocks import dequantize as dequantize_blocks
    from freetoken_agent.runtime.quant.blocks import quantize

    _, file = _kquant_case(tmp_path, kind)
    expected_fmt = "q8_0" if kind == "Q5_0" else "q4_0"
    engine = Engine.from_pretrained(file)
    assert engine.quant.fmt == expected_fmt
    set_mode(engine, "exact")
    ours = engine.logits(PROMPT)
    ref = Engine.from_pretrained(file)
    dequantized_reference(ref.decoder)  # plain torch over the weights the engine runs
    assert float((ours - ref.logits(PROMPT)).abs().max()) <= 1e-3
    # the reported conversion error is the one measured here (gguf's dequantizer, then our block quantizer)
    model = GGUFModel(file)
    report = {(c.part, c.layer): c for c in model.measure_conversion(max_experts=2)}
    c = report[("gate", 0)]
    t = model.file.tensors["blk.0.ffn_gate_exps.weight"]
    err = tot = 0.0
    for e in range(2):
        w = dequantize(t, e)
        back = dequantize_blocks(quantize(w, expected_fmt))
        err += float((w - back).pow(2).sum())
        tot += float(w.pow(2).sum())
    assert c.stored == kind and c.runs_as == expected_fmt and c.rel_rms_error == pytest.approx((err / tot) ** 0.5,
                                                                                              rel=1e-3)
    # against the stored values themselves (an F32 file of the dequantized experts): off by the conversion only,
    # and less so when converted to the wider Q8_0
    exact = Engine.from_pretrained(dequantized_copy(file, tmp_path / "deq.gguf")).logits(PROMPT)
    rel = float((ours - exact).norm() / exact.norm())
    print(f"{kind}: logits relative error vs the stored values {rel:.4f}, conversion error {c.rel_rms_error:.4f}")
    assert rel < 0.5
    if expected_fmt == "q4_0":
        wide = {(c.part, c.layer): c for c in model.measure_conversion("q8_0", max_experts=2)}
        assert wide[("gate", 0)].rel_rms_error < c.rel_rms_error / 4
        q8 = Engine.from_pretrained(file, quant="q8_0")
        assert q8.quant.fmt == "q8_0"
        set_mode(q8, "exact")
        rel8 = float((q8.logits(PROMPT) - exact).norm() / exact.norm())
        print(f"{kind} loaded as q8_0: logits relative error {rel8:.4f}")
        assert rel8 < rel / 4


def with_mtp_layer(src: Path, dst: Path) -> Path:
    """A copy of the GLM-4.5 folder ``src`` with a multi-token-prediction layer after the decoder's, as GLM-4.5
    checkpoints hold it (``model.layers.{n}``: a decoder layer plus ``eh_proj``, ``enorm``, ``hnorm``,
    ``shared_head.norm``)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    sd = load_file(str(src / "model.safetensors"))
    last = f"model.layers.{n - 1}."
    gen = torch.Generator().manual_seed(9)
    mtp = {f"model.layers.{n}." + k[len(last):]: torch.randn(v.shape, generator=gen) for k, v in sd.items()
           if k.startswith(last)}
    d = sd["model.norm.weight"].shape[0]
    for leaf, shape in (("eh_proj.weight", (d, 2 * d)), ("enorm.weight", (d,)), ("hnorm.weight", (d,)),
                        ("shared_head.norm.weight", (d,))):
        mtp[f"model.layers.{n}.{leaf}"] = torch.randn(shape, generator=gen)
    save_file(mtp, str(dst / "mtp.safetensors"))
    return dst


def test_glm4_mtp_layer_is_not_read(checkpoints: dict, tmp_path: Path) -> None:
    from freetoken_agent.runtime.gguf.model import GGUFModel

    folder, _ = checkpoints["glm4_moe"]
    plain = write_gguf(folder, tmp_path / "plain.gguf", experts="Q8_0")
    file = write_gguf(with_mtp_layer(folder, tmp_path / "mtp"), tmp_path / "mtp.gguf", experts="Q8_0")
    model = GGUFModel(file)
    assert model.file.arch_get("block_count") == 4 and model.config["num_hidden_layers"] == 3
    assert "blk.3.nextn.eh_proj.weight" in model.reader.skipped and "blk.3.ffn_gate_exps.weight" in model.reader.skipped
    assert torch.equal(Engine.from_pretrained(file).logits(PROMPT), Engine.from_pretrained(plain).logits(PROMPT))


def test_gpt_oss_mxfp4_experts(checkpoints: dict, tmp_path: Path) -> None:
    from freetoken_agent.runtime.kernels import build

    folder, _ = checkpoints["gpt_oss"]
    file = write_gguf(folder, tmp_path / "mxfp4.gguf", experts="MXFP4")
    engine = Engine.from_pretrained(file)
    assert engine.quant is not None and engine.quant.fmt == "mxfp4"  # as stored: no conversion
    set_mode(engine, "exact")
    ref = Engine.from_pretrained(file)
    dequantized_reference(ref.decoder)  # plain torch over the weights (and biases) the engine runs
    ours, ref_logits = engine.logits(PROMPT), ref.logits(PROMPT)
    assert float((ours - ref_logits).abs().max()) <= 1e-3
    exact = Engine.from_pretrained(dequantized_copy(file, tmp_path / "deq.gguf"))  # the file's values, by gguf
    assert exact.quant is None and float((ours - exact.logits(PROMPT)).abs().max()) <= 1e-3
    if build.load() is not None:  # the int8-activation kernels (per-expert calls: biases, GPT-OSS's activation)
        set_mode(engine, "int8")
        int8_ref = Engine.from_pretrained(file)
        dequantized_reference(int8_ref.decoder, activations="int8")
        assert_int8_matches(engine, int8_ref)


def test_deepseek_split_kv_b_in_block_types(tmp_path: Path) -> None:
    import gguf

    from freetoken_agent.runtime.gguf.model import GGUFModel

    folder = tmp_path / "hf"  # head sizes that are whole Q8_0 blocks, so attn_k_b / attn_v_b are stored quantized
    varied_checkpoint("deepseek_v3", folder, seed=2, scoring_func="sigmoid", qk_nope_head_dim=32, kv_lora_rank=32,
                      v_head_dim=32)
    file = write_gguf(folder, tmp_path / "q.gguf", experts="Q8_0", dense="Q8_0")
    model = GGUFModel(file)
    assert {model.file.tensors[f"blk.1.attn_{x}_b.weight"].type_name for x in "kv"} == {"Q8_0"}
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    k_b, v_b = (torch.from_numpy(gguf.quants.dequantize(np.asarray(model.file.tensors[f"blk.1.attn_{x}_b.weight"].data),
                                                        gguf.GGMLQuantizationType.Q8_0)) for x in "kv")
    heads = model.spec.layers[1].attention.num_heads
    expected = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(heads * 64, 32)
    assert torch.equal(model.reader.read(name), expected)
    engine = Engine.from_pretrained(file)
    set_mode(engine, "exact")
    ref = Engine.from_pretrained(dequantized_copy(file, tmp_path / "deq.gguf"))
    assert float((engine.logits(PROMPT) - ref.logits(PROMPT)).abs().max()) <= 1e-3


def legacy_deepseek_copy(src: Path, dst: Path, keep_split: bool) -> Path:
    """``src`` (deepseek2, as the converter writes it now) as converters before the MLA-as-MQA form wrote it: MHA head
    sizes (``head_count_kv`` = heads, ``key_length`` = nope + rope, ``value_length`` = v, no ``*_mla`` keys) and the
    unsplit ``attn_kv_b``; ``keep_split``: ``attn_k_b`` / ``attn_v_b`` kept beside it (files of early 2025)."""
    import gguf

    r = gguf.GGUFReader(str(src))
    value = lambda key: r.fields[f"deepseek2.{key}"].contents()  # noqa: E731
    heads, qk, v = value("attention.head_count"), value("attention.key_length_mla"), value("attention.value_length_mla")
    legacy = {"attention.head_count_kv": heads, "attention.key_length": qk, "attention.value_length": v}
    w = gguf.GGUFWriter(str(dst), "deepseek2")
    for key, field in r.fields.items():
        short = key.removeprefix("deepseek2.")
        if key.startswith("GGUF.") or key == "general.architecture" or short.endswith("_mla") or short in legacy:
            continue
        vtype = field.types[0]
        w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY
                        else None)
    for short, n in legacy.items():
        w.add_uint32(f"deepseek2.{short}", n)
    tensors = {t.name: t for t in r.tensors}
    for t in r.tensors:
        deq = lambda x: gguf.quants.dequantize(np.asarray(x.data), x.tensor_type)  # noqa: E731
        if t.name.endswith("attn_k_b.weight"):  # [H, R, nope] + [H, v, R] → [H·(nope + v), R]
            k_b, v_b = deq(t), deq(tensors[t.name.replace("attn_k_b", "attn_v_b")])
            kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])
            w.add_tensor(t.name.replace("attn_k_b", "attn_kv_b"), kv_b.astype(np.float32))
            if not keep_split:
                continue
        elif t.name.endswith("attn_v_b.weight") and not keep_split:
            continue
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        w.add_tensor(t.name, deq(t).reshape(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("keep_split", [False, True])
def test_deepseek_files_from_before_mla_as_mqa(keep_split: bool, checkpoints: dict, tmp_path: Path) -> None:
    from freetoken_agent.runtime.gguf.model import GGUFModel

    folder, model = checkpoints["deepseek_v3"]
    file = legacy_deepseek_copy(write_gguf(folder, tmp_path / "now.gguf"), tmp_path / "old.gguf", keep_split)
    old = GGUFModel(file)
    assert old.file.arch_get("attention.head_count_kv") == old.config["num_attention_heads"]
    assert ("blk.1.attn_k_b.weight" in old.reader.skipped) == keep_split
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0]
    assert float((Engine.from_pretrained(file).logits(PROMPT) - ref).abs().max()) <= 1e-4


def test_mixed_layer_runs_each_part_as_stored(tmp_path: Path) -> None:
    from freetoken_agent.runtime.gguf.model import GGUFModel

    folder = tmp_path / "hf"
    save_checkpoint("qwen3_moe", folder, seed=3)
    file = write_gguf(folder, tmp_path / "mix.gguf", experts="Q4_0", down="Q8_0")  # a Q4_K_M-like mix
    engine = Engine.from_pretrained(file)
    assert engine.quant.fmt == "q4_0+q8_0"
    assert all(c.rel_rms_error is None for c in GGUFModel(file).measure_conversion())
    assert {f for _, f in GGUFModel(file).expert_plan()} == {"q4_0+q8_0"}
    set_mode(engine, "exact")
    ref = Engine.from_pretrained(file)
    dequantized_reference(ref.decoder)
    assert float((engine.logits(PROMPT) - ref.logits(PROMPT)).abs().max()) <= 1e-3


def test_split_file_loads_from_first_part_and_folder(checkpoints: dict, tmp_path: Path) -> None:
    folder, _ = checkpoints["qwen3_moe"]
    whole = Engine.from_pretrained(write_gguf(folder, tmp_path / "whole.gguf", experts="Q8_0"))
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    write_gguf(folder, split_dir / "m.gguf", experts="Q8_0", split_max_tensors=12)
    parts = sorted(split_dir.glob("*.gguf"))
    assert len(parts) > 2 and parts[0].name.endswith("-00001-of-" + f"{len(parts):05d}.gguf")
    expected = whole.logits(PROMPT)
    for target in (parts[0], split_dir):
        engine = Engine.from_pretrained(resolve_model(str(target)))
        assert torch.equal(engine.logits(PROMPT), expected)
    assert resolve_model(str(split_dir)) == parts[0]
    with pytest.raises(ConfigError, match="part 2 of a split GGUF file; give the first part"):
        resolve_model(str(parts[1]))
    parts[-1].unlink()
    from freetoken_agent.runtime.gguf import GGUFError

    with pytest.raises(GGUFError, match="part\\(s\\) missing"):
        Engine.from_pretrained(parts[0])


def test_resolve_model_file_and_folder(checkpoints: dict, tmp_path: Path) -> None:
    folder, _ = checkpoints["olmoe"]
    file = write_gguf(folder, tmp_path / "o.gguf")
    assert resolve_model(str(file)) == file
    assert resolve_model(str(tmp_path)) == file
    (tmp_path / "mmproj-o.gguf").write_bytes(b"GGUF")  # a vision projector next to it is not a second model
    assert resolve_model(str(tmp_path)) == file
    write_gguf(folder, tmp_path / "other.gguf")
    with pytest.raises(ConfigError, match="holds 2 GGUF models"):
        resolve_model(str(tmp_path))
    with pytest.raises(ConfigError, match="model file not found"):
        resolve_model(str(tmp_path / "nope.gguf"))
