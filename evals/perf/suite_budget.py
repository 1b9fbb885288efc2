"""Row ``over-budget`` (suite row ``over_budget_decode``): a model whose q4 experts are 2.5x the host budget's share.

Same weights on both sides (the checkpoint, and its GGUF with our Q4_0 expert blocks byte for byte), same host
budget = dense bytes + experts / ratio, runs alternating, medians:

- ours: ``Engine(budget=Budget(host=...))`` with the default residency (LRU slot pool, gate look-ahead), experts
  streamed from the disk tier with ``pread`` and the cache file's pages dropped after each read — one
  ``residency_bench.run_one`` run;
- llama.cpp: ``--no-repack`` (weights used in place from the ``mmap``; with its default repacking every expert is
  copied into anonymous memory and the model cannot stream at all), the GGUF's resident pages held to the same
  budget by ``suite_llama.MappedBudget`` (method in ``suite_llama.METHOD``; also in the report), as llama.cpp runs
  (the kernel reads around every page fault, up to the disk's ``read_ahead_kb``) and again with ``MADV_RANDOM``
  on the mapping (only the touched pages are read: what a user could tune). Every run starts cold.

Decode tok/s on both sides = (N - 1) / the time of the N - 1 forward steps after the first token (ours: the
engine's decode clock; llama.cpp: the ``next()`` calls of ``Llama.generate``, evictions outside the clock).
``ratio`` = ours / the faster of the two budgeted llama.cpp runs (``ratio_vs_default``, ``ratio_vs_random_access``
give each); ``peer_unbounded_tok_s`` is llama.cpp ``--no-repack`` with the whole file left in the page cache.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from freetoken_agent.evals.perf import bench_gguf_decode, residency_bench
from freetoken_agent.evals.perf.harness import BenchError, row
from freetoken_agent.evals.perf.suite_llama import METHOD, MappedBudget, open_llama, supported
from freetoken_agent.evals.perf.timing import DecodeTiming, timed

# ~0.3 GB: 6 MoE layers x 32 experts (top-4, intermediate 512) at hidden 1024: q4 experts ~170 MB, fp32 dense ~130 MB
QUICK_CONFIG: dict[str, Any] = {**bench_gguf_decode.CONFIG, "hidden_size": 1024, "num_attention_heads": 8,
                                "num_key_value_heads": 2, "head_dim": 128, "num_experts": 32,
                                "num_experts_per_tok": 4, "moe_intermediate_size": 512, "num_hidden_layers": 6}


def _llama_run(llm: Any, guard: MappedBudget, prompt: list[int], tokens: int, mode: str) -> dict[str, Any]:
    """One cold greedy run of ``tokens`` tokens. ``mode``: ``budget`` (the file cut back to the budget every step,
    kernel read-around on), ``budget/random`` (the same with ``MADV_RANDOM``: no read-around) or ``unbounded``."""
    llm.reset()
    guard.drop_all()
    guard.access(mode == "budget/random")
    evicted0, limit = guard.evicted, mode != "unbounded"
    gen = llm.generate(prompt, top_k=1, temp=0.0)
    ids = [next(gen)]
    steps = 0.0
    for _ in range(tokens - 1):
        if limit:
            guard.enforce()
        token, seconds = timed(lambda: next(gen))
        ids.append(token)
        steps += seconds
    gen.close()
    if limit:
        guard.enforce()
    guard.access(False)
    return {"tokens": ids, "decode_tok_s": round(DecodeTiming(tokens - 1, steps).tok_s or 0.0, 2),
            "evicted_mb_per_token": round((guard.evicted - evicted0) / 1e6 / (len(prompt) + tokens), 2)}


def measure(folder: Path, threads: int, tokens: int, rounds: int, ratio: float = 2.5,
            prompt_len: int = 16) -> dict[str, Any]:
    """Alternate ours (disk tier under the budget) and llama.cpp (mmap under the same budget); medians."""
    if tokens < 2:
        raise ValueError("over-budget decode needs at least 2 tokens")
    torch.set_num_threads(threads)
    gguf_path = bench_gguf_decode.ensure_gguf(folder, threads)
    host, dense, experts = residency_bench.host_budget(folder, "q4", ratio)
    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    prompt = torch.randint(259, vocab, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    llm = open_llama(gguf_path, threads, n_ctx=prompt_len + tokens + 16, n_batch=64, repack=False)
    guard = MappedBudget(gguf_path, host)
    args = SimpleNamespace(quant="q4", threads=threads, tokens=tokens)
    modes = {"llama.cpp": "budget", "llama.cpp random": "budget/random", "llama.cpp unbounded": "unbounded"}
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], **{k: [] for k in modes}}
    try:
        for _ in range(rounds):
            row = residency_bench.run_one(folder, "lru", args, host, prompt)
            row["decode_tok_s"] = round(DecodeTiming(tokens - 1, row["decode_s"]).tok_s or 0.0, 2)
            runs["ours"].append(row)
            for label, mode in modes.items():
                peak = guard.peak
                runs[label].append(_llama_run(llm, guard, prompt, tokens, mode))
                if mode == "unbounded":
                    guard.peak = peak  # the unbounded run's residency is not the budgeted peak
        peer_peak = guard.peak
    finally:
        guard.close()
        del llm
    med = {k: statistics.median(r["decode_tok_s"] for r in v) for k, v in runs.items()}
    best = max(med["llama.cpp"], med["llama.cpp random"])  # the ratio is against the faster llama.cpp run
    ours_ids, theirs_ids = runs["ours"][0]["tokens"], runs["llama.cpp"][0]["tokens"]
    agree = next((i for i, (a, b) in enumerate(zip(ours_ids, theirs_ids)) if a != b), min(len(ours_ids), tokens))
    params = bench_gguf_decode.param_count(folder)
    return {
        "params": params, "peer": "llama.cpp Q4_0 mmap --no-repack", "method": METHOD,
        "expert_bytes": experts, "dense_bytes": dense, "host_budget_bytes": host, "experts_over_share": ratio,
        "gguf_bytes": gguf_path.stat().st_size, "tokens": tokens, "prompt_tokens": prompt_len,
        "ours_tok_s": round(med["ours"], 2), "peer_tok_s": round(best, 2), "ratio": round(med["ours"] / best, 3),
        "peer_default_tok_s": round(med["llama.cpp"], 2),
        "ratio_vs_default": round(med["ours"] / med["llama.cpp"], 3),
        "peer_random_access_tok_s": round(med["llama.cpp random"], 2),
        "ratio_vs_random_access": round(med["ours"] / med["llama.cpp random"], 3),
        "peer_unbounded_tok_s": round(med["llama.cpp unbounded"], 2),
        "ours_peak_host_bytes": max(r["peak_bytes"] for r in runs["ours"]),
        "peer_peak_file_bytes": peer_peak,
        "ours_disk_mb_per_token": statistics.median(r["disk_mb_per_tok"] for r in runs["ours"]),
        "peer_evicted_mb_per_token": statistics.median(r["evicted_mb_per_token"] for r in runs["llama.cpp"]),
        "peer_random_access_evicted_mb_per_token": statistics.median(
            r["evicted_mb_per_token"] for r in runs["llama.cpp random"]),
        "ours_host_hit_rate": statistics.median(r["hit_rate"] for r in runs["ours"]),
        "greedy_prefix_agreement": agree,
        "runs": {k: [r["decode_tok_s"] for r in v] for k, v in runs.items()},
    }  # fmt: skip


def options(p: Any) -> None:
    p.add_argument("--model", default=None, help="a qwen3_moe folder (default: the 0.3B synthetic one)")
    p.add_argument("--ratio", type=float, default=2.5, help="q4 experts / the host budget's expert share")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)


@row("over-budget", "decode with the experts 2.5x the host budget: ours (disk tier) vs llama.cpp's mmap held to the "
     "same budget", options)
def over_budget_row(args: Any) -> dict[str, Any]:
    from freetoken_agent.evals.perf import bench_decode
    from freetoken_agent.evals.perf.suite import require_llama_cpp

    if args.tokens < 2 or args.rounds < 1 or args.ratio <= 1:
        raise BenchError("--tokens must be at least 2, --rounds at least 1 and --ratio above 1")
    require_llama_cpp()
    if why := supported():
        raise BenchError(why)
    folder = Path(args.model) if args.model else bench_gguf_decode.write_checkpoint(
        bench_decode.CACHE / "gguf" / "qwen3_moe-budget-quick", config=QUICK_CONFIG)
    if not (folder / "config.json").is_file():
        raise BenchError(f"--model {folder}: no config.json there")
    return measure(folder, args.threads, args.tokens, args.rounds, args.ratio)
