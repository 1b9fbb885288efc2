"""The fp32 expert kernel (``ops.moe_f32``) over fp32 experts and over the bf16 values they were widened from, side by
side: what keeping a bf16 checkpoint's experts as stored (``experts/core.stored_experts_dtype``) saves a step. Both
compute the same bits (the kernel widens bf16 in registers); the bf16 copy streams half the bytes.

Default shape: the built-in model's MoE layers (6 layers of 16 experts, hidden 256, expert width 112, top-2). Each
round reads ``--flush-mb`` of other memory first (what the rest of a decode step does to the caches), then runs every
layer once per weight dtype, alternating; medians over rounds.

    python -m freetoken_agent.evals.perf.bench_stored16 [--tokens 1,8] [--rounds 30] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from freetoken_agent.evals.perf.harness import row, run_json_main
from freetoken_agent.runtime.kernels import build, ops


def measure(layers: int, experts: int, hidden: int, inter: int, top_k: int, tokens: list[int], rounds: int,
            flush_mb: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """Median ms per step (all layers) for each token count and weight dtype, and the fp32 / bf16 ratio."""
    g = torch.Generator().manual_seed(seed)
    gu16 = [torch.randn(experts, 2 * inter, hidden, generator=g).bfloat16() for _ in range(layers)]
    dn16 = [torch.randn(experts, hidden, inter, generator=g).bfloat16() for _ in range(layers)]
    weights = {"fp32": ([t.float() for t in gu16], [t.float() for t in dn16]), "bf16": (gu16, dn16)}
    flush = torch.randn(max(1, flush_mb << 18))  # flush_mb MB of fp32
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for t in tokens:
            x = torch.randn(t, hidden, generator=g)
            ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(t)])
            wts = torch.rand(t, top_k, generator=g)
            outs = {}
            for name, (gate_up, down) in weights.items():
                flush.sum()
                t0 = time.perf_counter()
                outs[name] = [ops.moe_f32(gate_up[i], down[i], x, ids, wts) for i in range(layers)]
                times.setdefault((name, t), []).append(time.perf_counter() - t0)
            if not all(torch.equal(a, b) for a, b in zip(outs["fp32"], outs["bf16"])):
                raise AssertionError("bf16 experts gave other bits than their fp32 copies")
    out: dict[str, dict[str, float]] = {}
    for t in tokens:
        f32, b16 = (statistics.median(times[(n, t)]) * 1e3 for n in ("fp32", "bf16"))
        out[str(t)] = {"fp32_ms": round(f32, 3), "bf16_ms": round(b16, 3), "speedup": round(f32 / b16, 2)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=112)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", default="1,8", help="rows per step (1: decode, 8: a verify row of 7 drafts)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--flush-mb", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: as they are)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--tokens wants comma-separated integers, got {args.tokens!r}")
    if not tokens or min(tokens) < 1 or min(args.layers, args.experts, args.hidden, args.inter, args.rounds) < 1 \
            or not 1 <= args.top_k <= args.experts:
        ap.error("sizes, --rounds and --tokens must be >= 1, and 1 <= --top-k <= --experts")
    if build.load() is None:
        print("the C kernels are unavailable here (no compiler): nothing to measure")
        return 1
    before = ops.get_threads()
    if args.threads is not None:
        ops.set_threads(args.threads)
    try:
        res = measure(args.layers, args.experts, args.hidden, args.inter, args.top_k, tokens, args.rounds,
                      args.flush_mb)
    finally:
        ops.set_threads(before)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{args.layers} layers x {args.experts} experts (hidden {args.hidden}, width {args.inter}, "
          f"top-{args.top_k}), {args.threads or before} threads, {args.flush_mb} MB read before each step, median of {args.rounds}")
    print("| rows | fp32 experts (ms) | bf16 experts (ms) | speed-up |\n|---|---|---|---|")
    for t, r in res.items():
        print(f"| {t} | {r['fp32_ms']} | {r['bf16_ms']} | {r['speedup']}x |")
    return 0


@row("stored16", "the fp32 expert kernel over fp32 experts and over the bf16 values they were widened from (a bf16 "
     "checkpoint's experts kept as stored); flags are bench_stored16's", passthrough=True)
def stored16_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, args.passthrough)


if __name__ == "__main__":
    raise SystemExit(main())
