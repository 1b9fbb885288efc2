"""A step's working memory stays inside ``workspace.step_bytes``, the bound a memory budget sets aside for it.

A child process loads a synthetic MoE (q4 experts through the C kernels; wide attention so the step's own tensors
stand out of the process's noise), warms it up, then runs prompts of one and several prefill chunks and measures the
peak resident growth of each generation (``VmHWM`` after ``clear_refs``, the heap bounded by ``bound_heap`` so freed
blocks go back to the OS) less the KV the prompt adds. It must be at most the bound for that step size and context.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from freetoken_agent.evals.perf.load_memory import write_bf16_checkpoint
from freetoken_agent.runtime.checkpoint.reader import load_config
from freetoken_agent.runtime.engine import PREFILL_CHUNK
from freetoken_agent.runtime.kernels import build
from freetoken_agent.runtime.model.adapters import spec_from_config
from freetoken_agent.runtime.model.workspace import step_bytes

pytestmark = pytest.mark.skipif(build.load() is None, reason="the fused MoE step needs the C kernels")

CHILD = r"""
import gc, json, sys
from pathlib import Path
import torch
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.memory import bound_heap
model, lengths = json.loads(sys.argv[1])
def status(key):
    return next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith(key + ":"))
bound_heap()
engine = Engine.from_pretrained(Path(model), quant="q4", threads=2, speculate=False)
g = torch.Generator().manual_seed(0)
vocab = engine.spec.vocab_size
engine.generate(torch.randint(3, vocab, (max(lengths),), generator=g).tolist(), max_new_tokens=2)  # warm up
out = []
for n in lengths:
    gc.collect()
    bound_heap()
    Path("/proc/self/clear_refs").write_text("5")
    base = status("VmRSS")
    engine.generate(torch.randint(3, vocab, (n,), generator=g).tolist(), max_new_tokens=2, stop_token_ids=())
    out.append({"prompt": n, "growth": status("VmHWM") - base, "kv": (n + 2) * engine.kv_bytes_per_token()})
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hidden 1024, 16 query heads of 64 over 4 KV heads, 16 experts: ~30 MB of bf16."""
    return write_bf16_checkpoint(tmp_path_factory.mktemp("workspace"), experts=16, layers=2, hidden=1024, inter=128,
                                 num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=4096)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's clear_refs to reset VmHWM")
def test_a_steps_peak_growth_stays_inside_its_bound(wide_model: Path) -> None:
    lengths = [PREFILL_CHUNK, 3 * PREFILL_CHUNK]
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps([str(wide_model), lengths])],
                          capture_output=True, text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    spec = spec_from_config(load_config(wide_model))
    for r in json.loads(line[7:]):
        bound = step_bytes(spec, PREFILL_CHUNK, r["prompt"] + 2)
        used = r["growth"] - r["kv"]
        print(f"prompt {r['prompt']}: step growth {used / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB")
        assert used <= bound, f"a {r['prompt']}-token prompt grew {used / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"
