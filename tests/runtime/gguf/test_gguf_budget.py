"""A GGUF model under a memory budget: its experts stream through the expert cache file as a folder's do.

Tiny random checkpoints written as GGUF in the test (``writer.py``), loaded with a host budget that holds a third of
the experts, so experts are evicted and read back from the cache file:

- Q4_K gate/up + Q6_K down (a Q4_K_M file), the same with Q4_K down in one layer (a real Q4_K_M file's per-layer mix:
  the cache file holds each layer's layout), Q8_0, and Q8_0 + Q5_0 down (converted to Q8_0 at load): greedy tokens
  and logits bitwise those of the unbudgeted GGUF load, on the load that writes the cache file and on the one that
  reuses it; the cache holds the bytes the unbudgeted load runs, expert for expert (native blocks as stored);
- the cache file is keyed by the GGUF file and the formats: another file or ``quant`` gets its own;
- a budget below what the model needs is refused with the folder's one-line error, before anything is written;
- ``freetoken generate --model FILE.gguf --host-memory ...`` (a real subprocess) generates the unbudgeted tokens.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from freetoken_agent.runtime.checkpoint.reader import CheckpointReader, load_config
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.experts.cache_file import ExpertCacheFile
from freetoken_agent.runtime.experts.setup import ResidencyConfig, minimum_memory
from freetoken_agent.runtime.gguf import open_gguf
from freetoken_agent.runtime.memory import Budget, BudgetTooSmallError
from freetoken_agent.runtime.model.adapters import spec_from_config

from tests.runtime.checkpoints import save_checkpoint
from tests.runtime.gguf.writer import write_gguf

pytest.importorskip("gguf")
PROMPTS = [list(range(5, 35)), [400, 12, 99, 250, 7, 7, 7, 301, 2], [3, 1, 4, 1, 5, 9, 2, 6]]
NEW = 12
SLOTS = 8
"""Host expert slots the budget leaves room for: a third of the 3 layers x 8 experts."""
FILES = {"q4_k_m": ("Q4_K", "Q6_K"), "q4_k_m_layers": None, "q8_0": ("Q8_0", None), "q5_0_down": ("Q8_0", "Q5_0")}
"""File kind → (expert type, down type) as written; ``q4_k_m_layers`` is ``q4_k_m`` with layer 1's down as Q4_K."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE checkpoint whose rows are whole K-quant super-blocks (256 values)."""
    out = tmp_path_factory.mktemp("hf")
    save_checkpoint("qwen3_moe", out, seed=4, hidden_size=256, moe_intermediate_size=256, head_dim=64)
    return out


@pytest.fixture(scope="module")
def files(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for kind, types in FILES.items():
        if types is not None:
            out[kind] = write_gguf(folder, root / f"{kind}.gguf", experts=types[0], down=types[1], dense="Q8_0")
    out["q4_k_m_layers"] = retype_down(out["q4_k_m"], root / "q4_k_m_layers.gguf", layer=1, kind="Q4_K")
    return out


def retype_down(src: Path, dst: Path, layer: int, kind: str) -> Path:
    """``src`` with ``blk.{layer}.ffn_down_exps`` requantized to ``kind`` (a K-quant), every other tensor copied as
    stored (what llama.cpp's Q4_K_M does to some layers' down)."""
    import gguf
    from freetoken_agent.runtime.quant.formats import block_format

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = {"sub_type": field.types[-1]} if field.types[0] == gguf.GGUFValueType.ARRAY else {}
        w.add_key_value(key, field.contents(), field.types[0], **sub)
    for t in r.tensors:
        if t.name == f"blk.{layer}.ffn_down_exps.weight":
            shape = tuple(int(s) for s in reversed(t.shape.tolist()))
            values = torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)).reshape(-1, shape[-1])
            blocks = block_format(kind).quantize_rows(values).reshape(*shape[:-1], -1)
            w.add_tensor(t.name, blocks.numpy(), raw_dtype=gguf.GGMLQuantizationType[kind])
        elif t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(t.name, np.array(t.data))
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def host_budget(file: Path, quant: str = "none", slots: int = SLOTS) -> int:
    """Host bytes for the dense weights, a step's working memory, the KV pool's first growth step and ``slots``
    expert slots."""
    model = open_gguf(file)
    need = minimum_memory(model.spec, model.reader, torch.float32, "cpu", quant, gguf=model)
    assert need is not None
    kv = Engine.from_pretrained(file).kv_bytes_per_token() * 16 * 16
    return need.dense_bytes + need.step_bytes + kv + slots * need.slot_bytes


def budgeted(file: Path, host: int | None, cache: Path, quant: str = "none") -> Engine:
    return Engine.from_pretrained(file, quant=quant, budget=Budget(host=host),
                                  residency=ResidencyConfig(policy="lru", cache_path=cache))


@pytest.mark.parametrize("kind", list(FILES))
def test_budgeted_gguf_matches_unbudgeted_cold_and_warm(kind: str, files: dict[str, Path], tmp_path: Path) -> None:
    file = files[kind]
    ref = Engine.from_pretrained(file)
    assert ref.quant is not None  # the unbudgeted load runs the file's blocks
    want = [ref.generate(p, max_new_tokens=NEW).token_ids for p in PROMPTS]
    host, cache = host_budget(file), tmp_path / "experts.ftx"
    for phase in ("cold", "warm"):
        before = cache.stat() if phase == "warm" else None
        engine = budgeted(file, host, cache)
        assert cache.is_file()
        if before is not None:  # reused: not rewritten (a rewrite renames a new file into place)
            after = cache.stat()
            assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        assert [engine.generate(p, max_new_tokens=NEW).token_ids for p in PROMPTS] == want, phase
        assert torch.equal(engine.logits(PROMPTS[0]), ref.logits(PROMPTS[0])), phase  # bitwise
        engine.residency.drain()
        host_tier = engine.stats()["residency"]["tiers"]["host"]
        assert host_tier["slots"] < 24 and host_tier["peak"] <= host
        assert host_tier["misses"] > host_tier["slots"] and host_tier["evictions"] > 0  # experts were read back
        caps = {b.capabilities for b in engine.decoder.experts if b is not None}
        assert {c.placement for c in caps} == {"managed"}
        assert {c.formats for c in caps} == {b.capabilities.formats for b in ref.decoder.experts if b is not None}
    check_cache_holds_the_unbudgeted_bytes(ExpertCacheFile(cache), ref)


def check_cache_holds_the_unbudgeted_bytes(disk: ExpertCacheFile, ref: Engine) -> None:
    """Every expert's blob in ``disk`` holds the bytes ``ref``'s backends run, gate/up and down alike."""
    for layer in disk.layers:
        backend = ref.decoder.experts[layer]
        layout = disk.layout_of(layer)
        assert layout.formats == (backend.fmt, backend.down_fmt) and layout.packed == backend.packed
        row = torch.empty(1, disk.stride, dtype=torch.uint8)
        for e in range(disk.num_experts):
            disk.read_into(layer, e, row[0])
            views = layout.views(row)
            assert torch.equal(views.w13[0], backend.w13[e]) and torch.equal(views.w2[0], backend.w2[e])


def test_layers_keep_their_own_formats_in_the_cache_file(files: dict[str, Path], tmp_path: Path) -> None:
    budgeted(files["q4_k_m_layers"], None, tmp_path / "experts.ftx")
    disk = ExpertCacheFile(tmp_path / "experts.ftx")
    assert {layer: disk.layout_of(layer).formats for layer in disk.layers} == {
        0: ("q4_k", "q6_k"), 1: ("q4_k", "q4_k"), 2: ("q4_k", "q6_k")}
    assert disk.layout == disk.layout_of(0)  # the slots are the size of the widest layer's blobs
    assert disk.layout_of(1).blob_bytes < disk.layout.blob_bytes


def test_cache_file_is_keyed_by_file_and_formats(files: dict[str, Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path))
    made = lambda: sorted(p.name for p in (tmp_path / "experts").glob("*.ftx"))  # noqa: E731
    loads = [(files["q4_k_m"], "none"), (files["q8_0"], "none"), (files["q4_k_m"], "q8"),
             (files["q4_k_m_layers"], "none"), (files["q4_k_m"], "none")]
    counts = []
    for file, quant in loads:
        engine = Engine.from_pretrained(file, quant=quant, budget=Budget())
        counts.append(len(made()))
        if quant == "q8":
            assert {b.capabilities.formats for b in engine.decoder.experts if b is not None} == {("q8_0",)}
    assert counts == [1, 2, 3, 4, 4]  # the last load reuses the first one's file


def test_too_small_a_budget_is_the_folders_one_line_error(folder: Path, files: dict[str, Path],
                                                          tmp_path: Path) -> None:
    def refusal(path: Path, host: int) -> str:
        with pytest.raises(BudgetTooSmallError) as info:
            budgeted(path, host, tmp_path / "experts.ftx")
        assert not (tmp_path / "experts.ftx").exists()  # refused before the expert cache file was written
        message = str(info.value)
        assert "\n" not in message
        return re.sub(r"\d+(\.\d+)?( ?[KMGT]i?B)?", "#", message)  # sizes differ: the dense weights stay blocks

    file = files["q4_k_m"]
    model = open_gguf(file)
    gguf_need = minimum_memory(model.spec, model.reader, torch.float32, "cpu", "none", gguf=model)
    folder_min = minimum_memory(spec_from_config(load_config(folder)), CheckpointReader(folder), torch.float32,
                                "cpu", "none")
    assert gguf_need is not None and folder_min is not None
    # the dense projections stay in their stored Q8_0 blocks (~1/4 of fp32), the rest is the folder's fp32
    assert folder_min.dense_bytes / 4 < gguf_need.dense_bytes < folder_min.dense_bytes / 2
    assert gguf_need.slot_bytes < folder_min.slot_bytes / 4  # slots sized for the file's blocks, not fp32 experts
    for gguf_host, folder_host in ((gguf_need.need("host") - 1, folder_min.need("host") - 1),
                                   (gguf_need.dense_bytes // 2, folder_min.dense_bytes // 2)):
        assert refusal(file, gguf_host) == refusal(folder, folder_host)
    assert "too small for this model; it needs at least" in refusal(file, gguf_need.need("host") - 1)
    assert "dense weights alone" in refusal(file, gguf_need.dense_bytes // 2)
    engine = budgeted(file, gguf_need.need("host"), tmp_path / "experts.ftx")  # the minimum itself loads
    assert engine.stats()["residency"]["tiers"]["host"]["slots"] == gguf_need.slots


def _cli(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FREETOKEN_CACHE": str(cache), "FREETOKEN_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "freetoken_agent.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, check=False)


def test_generate_cli_under_a_host_budget(files: dict[str, Path], tmp_path: Path) -> None:
    file = files["q4_k_m"]
    args = ("generate", "--model", str(file), "--prompt-ids", "5,6,7,8,9,10", "--max-new-tokens", "8", "--json")
    plain = _cli(*args, cache=tmp_path)
    assert plain.returncode == 0, plain.stderr
    host = host_budget(file)
    r = _cli(*args, "--host-memory", f"{host}B", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == json.loads(plain.stdout)["token_ids"]
    res = out["stats"]["residency"]
    assert res["tiers"]["host"]["peak"] <= host and res["tiers"]["host"]["slots"] < 24
    assert res["tiers"]["disk"]["bytes_read"] > 0 and len(list((tmp_path / "experts").glob("*.ftx"))) == 1
    small = _cli(*args, "--host-memory", "100KB", cache=tmp_path)
    assert small.returncode == 2 and "budget" in small.stderr and "Traceback" not in small.stderr


@pytest.mark.parametrize(("arch", "kind"), [("gpt_oss", "MXFP4"), ("glm4_moe", "Q4_0")])
def test_other_architectures_under_a_budget(arch: str, kind: str, tmp_path: Path) -> None:
    """GPT-OSS's MXFP4 experts with their biases; GLM-4.5's shared experts and dense first layer (MoE layers from 1)."""
    from tests.runtime.gguf.models import varied_checkpoint

    varied_checkpoint(arch, tmp_path / "hf", seed=3)
    file = write_gguf(tmp_path / "hf", tmp_path / "m.gguf", experts=kind)
    ref = Engine.from_pretrained(file)
    assert ref.quant is not None
    engine = budgeted(file, host_budget(file, slots=4), tmp_path / "experts.ftx")
    for p in PROMPTS:
        assert engine.generate(p, max_new_tokens=NEW).token_ids == ref.generate(p, max_new_tokens=NEW).token_ids
    assert torch.equal(engine.logits(PROMPTS[0]), ref.logits(PROMPTS[0]))
    engine.residency.drain()
    assert engine.stats()["residency"]["tiers"]["host"]["evictions"] > 0
    check_cache_holds_the_unbudgeted_bytes(engine.residency.disk, ref)
