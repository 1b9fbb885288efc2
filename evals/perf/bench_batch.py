"""Batched decode in process: N sequences decoding together through the scheduler vs one, on a synthetic q4 MoE.

What it isolates: the runner's batch (no HTTP, no prefill in the timed part). N greedy requests with different
prompts are submitted at once; once every one has its first token (all prefills done), the time until all have
their ``--tokens`` is the decode time. Reported per N: aggregate decode tok/s, its ratio to N = 1, the mean rows per
step, and the distinct experts each MoE layer read per decode step (a batch of N reads the union of its rows'
experts once: ~26 of 64 for N = 4 at top-8, not 4 × 8). Rounds alternate over N; medians.

    python -m freetoken_agent.evals.perf.bench_batch [--layers 4 | --model DIR] [--n 1,2,4,8] [--tokens 32] [--prompt-len 32]
        [--threads 2] [--rounds 3] [--modes fast,deterministic] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from freetoken_agent.evals.perf.harness import row, run_json_main
from freetoken_agent.evals.perf.timing import timed


def measure(engine: Any, n: int, tokens: int, prompt_len: int, seed: int) -> dict[str, float]:
    """One round at batch ``n``: aggregate decode tok/s, mean rows per step, distinct experts per layer-step."""
    from freetoken_agent.runtime.engine import Request
    from freetoken_agent.runtime.generation.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, engine.spec.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(n)]
    touched: list[int] = []
    observe = lambda layer, ids: touched.append(int(ids.unique().numel())) if ids.shape[0] == n else None  # noqa: E731
    params = SamplingParams(max_new_tokens=tokens + 1, stop_token_ids=())
    handles = [engine.submit(Request(p, params)) for p in prompts]
    streams = [iter(h) for h in handles]
    for s in streams:
        next(s)  # every prefill is done once each has its first token
    steps0, rows0 = engine.scheduler.stats.steps, engine.scheduler.stats.batched_rows
    engine.decoder.routing_observers.append(observe)
    _, seconds = timed(lambda: [h.result() for h in handles])  # n * tokens decode tokens after the first ones
    engine.decoder.routing_observers.remove(observe)
    steps = engine.scheduler.stats.steps - steps0
    rows = engine.scheduler.stats.batched_rows - rows0
    return {"tok_s": n * tokens / seconds, "mean_batch": rows / max(steps, 1),
            "experts_per_layer_step": statistics.mean(touched) if touched else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m freetoken_agent.evals.perf.bench_batch", description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/freetoken-bench-batch", help="where the synthetic checkpoint is cached")
    ap.add_argument("--layers", type=int, default=4, help="layers of the synthetic qwen3_moe (hidden 2048, 64 experts top-8)")
    ap.add_argument("--model", default=None,
                    help="an existing model folder instead (e.g. bench_concurrent's 7.5B: /tmp/freetoken-bench-concurrent/qwen3_moe-7b)")
    ap.add_argument("--n", default="1,2,4,8", help="comma-separated batch sizes")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="fast",
                    help="comma-separated kernel modes, alternated within each round on one engine: fast "
                         "(default kernels), deterministic (batch-invariant, --deterministic)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if not modes or any(m not in ("fast", "deterministic") for m in modes):
        ap.error(f"--modes takes fast and/or deterministic, got {args.modes!r}")

    from freetoken_agent.evals.perf.bench_gguf_decode import CONFIG, write_checkpoint
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.kernels import ops

    if args.model:
        folder = Path(args.model)
        config = json.loads((folder / "config.json").read_text())
        args.layers = config["num_hidden_layers"]
    else:
        config = {**CONFIG, "num_hidden_layers": args.layers}
        folder = write_checkpoint(Path(args.dir) / f"qwen3_moe-l{args.layers}", config=config)
    engine = Engine.from_pretrained(folder, quant="q4", threads=args.threads)
    ns = [int(x) for x in args.n.split(",")]
    runs: dict[tuple[str, int], list[dict[str, float]]] = {(m, n): [] for m in modes for n in ns}
    for m in modes:
        ops.set_deterministic(m == "deterministic")
        measure(engine, 1, 4, args.prompt_len, seed=0)  # warm-up
    for r in range(args.rounds):  # modes and sizes alternate, so drift on a shared machine hits every row alike
        for m in modes:
            ops.set_deterministic(m == "deterministic")
            for n in ns:
                runs[m, n].append(measure(engine, n, args.tokens, args.prompt_len, seed=1000 * r + n))
    ops.set_deterministic(False)
    engine.close()
    rows = []
    for (m, n), got in runs.items():
        med = {k: statistics.median(x[k] for x in got) for k in got[0]}
        rows.append({"mode": m, "n": n, **{k: round(v, 2) for k, v in med.items()}})
    first = {m: next(r["tok_s"] for r in rows if r["mode"] == m) for m in modes}
    fast = {r["n"]: r["tok_s"] for r in rows if r["mode"] == "fast"}
    for r in rows:
        r["vs_n1"] = round(r["tok_s"] / first[r["mode"]], 2)
        if r["mode"] != "fast" and r["n"] in fast:
            r["vs_fast"] = round(r["tok_s"] / fast[r["n"]], 2)
    experts = config["num_experts"] * 3 * config["hidden_size"] * config["moe_intermediate_size"] * args.layers
    if args.json:
        print(json.dumps({"rows": rows, "layers": args.layers, "expert_params": experts}))
        return 0
    print(f"qwen3_moe ({folder}), {args.layers} layers, {experts / 1e9:.2f}B expert params at q4, "
          f"{args.threads} threads, {args.tokens} tokens after a {args.prompt_len}-token prompt, {args.rounds} rounds")
    print("| mode | N | decode tok/s (aggregate) | vs N=1 | vs fast | mean rows/step | experts read per layer-step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        vs_fast = f"{r['vs_fast']}x" if "vs_fast" in r else "-"
        print(f"| {r['mode']} | {r['n']} | {r['tok_s']} | {r['vs_n1']}x | {vs_fast} | {r['mean_batch']} | "
              f"{r['experts_per_layer_step']} |")
    return 0




@row("batch", "batched decode in one process: N sequences through the scheduler vs one (aggregate tok/s, experts read per step); flags are bench_batch's", passthrough=True)
def batch_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, args.passthrough)

if __name__ == "__main__":
    raise SystemExit(main())
