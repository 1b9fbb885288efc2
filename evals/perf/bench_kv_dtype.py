"""Decode speed after a long prompt with the KV cache in fp32, bf16 and fp16, in one process, and the decode attention
kernel's time per call over 1k / 4k / 8k cached keys.

Models: the built-in model, and a synthetic Qwen3-MoE with the attention of the 7.8B one in issue 22 (hidden 2048,
24 layers, 32 query / 4 KV heads of 128: ~98 KB of fp32 KV per position) but 8 small experts (so KV reads are a
large share of a step), experts and dense weights at q4. One engine per KV dtype, all loaded at once; each round
runs every engine in turn (machine noise hits all three): a greedy request over the same prompt, whose full pages
come from the radix cache after the first round, then ``--tokens`` decode steps; decode tok/s = (tokens - 1) /
decode seconds (``timing.DecodeTiming``). Medians over rounds.

    nice -n 10 python -m freetoken_agent.evals.perf.bench_kv_dtype [--prompt 4096] [--tokens 32] [--rounds 3]
        [--models builtin,synthetic] [--kernel-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.evals.perf.harness import row, run_json_main
from freetoken_agent.evals.perf.timing import DecodeTiming, timed

DTYPES = ("fp32", "bf16", "fp16")
SYNTHETIC = dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=1024,
                 max_position_embeddings=16384)


def kernel_times(h: int, hkv: int, dh: int, reps: int = 30) -> list[str]:
    """Best µs per ``ops.attn_decode`` call for each cache dtype at 1k / 4k / 8k keys (k and v distinct tensors)."""
    from freetoken_agent.runtime.kernels import ops

    lines = [f"kernel attn_decode, H={h} Hkv={hkv} Dh={dh}, {ops.get_threads()} pool threads (best of {reps}, µs):"]
    for s in (1024, 4096, 8192):
        q = torch.randn(h, dh)
        k32, v32 = torch.randn(s, hkv, dh), torch.randn(s, hkv, dh)
        caches = {"fp32": (k32, v32), "bf16": (k32.bfloat16(), v32.bfloat16()), "fp16": (k32.half(), v32.half())}
        best = dict.fromkeys(caches, float("inf"))
        for _ in range(reps):
            for name, (k, v) in caches.items():
                best[name] = min(best[name], timed(lambda: ops.attn_decode(q, k, v, dh**-0.5))[1])
        lines.append(f"  S={s:5d}: " + "  ".join(f"{n} {b * 1e6:8.0f}" for n, b in best.items())
                     + f"  (fp32/fp16 {best['fp32'] / best['fp16']:.2f}x, fp32/bf16 {best['fp32'] / best['bf16']:.2f}x)")
    return lines


def decode_rates(folder: Path, prompt_len: int, tokens: int, rounds: int, **load: object) -> dict[str, list[float]]:
    from freetoken_agent.runtime.engine import Engine

    engines = {kv: Engine.from_pretrained(folder, kv_dtype=kv, **load) for kv in DTYPES}  # type: ignore[arg-type]
    vocab = engines["fp32"].spec.vocab_size
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    rates: dict[str, list[float]] = {kv: [] for kv in DTYPES}
    for _ in range(rounds + 1):  # the first round prefills the prompt into each engine's radix cache
        for kv, engine in engines.items():
            r = engine.generate(prompt, max_new_tokens=tokens, temperature=0.0, stop_token_ids=[])
            rates[kv].append(DecodeTiming.from_generation(r).tok_s)
    for engine in engines.values():
        engine.close()
    return {kv: r[1:] for kv, r in rates.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="builtin,synthetic")
    ap.add_argument("--kernel-only", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"kernel": kernel_times(32, 4, 128) + kernel_times(4, 2, 64), "decode": {}}
    if not args.json:
        print("\n".join(report["kernel"]), flush=True)
    if args.kernel_only:
        if args.json:
            print(json.dumps(report, indent=1))
        return 0
    from freetoken_agent.runtime.builtin import builtin_model_dir
    from freetoken_agent.runtime.synthetic import cache_dir, write_synthetic

    for name in args.models.split(","):
        if name == "builtin":
            folder, load = builtin_model_dir(), {}
        else:
            folder = cache_dir() / "synthetic" / "kv-bench-qwen3_moe-24L-2048"
            if not (folder / "model.safetensors").is_file():
                write_synthetic("qwen3_moe", folder, **SYNTHETIC)
            load = {"quant": "q4", "dense_quant": "q4"}
        rates = decode_rates(folder, args.prompt, args.tokens, args.rounds, **load)
        med = {kv: statistics.median(r) for kv, r in rates.items()}
        report["decode"][name] = {"prompt": args.prompt, "tokens": args.tokens, "median_tok_s": med, "runs": rates}
        if args.json:
            continue
        print(f"{name}: decode tok/s after a {args.prompt}-token prompt ({args.tokens} tokens, median of "
              f"{args.rounds}): " + "  ".join(f"{kv} {med[kv]:.1f} {[round(x, 1) for x in rates[kv]]}" for kv in DTYPES)
              + f"  (fp16/fp32 {med['fp16'] / med['fp32']:.2f}x, bf16/fp32 {med['bf16'] / med['fp32']:.2f}x)",
              flush=True)
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


@row("kv-dtype", "decode after a long prompt with the KV cache in fp32, bf16 and fp16, and the decode attention "
     "kernel per KV length; flags are bench_kv_dtype's", passthrough=True)
def kv_dtype_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, args.passthrough)


if __name__ == "__main__":
    raise SystemExit(main())
