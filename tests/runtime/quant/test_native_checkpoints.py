"""FP8-block (DeepSeek/Qwen3 FP8 layout) and MXFP4 (GPT-OSS layout) checkpoints, built here from tiny models in the
real on-disk layout, load without a conversion step and match an engine over their dequantized values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.quant import dequantize_fp8_block, dequantize_mxfp4, quantize_fp8_block, quantize_mxfp4
from freetoken_agent.runtime.quant.native import NativeQuantReader, open_checkpoint
from freetoken_agent.runtime.synthetic import write_synthetic

PROMPT = [5, 17, 300, 42, 7, 99, 511, 3]


def _rewrite(folder: Path, quantized: Path, reference: Path, convert) -> None:  # type: ignore[no-untyped-def]
    """Write ``quantized`` (native layout) and ``reference`` (its dequantized values, plain fp32) from ``folder``."""
    tensors = load_file(str(next(folder.glob("*.safetensors"))))
    q_tensors, r_tensors, qcfg = convert(tensors)
    for out, ts in ((quantized, q_tensors), (reference, r_tensors)):
        shutil.copytree(folder, out)
        for f in out.glob("*.safetensors*"):
            f.unlink()
        save_file(ts, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (quantized / "config.json").write_text(json.dumps(cfg))


def _fp8(tensors: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    q, r = {}, {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight") and t.dim() == 2:
            w, s = quantize_fp8_block(t.float())
            q[name], q[name.replace(".weight", ".weight_scale_inv")] = w, s
            r[name] = dequantize_fp8_block(w, s)
        else:
            q[name] = r[name] = t
    return q, r, {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


def _mxfp4(tensors: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    q, r = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(t.float().transpose(-1, -2))  # stored [E, rows, K/32, 16]
            q[name + "_blocks"], q[name + "_scales"] = blocks, scales
            r[name] = dequantize_mxfp4(blocks, scales).transpose(-1, -2).contiguous()
        else:
            q[name] = r[name] = t
    return q, r, {"quant_method": "mxfp4"}


def test_fp8_block_checkpoint_loads_and_matches_reference(tmp_path: Path) -> None:
    # hidden 256, heads 4 x 64: q/k/v/o and expert projections span several 128x128 blocks and partial ones
    src = write_synthetic("qwen3_moe", tmp_path / "src", seed=4, num_hidden_layers=2, moe_intermediate_size=96)
    _rewrite(src, tmp_path / "fp8", tmp_path / "ref", _fp8)
    reader = open_checkpoint(tmp_path / "fp8")
    assert isinstance(reader, NativeQuantReader) and reader.is_quantized
    assert not any(n.endswith("weight_scale_inv") for n in reader.infos)
    ours = Engine.from_pretrained(tmp_path / "fp8").logits(PROMPT)
    ref = Engine.from_pretrained(tmp_path / "ref").logits(PROMPT)
    assert float((ours - ref).abs().max()) <= 1e-4


def test_mxfp4_checkpoint_loads_and_matches_reference(tmp_path: Path) -> None:
    from tests.runtime.checkpoints import save_checkpoint

    save_checkpoint("gpt_oss", tmp_path / "src", seed=5)
    _rewrite(tmp_path / "src", tmp_path / "mx", tmp_path / "ref", _mxfp4)
    reader = open_checkpoint(tmp_path / "mx")
    assert isinstance(reader, NativeQuantReader)
    name = next(n for n in reader.infos if n.endswith("experts.gate_up_proj"))
    ref_tensors = load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert reader.shape(name) == tuple(ref_tensors[name].shape)
    assert torch.equal(reader.get_row(name, 1), ref_tensors[name][1])
    ours = Engine.from_pretrained(tmp_path / "mx").logits(PROMPT[:6])
    ref = Engine.from_pretrained(tmp_path / "ref").logits(PROMPT[:6])
    assert float((ours - ref).abs().max()) <= 1e-4


def test_plain_checkpoints_keep_the_plain_reader(tmp_path: Path) -> None:
    src = write_synthetic("qwen3_moe", tmp_path / "src", seed=4, num_hidden_layers=1)
    assert type(open_checkpoint(src)).__name__ == "CheckpointReader"
