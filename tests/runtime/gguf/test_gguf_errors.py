"""Bad GGUF files end in a named error, and in a one-line message (no traceback) from the CLI."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.gguf import GGUFArchitectureError, GGUFError, GGUFMetadataError, GGUFTensorTypeError

from tests.runtime.checkpoints import save_checkpoint
from tests.runtime.gguf.writer import write_gguf


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf")
    save_checkpoint("qwen3_moe", folder, seed=4)
    return write_gguf(folder, folder / "good.gguf", experts="Q8_0")


def copy_gguf(src: Path, dst: Path, drop: tuple[str, ...] = (), arch: str | None = None,
              values: dict | None = None) -> Path:
    """``src`` rewritten with metadata keys ``drop`` left out, ``arch`` as the architecture (keys renamed), and
    ``values`` (key → int) set; tensors copied byte for byte."""
    import gguf

    r = gguf.GGUFReader(str(src))
    old = r.fields["general.architecture"].contents()
    new = arch or old
    w = gguf.GGUFWriter(str(dst), new)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop:
            continue
        name = new + key[len(old):] if key.startswith(old + ".") else key
        if name in (values or {}):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for key, value in (values or {}).items():
        w.add_uint32(key, value)
    for t in r.tensors:
        raw = None if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else t.tensor_type
        w.add_tensor(t.name, np.array(t.data), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_truncated(good: Path, tmp_path: Path) -> None:
    data = good.read_bytes()
    for size in (len(data) - 1000, 200, 6):
        bad = tmp_path / f"t{size}.gguf"
        bad.write_bytes(data[:size])
        with pytest.raises(GGUFError, match="truncated"):
            Engine.from_pretrained(bad)


def test_wrong_magic(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        Engine.from_pretrained(bad)


def with_tensor_type(good: Path, out: Path, tensor: str, type_id: int) -> Path:
    """A copy of ``good`` whose ``tensor`` says it is of ggml type ``type_id`` (its data unchanged)."""
    data = bytearray(good.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    out.write_bytes(bytes(data))
    return out


def test_unknown_tensor_type(good: Path, tmp_path: Path) -> None:
    bad = with_tensor_type(good, tmp_path / "type.gguf", "token_embd.weight", 250)  # no ggml type has this id
    with pytest.raises(GGUFTensorTypeError, match="unknown ggml type"):
        Engine.from_pretrained(bad)


def test_unsupported_tensor_type(good: Path, tmp_path: Path) -> None:
    # I32: a valid type, not a weight type (same size)
    bad = with_tensor_type(good, tmp_path / "i32.gguf", "blk.0.ffn_gate_inp.weight", 26)
    with pytest.raises(GGUFTensorTypeError, match="blk.0.ffn_gate_inp.weight has ggml type I32"):
        Engine.from_pretrained(bad)


def test_missing_metadata_key(good: Path, tmp_path: Path) -> None:
    bad = copy_gguf(good, tmp_path / "nokey.gguf", drop=("qwen3moe.block_count",))
    with pytest.raises(GGUFMetadataError, match="'qwen3moe.block_count' is missing"):
        Engine.from_pretrained(bad)


def test_non_moe_architectures(good: Path, tmp_path: Path) -> None:
    with pytest.raises(GGUFArchitectureError, match="'qwen3' is not an MoE architecture"):
        Engine.from_pretrained(copy_gguf(good, tmp_path / "dense.gguf", arch="qwen3"))
    with pytest.raises(GGUFArchitectureError, match="without experts .* is a dense model"):
        Engine.from_pretrained(copy_gguf(good, tmp_path / "llama.gguf", arch="llama", values={"llama.expert_count": 0}))
    with pytest.raises(GGUFArchitectureError, match="'qwen35moe' .* is not supported from GGUF yet"):
        Engine.from_pretrained(copy_gguf(good, tmp_path / "q35.gguf", arch="qwen35moe"))


def test_glm4moe_metadata_it_cannot_run(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    save_checkpoint("glm4_moe", folder, seed=4)
    good = write_gguf(folder, tmp_path / "glm.gguf")  # 3 decoder blocks + 1 multi-token-prediction block
    Engine.from_pretrained(copy_gguf(good, tmp_path / "same.gguf"))
    with pytest.raises(GGUFMetadataError, match="glm4moe with softmax expert gating .* not supported"):
        Engine.from_pretrained(copy_gguf(good, tmp_path / "softmax.gguf", values={"glm4moe.expert_gating_func": 1}))
    with pytest.raises(GGUFMetadataError, match="nextn_predict_layers=4 leaves no decoder layer of 4 blocks"):
        Engine.from_pretrained(copy_gguf(good, tmp_path / "mtp.gguf", values={"glm4moe.nextn_predict_layers": 4}))


def test_deepseek2_metadata_it_cannot_run(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    save_checkpoint("deepseek_v2", folder, seed=4, scoring_func="softmax")
    good = write_gguf(folder, tmp_path / "ds.gguf")
    Engine.from_pretrained(copy_gguf(good, tmp_path / "same.gguf"))
    with pytest.raises(GGUFMetadataError, match="neither attention.key_length_mla nor attn_kv_b .* head sizes are"):
        Engine.from_pretrained(copy_gguf(good, tmp_path / "old.gguf", drop=("deepseek2.attention.key_length_mla",)))
    with pytest.raises(GGUFMetadataError, match="softmax gating and renormalized top-k weights"):
        Engine.from_pretrained(copy_gguf(good, tmp_path / "norm.gguf", values={"deepseek2.expert_weights_norm": 1}))
    with pytest.raises(GGUFMetadataError, match="sigmoid gating but no exp_probs_b.bias"):
        Engine.from_pretrained(copy_gguf(good, tmp_path / "sig.gguf", values={"deepseek2.expert_gating_func": 2}))


def test_roundtrip_copy_still_loads(good: Path, tmp_path: Path) -> None:
    """The copy helper itself changes nothing else (so the failures above are the edits')."""
    Engine.from_pretrained(copy_gguf(good, tmp_path / "same.gguf"))


@pytest.mark.parametrize("command", ["inspect", "generate"])
def test_cli_one_line(good: Path, tmp_path: Path, command: str) -> None:
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good.read_bytes()[:300])
    args = [bad] if command == "inspect" else ["--model", bad, "--prompt", "hi"]
    proc = subprocess.run([sys.executable, "-m", "freetoken_agent.cli", command, *map(str, args)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"freetoken {command}: error: ") and "truncated" in lines[0]
