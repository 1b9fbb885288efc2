"""The full-RAM ``quant=`` path: experts quantized once into the expert cache file, mapped from it afterwards.

Evidence that a second load quantized nothing: the process-wide quantization counter does not move, the report
says "not written" and the file's mtime is unchanged. The experts are read into 2 MiB pages (``hugepages.py``), or
with ``FREETOKEN_HUGEPAGES=0`` the file is mapped into this process (``/proc/self/maps``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.experts import mapped
from freetoken_agent.runtime.experts.cache_file import TRAILER, ExpertCacheFile
from freetoken_agent.runtime.experts.core import install, set_expert_mode
from freetoken_agent.runtime.experts.quantized import from_weights
from freetoken_agent.runtime.kernels import build, hugepages
from freetoken_agent.runtime.synthetic import write_synthetic

from tests.runtime.checkpoints import ARCHITECTURES, save_checkpoint

PROMPT = [3, 77, 512, 9, 1000, 41, 5, 260, 18, 700]
SMALL = {"num_hidden_layers": 2, "hidden_size": 128, "moe_intermediate_size": 96, "num_experts": 8}


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("FREETOKEN_CACHE", str(root))
    return root / "experts"


def _model(tmp_path: Path, seed: int = 1) -> Path:
    return write_synthetic("qwen3_moe", tmp_path / f"m{seed}", seed=seed, **SMALL)


def _quantize_in_memory(engine: Engine, fmt: str) -> None:
    """The in-memory source: the engine's loaded float experts quantized where they are."""
    install(engine.decoder, from_weights(engine.decoder.weights, fmt, build.load() is not None)[0])


def _mapped_files() -> str:
    maps = Path("/proc/self/maps")
    return maps.read_text() if maps.is_file() else ""


@pytest.mark.parametrize("quant,pages", [("q4", "2m"), ("q8", "2m"), ("q4", "4k")])
def test_second_load_maps_the_cache_and_quantizes_nothing(
    tmp_path: Path, cache: Path, quant: str, pages: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if pages == "4k":  # without 2 MiB pages the experts stay a copy-on-write mapping of the file
        monkeypatch.setenv("FREETOKEN_HUGEPAGES", "0")
    folder = _model(tmp_path)
    before = mapped.QUANTIZED_EXPERTS[0]
    first = Engine.from_pretrained(folder, quant=quant)
    assert first.quant.written and mapped.QUANTIZED_EXPERTS[0] - before == 2 * 8
    path = first.quant.cache
    assert path is not None and path.parent == cache and path.is_file()
    mtime = path.stat().st_mtime_ns
    logits = first.logits(PROMPT)
    del first

    counted = mapped.QUANTIZED_EXPERTS[0]
    second = Engine.from_pretrained(folder, quant=quant)
    assert not second.quant.written and second.quant.cache == path
    assert mapped.QUANTIZED_EXPERTS[0] == counted and path.stat().st_mtime_ns == mtime
    if _mapped_files():  # read into 2 MiB pages (the file is closed), or mapped
        assert (str(path) in _mapped_files()) == (pages == "4k" or not hugepages.enabled())
    assert torch.equal(second.logits(PROMPT), logits)
    report = second.quant
    assert report.layers == 2 and report.quant_bytes < report.float_bytes / (3.5 if quant == "q8" else 6.5)


def test_mapped_experts_equal_in_memory_quantization(tmp_path: Path, cache: Path) -> None:
    """The file holds what quantizing in memory gives (same rules), so mapped and in-memory engines agree."""
    folder = _model(tmp_path)
    ours = Engine.from_pretrained(folder, quant="q4")
    plain = Engine.from_pretrained(folder)
    _quantize_in_memory(plain, "q4_0")
    for a, b in zip(ours.decoder.experts, plain.decoder.experts, strict=True):
        if a is not None:
            for x, y in zip(a.dequantize(), b.dequantize(), strict=True):
                assert torch.equal(x, y)
    assert float((ours.logits(PROMPT) - plain.logits(PROMPT)).abs().max()) <= 1e-5


def _damage_header(path: Path) -> None:
    path.write_bytes(b"FTEXPRT1" + b"\xff" * 64)


def _truncate(path: Path) -> None:
    with path.open("r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


def _flip_data_byte(path: Path) -> None:
    f = ExpertCacheFile(path)
    off = f.data_start + f.data_bytes // 3
    f.close()
    with path.open("r+b") as fh:
        fh.seek(off)
        byte = fh.read(1)
        fh.seek(off)
        fh.write(bytes([byte[0] ^ 0x5A]))


def _drop_trailer(path: Path) -> None:
    with path.open("r+b") as fh:
        fh.truncate(path.stat().st_size - TRAILER.size)


@pytest.mark.parametrize("damage", [_damage_header, _truncate, _flip_data_byte, _drop_trailer])
def test_damaged_cache_is_rewritten_with_one_warning(
    tmp_path: Path, cache: Path, capfd: pytest.CaptureFixture[str], damage: object
) -> None:
    folder = _model(tmp_path)
    first = Engine.from_pretrained(folder, quant="q4")
    path, logits = first.quant.cache, first.logits(PROMPT)
    del first  # never touched again: its mapping must not read the damaged file
    capfd.readouterr()
    damage(path)  # type: ignore[operator]
    before = mapped.QUANTIZED_EXPERTS[0]
    again = Engine.from_pretrained(folder, quant="q4")
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("freetoken: rewriting the expert cache") and str(path) in err[0]
    assert again.quant.written and mapped.QUANTIZED_EXPERTS[0] - before == 16
    assert torch.equal(again.logits(PROMPT), logits)
    assert ExpertCacheFile(path).verify() is None


def test_changed_checkpoint_gets_a_new_cache_file(tmp_path: Path, cache: Path) -> None:
    folder = _model(tmp_path, seed=1)
    first = Engine.from_pretrained(folder, quant="q4")
    old_path, old_logits = first.quant.cache, first.logits(PROMPT)
    other = _model(tmp_path, seed=2)
    for f in ("model.safetensors", "config.json"):
        os.replace(other / f, folder / f)  # same folder, new weights
    second = Engine.from_pretrained(folder, quant="q4")
    assert second.quant.written and second.quant.cache != old_path
    assert not torch.equal(second.logits(PROMPT), old_logits)
    q8 = Engine.from_pretrained(folder, quant="q8")  # another format: another file
    assert q8.quant.written and q8.quant.cache not in (old_path, second.quant.cache)


def test_unwritable_cache_falls_back_to_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("FREETOKEN_CACHE", str(blocker))
    folder = _model(tmp_path)
    engine = Engine.from_pretrained(folder, quant="q4")
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write the expert cache" in err[0]
    assert engine.quant.cache is None and engine.quant.written
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "ok"))
    assert torch.equal(engine.logits(PROMPT), Engine.from_pretrained(folder, quant="q4").logits(PROMPT))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_maps_what_in_memory_quantization_computes(
    tmp_path: Path, cache: Path, arch: str
) -> None:
    """Per-expert, fused, transposed and biased expert layouts, dense-first layers, shared experts: same logits."""
    save_checkpoint(arch, tmp_path / arch, seed=1)
    ours = Engine.from_pretrained(tmp_path / arch, quant="q4")
    assert ours.quant.cache is not None
    plain = Engine.from_pretrained(tmp_path / arch)
    _quantize_in_memory(plain, "q4_0")
    for engine in (ours, plain):
        set_expert_mode(engine.decoder, "exact")
    prompt = [5, 17, 300, 42, 7, 99, 211, 3]  # vocabulary 512
    assert torch.equal(ours.logits(prompt), plain.logits(prompt))


def test_the_cache_file_does_not_depend_on_the_compute_dtype(tmp_path: Path, cache: Path) -> None:
    folder = _model(tmp_path)
    fp32 = Engine.from_pretrained(folder, quant="q4")
    bf16 = Engine.from_pretrained(folder, quant="q4", dtype="bfloat16")
    assert not bf16.quant.written and bf16.quant.cache == fp32.quant.cache
    out = bf16.logits(PROMPT)
    assert torch.isfinite(out).all() and float((out - fp32.logits(PROMPT)).abs().max()) < 0.5
