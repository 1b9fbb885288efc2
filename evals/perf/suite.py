"""``freetoken bench suite [--quick] [--json]``: our engine against its peers on the same weights, in one run.

Rows (each a pairwise comparison, runs alternating A/B in one process, medians):

- ``cpu_decode_q4``: a ~1.3B-parameter random ``qwen3_moe`` (64 experts, top-8, Qwen3-30B-A3B expert shape),
  ours with Q4_0 experts vs llama.cpp (``llama-cpp-python``) on the same weights written as GGUF Q4_0
  (``bench_gguf_decode``); the ratio ours / llama.cpp is ``cpu_decode_ratio_vs_llamacpp``.
- ``cpu_decode_fp32``: ours vs ``transformers.generate`` on the same fp32 checkpoint (``bench_decode``).
- ``bandwidth_fraction``: bytes one decode step of the q4 model reads (dense fp32 weights but the embedding,
  8 experts x 4 layers at Q4_0, KV) x our tok/s, over the machine's streaming-read limit measured here (a ``torch``
  sum over 512 MiB on all cores, best of 7). On compute-bound CPUs the kernels top out near 55%
  (``../shared/CPU-KERNELS.md``).
- peak host memory of the process (``ru_maxrss``); this CPU machine has no device tier.

``--quick``: 16 tokens, 3 rounds, the 0.1B transformers model; the full run: 32 tokens, 5 rounds, the 0.7B one.
The JSON (``--out``, default ``$FREETOKEN_CACHE/bench/suite.json``) holds every run.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_gbps(threads: int, nbytes: int = 512 << 20, rounds: int = 7) -> float:
    """Streaming-read GB/s: ``sum`` over a buffer far larger than the caches (best of ``rounds``: the limit)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4)
        buf.sum()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            buf.sum()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return nbytes / min(times) / 1e9


def decode_bytes_per_token(config: dict[str, Any], context: int) -> int:
    """Bytes one decode step reads for ``config`` with Q4_0 experts and fp32 dense weights (``capacity``)."""
    from freetoken_agent.runtime.execution.capacity import model_size

    size = model_size(config, "q4")
    return size.dense_read_bytes + size.active_expert_bytes + size.kv_bytes(context)


def run(quick: bool = True, threads: int = 1, root: Path | None = None,
        progress: Callable[[str], None] | None = None, q4_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run every comparison; returns the JSON report. ``q4_config``: another ``qwen3_moe`` shape for the llama.cpp
    row (vocab >= 8192; tests use a small one), default ``bench_gguf_decode.CONFIG``."""
    import torch
    from freetoken_agent.evals.perf import bench_decode, bench_gguf_decode

    say = progress or (lambda s: None)
    root = root or Path(os.environ.get("FREETOKEN_CACHE", Path.home() / ".cache" / "freetoken")) / "bench"
    tokens, rounds = (16, 3) if quick else (32, 5)
    t_start = time.perf_counter()
    report: dict[str, Any] = {
        "command": "freetoken bench suite" + (" --quick" if quick else ""),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "load_avg_1m": round(os.getloadavg()[0], 2)},
        "threads": threads, "tokens": tokens, "rounds": rounds, "rows": {},
    }  # fmt: skip
    from freetoken_agent.runtime.hardware import describe

    report["machine"]["cpu"] = describe()[1]["model"]
    say("q4 decode: ours vs llama.cpp on the same GGUF Q4_0 weights (writes the 1.3B checkpoint once)")
    q4_config = q4_config or bench_gguf_decode.CONFIG
    tag = "qwen3_moe-1b" if q4_config is bench_gguf_decode.CONFIG else f"qwen3_moe-d{q4_config['hidden_size']}"
    folder = bench_gguf_decode.write_checkpoint(root / "gguf" / tag, config=q4_config)
    g = bench_gguf_decode.measure(folder, threads, tokens, rounds)
    report["rows"]["cpu_decode_q4"] = {"ours_tok_s": g["ours_tok_s"], "peer": "llama.cpp Q4_0",
                                       "peer_tok_s": g["llama_cpp_tok_s"], "ratio": g["ratio"], "runs": g["rates"],
                                       "params": g["params"], "greedy_prefix_agreement": g["greedy_prefix_agreement"]}
    say("fp32 decode: ours vs transformers")
    name = "tiny" if quick else "mid"
    torch.set_num_threads(threads)
    d = bench_decode.measure(bench_decode.build(name, root / "decode"), rounds, tokens, 32)
    report["rows"]["cpu_decode_fp32"] = {"ours_tok_s": round(d["ours_tok_s"], 2), "peer": "transformers fp32",
                                         "peer_tok_s": round(d["transformers_tok_s"], 2), "ratio": round(d["ratio"], 3),
                                         "runs": d["runs"], "params": d["params"],
                                         "greedy_identical": d["greedy_identical"]}
    say("streaming-read bandwidth (all cores: the machine's limit)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gbps = read_gbps(cores)
    per_token = decode_bytes_per_token(q4_config, 32 + tokens)
    ours_frac = per_token * g["ours_tok_s"] / (gbps * 1e9)
    peer_frac = per_token * g["llama_cpp_tok_s"] / (gbps * 1e9)
    report["rows"]["bandwidth"] = {"read_gbps": round(gbps, 2), "read_threads": cores, "bytes_per_token": per_token,
                                   "ours_fraction": round(ours_frac, 3), "llama_cpp_fraction": round(peer_frac, 3)}
    report["peak_host_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report["cpu_decode_ratio_vs_llamacpp"] = g["ratio"]
    report["bandwidth_fraction"] = round(ours_frac, 3)
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    return report


def format_table(r: dict[str, Any]) -> str:
    """One markdown table of the report."""
    rows = r["rows"]
    head = (f"`{r['command']}` — {r['date']}, {r['machine']['cpu']} ({r['machine']['cores']} cores, load "
            f"{r['machine']['load_avg_1m']}), {r['threads']} thread(s), {r['tokens']} tokens, median of "
            f"{r['rounds']} alternating rounds, {r['wall_s']} s")
    lines = [head, "", "| comparison | params | ours tok/s | peer | peer tok/s | ours / peer |", "|---|---|---|---|---|---|"]
    for key in ("cpu_decode_q4", "cpu_decode_fp32"):
        x = rows[key]
        params = f"{x['params'] / 1e9:.2f}B" if x["params"] >= 1e8 else f"{x['params'] / 1e6:.1f}M"
        lines.append(f"| {key} | {params} | {x['ours_tok_s']:.2f} | {x['peer']} | "
                     f"{x['peer_tok_s']:.2f} | {x['ratio']:.2f}x |")
    b = rows["bandwidth"]
    lines.append(f"| bandwidth fraction (q4 decode) | | {b['ours_fraction']:.0%} | llama.cpp | "
                 f"{b['llama_cpp_fraction']:.0%} | of {b['read_gbps']:.1f} GB/s read ({b['read_threads']} threads), "
                 f"{b['bytes_per_token'] / 2**20:.0f} MiB/token |")
    lines.append(f"| peak host memory | | {r['peak_host_bytes'] / 2**30:.2f} GiB | | | |")
    return "\n".join(lines)


def write_json(report: dict[str, Any], out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return out


def add_cli_args(p: Any) -> None:
    """``freetoken bench suite`` flags."""
    p.add_argument("--quick", action="store_true", help="16 tokens, 3 rounds, small transformers model (<= 10 min)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    p.add_argument("--threads", type=int, default=1, help="threads for every engine (default 1)")
    p.add_argument("--out", default=None, help="where the JSON goes (default $FREETOKEN_CACHE/bench/suite.json)")


def cli_run(args: Any) -> int:
    """Run the suite from parsed flags; print the table (or JSON) and write the JSON file."""
    import sys

    from freetoken_agent.cli import CLIError

    threads = getattr(args, "threads", 1)
    if threads < 1:
        raise CLIError(f"--threads must be at least 1, got {threads}")
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError:
        raise CLIError("the suite needs the llama.cpp peer: pip install llama-cpp-python gguf") from None
    report = run(bool(args.quick), threads, progress=None if args.json else lambda s: print(s, file=sys.stderr))
    root = Path(os.environ.get("FREETOKEN_CACHE", Path.home() / ".cache" / "freetoken")) / "bench"
    out = write_json(report, Path(args.out) if getattr(args, "out", None) else root / "suite.json")
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_table(report))
        print(f"JSON: {out}", file=sys.stderr)
    return 0
