"""Load-time quantization rate: our expert-cache writer against llama.cpp's ``llama-quantize`` on the same model.

One synthetic bf16 ``qwen3_moe`` checkpoint (``load_memory.write_bf16_checkpoint``). Ours: the first budgeted load's
expert cache file (every routed expert read from the checkpoint, quantized by the C quantizer on the kernels' thread
pool, written) — timed around ``open_or_write`` in a fresh process. llama.cpp: the same checkpoint as a BF16 GGUF
(written like ``convert_hf_to_gguf.py`` by ``tests/runtime/gguf/writer.py``), then ``llama-quantize --pure`` to the
same format with the same thread count (every tensor, dense ones included: it quantizes ~2% more parameters on the
small model, ~4% on the 7.5B). Reports wall and CPU seconds and routed-expert parameters per second for both; each side's source file is dropped
from the page cache first (both read it from disk).

    PYTHONPATH=. python -m freetoken_agent.evals.perf.quantize_rate --quant q4 --threads 2 \\
        --llama-quantize /tmp/freetoken-llama-server/build/bin/llama-quantize [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from freetoken_agent.evals.perf.harness import row, run_json_main
from freetoken_agent.evals.perf.load_memory import write_bf16_checkpoint

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
model, cache, quant, threads = json.loads(sys.argv[1])
from freetoken_agent.runtime.kernels import ops
import freetoken_agent.runtime.experts.setup as setup
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.memory import Budget
ops.set_threads(threads)
timing = {}
write = setup.open_or_write
def timed(*args, **kwargs):
    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    out = write(*args, **kwargs)
    c1 = resource.getrusage(resource.RUSAGE_SELF)
    timing.update(wall_s=time.perf_counter() - t0, cpu_s=c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime,
                  threads=ops.get_threads())
    return out
setup.open_or_write = timed
Engine.from_pretrained(model, quant=quant, threads=threads, budget=Budget(host=10**12),
                       residency=setup.ResidencyConfig(cache_path=Path(cache)))
print("RESULT " + json.dumps(timing))
"""


def drop_cached(files: list[Path]) -> None:
    """Drop ``files``' clean pages from the page cache, so each side reads its source from disk (cold), not from
    what the other side or an earlier run left in memory."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def ours(model: Path, quant: str, threads: int) -> dict[str, float]:
    drop_cached(sorted(model.glob("*.safetensors")))
    with tempfile.TemporaryDirectory() as tmp:
        payload = json.dumps([str(model), str(Path(tmp) / "experts.ftx"), quant, threads])
        proc = subprocess.run([sys.executable, "-c", CHILD, payload], capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"our load failed: {proc.stderr[-1500:]}")
    return json.loads(line[7:])


def llama(binary: Path, model: Path, quant: str, threads: int) -> dict[str, float]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ lives beside the package
    from tests.runtime.gguf.writer import write_gguf

    src = model / "model-bf16.gguf"
    if not src.is_file():
        write_gguf(model, src, experts="BF16", dense="BF16")
    drop_cached([src])
    with tempfile.TemporaryDirectory() as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run([str(binary), "--pure", str(src), str(Path(tmp) / "out.gguf"),
                               {"q4": "Q4_0", "q8": "Q8_0"}[quant], str(threads)], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"llama-quantize failed: {proc.stderr[-1500:]}")
    return {"wall_s": wall, "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
            "threads": threads}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--quant", default="q4", choices=["q4", "q8"])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--llama-quantize", default="/tmp/freetoken-llama-server/build/bin/llama-quantize")
    p.add_argument("--folder", default=str(Path(tempfile.gettempdir()) / "ft-load-memory"))
    p.add_argument("--model", help="an existing bf16 qwen3_moe folder instead of the synthetic one (e.g. the 7.5B of "
                   "`bench_concurrent prepare`); its BF16 GGUF is written beside it once")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.model:
        model = Path(args.model)
        cfg = json.loads((model / "config.json").read_text())
        experts, layers, hidden, inter = (cfg["num_experts"], cfg["num_hidden_layers"], cfg["hidden_size"],
                                          cfg["moe_intermediate_size"])
    else:
        experts, layers, hidden, inter = args.experts, args.layers, args.hidden, args.inter
        name = f"qwen3_moe-e{experts}-l{layers}-h{hidden}-i{inter}-a4-2"
        model = write_bf16_checkpoint(Path(args.folder) / name, experts, layers, hidden, inter)
    params = 3 * hidden * inter * experts * layers
    rows = {"ours (expert cache write)": ours(model, args.quant, args.threads)}
    binary = Path(args.llama_quantize)
    if binary.is_file():
        rows["llama-quantize --pure"] = llama(binary, model, args.quant, args.threads)
    if args.json:
        print(json.dumps({"model": model.name, "expert_params": params, "quant": args.quant, "threads": args.threads,
                          "quantizers": {k: {**r, "mparams_per_s": round(params / r["wall_s"] / 1e6, 1),
                                             "mparams_per_cpu_s": round(params / r["cpu_s"] / 1e6, 1)}
                                         for k, r in rows.items()},
                          "llama_quantize": str(binary) if binary.is_file() else None}, indent=1))
        return 0
    print(f"{model.name}: {params / 1e6:.0f}M expert parameters, {args.quant}, {args.threads} threads")
    print("| quantizer | wall s | CPU s | M params/s (wall) | M params/CPU-s |")
    print("|---|---|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {params / r['wall_s'] / 1e6:.1f} | "
              f"{params / r['cpu_s'] / 1e6:.1f} |")
    return 0



@row("quantize-rate", "load-time quantization rate: our expert-cache writer vs llama-quantize on the same checkpoint; "
     "flags are quantize_rate's", passthrough=True)
def quantize_rate_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, args.passthrough)


if __name__ == "__main__":
    raise SystemExit(main())
