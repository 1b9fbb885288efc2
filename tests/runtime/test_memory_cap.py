"""A budgeted process under a real memory cap: ``--host-memory X`` fits in X plus the stated floor.

A child process (``sys.executable -c``) loads a synthetic MoE — first load (the expert cache file is written from the
bf16 checkpoint), a greedy generation, the engine closed, a second (warm) load and a generation — under a hard cap of
``budget + PROCESS_FLOOR_MB``, and must finish with the tokens of an unbudgeted engine. The model is shaped like the
case that was killed before (a 7.8B model, ``--host-memory 0.8GB --quant-dense q4``: 1.56 GB of anonymous memory at a
1.5 GB cap): its experts are ~3x the slots the budget leaves them, and its dense weights in fp32 (168 MB) are more than the budget plus the
floor's slack, quantized (q8: ~48 MB) well inside it — so the load must quantize them layer by layer as it reads them.
A second model runs a prompt of several prefill chunks under the cap: its KV pool grows by taking bytes from an expert
pool of ~130 MB mid-generation (the pool shrinks), so a step that held the old pool while it filled the new one
(measured before: 2x the pool for a whole step) is killed.

The cap, in order of preference:

- a cgroup memory limit (v2 ``memory.max``, else v1 ``memory.limit_in_bytes``) where this machine lets the test make
  one. It counts what the kernel's OOM killer acts on: resident anonymous memory *and* page cache (the checkpoint and
  cache-file pages the load reads or writes), so it is the real thing. Cap = budget + floor, no extra margin.
- else ``RLIMIT_DATA`` (a process cannot lower a cgroup it does not own). It counts private writable address space,
  not resident memory: every thread's 8 MiB stack and glibc's per-thread malloc arenas are counted in full although
  little of them is touched. Measured here (``evals/perf/load_memory.py``): peak ``VmData`` runs ~190 MiB above peak
  ``RssAnon`` (456 vs 264 MiB for a 100 MB budget), so the limit is budget + floor + ``DATA_MARGIN`` (256 MiB).
  ``RLIMIT_AS`` is no use: torch's shared libraries alone map ~700 MiB of address space before any work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from freetoken_agent.evals.perf.load_memory import write_bf16_checkpoint
from freetoken_agent.runtime.checkpoint.reader import CheckpointReader, load_config
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.experts.setup import ResidencyConfig, minimum_memory
from freetoken_agent.runtime.kernels import build
from freetoken_agent.runtime.memory import PROCESS_FLOOR_MB, Budget, BudgetTooSmallError
from freetoken_agent.runtime.model.adapters import spec_from_config

BUDGET = 130 * 10**6  # dense weights ~48 MB + a step's working memory ~50 MB + ~32 MB of expert slots
DATA_MARGIN = 256 * 2**20
PROMPT = list(range(3, 40))
NEW = 16
pytestmark = pytest.mark.skipif(build.load() is None, reason="quantized experts and dense weights need the C kernels")
QUANT = "q8"
LONG_BUDGET = 210 * 10**6
LONG_PROMPT = [3 + i * 7919 % 1000 for i in range(600)]

CHILD = r"""
import gc, json, sys
from pathlib import Path
model, cache, budget, quant, prompt, new = json.loads(sys.argv[1])
def peak_mib():
    return next(int(x.split()[1]) // 1024 for x in open("/proc/self/status") if x.startswith("VmHWM"))
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.experts.setup import ResidencyConfig
from freetoken_agent.runtime.memory import Budget
runs = []
for phase in ("cold", "warm"):
    engine = Engine.from_pretrained(model, quant=quant, dense_quant=quant, budget=Budget(host=budget),
                                    residency=ResidencyConfig(cache_path=Path(cache)))
    tokens = engine.generate(prompt, max_new_tokens=new, stop_token_ids=()).token_ids
    runs.append({"phase": phase, "written": Path(cache).is_file(), "tokens": tokens,
                 "peak": engine.residency.ledgers["host"].peak, "moves": len(engine.residency.ledgers["host"].moves),
                 "rss_mib": peak_mib()})
    engine.close()
    del engine
    gc.collect()
print("RESULT " + json.dumps(runs))
"""


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~450 MB of bf16: 8 layers of 64 experts of 3 x 1024 x 128 (201M parameters: ~214 MB of Q8_0 experts for the
    ~110 MB expert pool of a 210 MB budget) and 16-head attention (32 KiB of fp32 KV per token)."""
    return write_bf16_checkpoint(tmp_path_factory.mktemp("capped-long"), experts=64, layers=8, hidden=1024,
                                 inter=128, num_attention_heads=16, num_key_value_heads=4)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~290 MB of bf16: 16 layers of 16-head attention (42M parameters: 168 MB in fp32) and 32 experts of
    3 x 1024 x 64 each (100M parameters: ~107 MB of Q8_0 experts for a 130 MB budget, ~32 MB of it expert slots)."""
    return write_bf16_checkpoint(tmp_path_factory.mktemp("capped"), experts=32, layers=16, hidden=1024, inter=64,
                                 num_attention_heads=16, num_key_value_heads=4)


def _slot_room(model: Path, budget: int) -> int:
    """Bytes a budget leaves the expert slots (and the KV) after the q8 dense weights and a step's working memory."""
    m = minimum_memory(spec_from_config(load_config(model)), CheckpointReader(model), torch.float32, "cpu", QUANT,
                       dense_quant=QUANT)
    assert m is not None
    return budget - m.dense_bytes - m.step_bytes


def _cgroup(cap: int, tmp: Path) -> Path | None:
    """A fresh cgroup limited to ``cap`` bytes, or None where none can be made here."""
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")
    for root, limit in ((v2, "memory.max"), (v1, "memory.limit_in_bytes")):
        if not (root / limit).exists() and not (root / "cgroup.procs").exists():
            continue
        group = root / f"freetoken-test-{os.getpid()}-{tmp.name}"
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            (group / limit).write_text(str(cap))
            (group / "cgroup.procs").stat()
            return group
        except OSError:
            group.rmdir()
    return None


def _run_capped(model: Path, cache: Path, budget: int, prompt: list[int], tmp: Path) -> tuple[list[dict], str]:
    """Cold and warm budgeted loads of ``model``, each generating ``NEW`` tokens after ``prompt``, in a child under a
    cap of ``budget`` + ``PROCESS_FLOOR_MB``; returns what each run reported and how the cap was set."""
    cap = budget + PROCESS_FLOOR_MB * 10**6
    try:  # the C library is compiled once per install, outside any engine's budget: cc1 alone peaks ~260 MB
        build.build()  # (into this test's $FREETOKEN_CACHE, where the child looks for it)
    except RuntimeError:
        pass  # no compiler: the child runs on the torch fallback, as a user's engine would
    group = _cgroup(cap, tmp)
    if group is not None:
        enter = f"open({str(group / 'cgroup.procs')!r}, 'w').write(str(__import__('os').getpid()))\n"
        how = f"cgroup {group}"
    else:
        limit = cap + DATA_MARGIN
        enter = f"import resource; resource.setrlimit(resource.RLIMIT_DATA, ({limit}, {limit}))\n"
        how = "RLIMIT_DATA"
    payload = json.dumps([str(model), str(cache), budget, QUANT, prompt, NEW])
    try:
        proc = subprocess.run([sys.executable, "-c", enter + CHILD, payload], capture_output=True, text=True,
                              timeout=600)
    finally:
        if group is not None:
            group.rmdir()
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, (
        f"the capped child ({how}, cap {cap / 2**20:.0f} MiB) failed with exit status {proc.returncode} "
        f"(-9: killed for memory): {proc.stderr[-2000:]}")
    return json.loads(line[7:]), how


def test_budgeted_loads_and_generation_fit_under_a_hard_cap(model: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "ftcache"))
    size = (model / "model.safetensors").stat().st_size
    assert size > 2 * BUDGET  # the checkpoint is far bigger than the budget
    cache = tmp_path / "experts.ftx"
    runs, how = _run_capped(model, cache, BUDGET, PROMPT, tmp_path)
    reference = Engine.from_pretrained(model, quant=QUANT, dense_quant=QUANT).generate(
        PROMPT, max_new_tokens=NEW, stop_token_ids=()).token_ids
    assert [r["phase"] for r in runs] == ["cold", "warm"] and all(r["written"] for r in runs)
    assert cache.stat().st_size > 2 * _slot_room(model, BUDGET)  # the experts did not fit: they streamed from the file
    for r in runs:
        assert r["tokens"] == reference, f"{r['phase']} load under {how} generated other tokens"
        assert r["peak"] <= BUDGET


@pytest.fixture(scope="module")
def gguf_model(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``model`` as a GGUF file with Q8_0 experts and dense weights (156 MB: its ~107 MB of experts are the
    experts' blocks the budgeted load streams into the expert cache file)."""
    pytest.importorskip("gguf")
    from tests.runtime.gguf.writer import write_gguf

    return write_gguf(model, tmp_path_factory.mktemp("capped-gguf") / "model.gguf", experts="Q8_0", dense="Q8_0")


def test_budgeted_gguf_loads_and_generation_fit_under_a_hard_cap(model: Path, gguf_model: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for a GGUF file: the first load writes the expert cache file from the file's Q8_0 blocks (read one
    expert at a time), the second reuses it."""
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "ftcache"))
    cache = tmp_path / "experts.ftx"
    runs, how = _run_capped(gguf_model, cache, BUDGET, PROMPT, tmp_path)
    reference = Engine.from_pretrained(gguf_model, quant=QUANT, dense_quant=QUANT).generate(
        PROMPT, max_new_tokens=NEW, stop_token_ids=()).token_ids
    assert cache.stat().st_size > 2 * _slot_room(model, BUDGET)  # the experts streamed from the cache file
    for r in runs:
        assert r["tokens"] == reference, f"{r['phase']} load of the GGUF file under {how} generated other tokens"
        assert r["peak"] <= BUDGET


def test_long_prompt_fits_under_a_hard_cap(long_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two prefill chunks and a decode, the KV growing out of the expert pool's bytes as the prompt fills it."""
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "ftcache"))
    cache = tmp_path / "experts.ftx"
    runs, how = _run_capped(long_model, cache, LONG_BUDGET, LONG_PROMPT, tmp_path)
    reference = Engine.from_pretrained(long_model, quant=QUANT, dense_quant=QUANT).generate(
        LONG_PROMPT, max_new_tokens=NEW, stop_token_ids=()).token_ids
    assert cache.stat().st_size > _slot_room(long_model, LONG_BUDGET)
    for r in runs:
        assert r["moves"] > 0, "the KV pool never took bytes from the expert pool: the prompt is too short"
        assert r["tokens"] == reference, f"{r['phase']} load under {how} generated other tokens"
        assert r["peak"] <= LONG_BUDGET


def test_budget_below_the_minimum_is_refused_before_loading(model: Path, tmp_path: Path) -> None:
    spec = spec_from_config(load_config(model))
    reader = CheckpointReader(model)
    minimum = minimum_memory(spec, reader, torch.float32, "cpu", "q8_0")
    assert minimum is not None
    need = minimum.need("host")
    cache = tmp_path / "experts.ftx"
    with pytest.raises(BudgetTooSmallError, match=rf"too small for this model; it needs at least .*--host-memory"):
        Engine.from_pretrained(model, quant=QUANT, budget=Budget(host=need - 1),
                               residency=ResidencyConfig(cache_path=cache))
    assert not cache.exists()  # refused before the expert cache file was written
    with pytest.raises(BudgetTooSmallError, match="dense weights alone"):
        Engine.from_pretrained(model, quant=QUANT, budget=Budget(host=minimum.dense_bytes // 2))
    # at the minimum the load goes through, and the dense weights it counted are what the load claims
    engine = Engine.from_pretrained(model, quant=QUANT, budget=Budget(host=need),
                                    residency=ResidencyConfig(cache_path=cache))
    assert engine.residency.ledgers["host"].reservations["dense"].nbytes == minimum.dense_bytes
    assert engine.stats()["residency"]["tiers"]["host"]["slots"] == minimum.slots


def test_minimum_counts_dense_weights_quantized_at_load(model: Path) -> None:
    spec = spec_from_config(load_config(model))
    minimum = minimum_memory(spec, CheckpointReader(model), torch.float32, "cpu", "q8_0", dense_quant="q8")
    assert minimum is not None
    engine = Engine.from_pretrained(model, quant="q8", dense_quant="q8", budget=Budget(host=10**9))
    assert engine.residency.ledgers["host"].reservations["dense"].nbytes == minimum.dense_bytes
    assert engine.dense_quant is not None and engine.dense_quant.weights == 16 * 4 + 1  # q, k, v, o per layer + head
