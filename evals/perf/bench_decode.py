"""Decode throughput of our engine vs ``transformers.generate`` on the same checkpoint, side by side.

Checkpoints are built with transformers (random weights, fp32) and cached. Runs alternate A/B so machine noise
hits both; each run times ``generate`` of 1 and of N+1 greedy tokens after the same prompt, and decode tok/s is
N / (t(N+1) - t(1)). Medians over rounds; the ratio is ours / transformers.

    python -m freetoken_agent.evals.perf.bench_decode [--models tiny,mid] [--rounds 3] [--tokens 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

# name -> (architecture, transformers config overrides)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": ("qwen3_moe", dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    # ~0.7B parameters: Qwen3-MoE shape scaled down (32 experts, top-4)
    "mid": ("qwen3_moe", dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                              num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
                              num_experts_per_tok=4, moe_intermediate_size=512, norm_topk_prob=True)),
}


def build(name: str, root: Path) -> Path:
    import transformers

    arch, overrides = MODELS[name]
    folder = root / f"{name}-{arch}"
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(arch, max_position_embeddings=4096, bos_token_id=None,
                                               eos_token_id=None, pad_token_id=None, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(folder: Path, rounds: int, tokens: int, prompt_len: int) -> dict[str, Any]:
    import transformers

    from freetoken_agent.runtime.engine import Engine

    engine = Engine.from_pretrained(folder, threads=torch.get_num_threads())
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    params = sum(p.numel() for p in ref.parameters())
    prompt = torch.randint(0, engine.spec.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0))

    def ours(n: int) -> None:
        engine.generate(prompt, max_new_tokens=n, stop_token_ids=[])

    def theirs(n: int) -> None:
        with torch.no_grad():
            ref.generate(prompt[None], do_sample=False, max_new_tokens=n, min_new_tokens=n)

    ours(2), theirs(2)  # warm-up
    rates: dict[str, list[float]] = {"ours": [], "transformers": []}
    for _ in range(rounds):
        for label, fn in (("ours", ours), ("transformers", theirs)):
            dt = _time(lambda: fn(tokens + 1)) - _time(lambda: fn(1))
            rates[label].append(tokens / max(dt, 1e-9))
    same = engine.generate(prompt, max_new_tokens=8, stop_token_ids=[]).token_ids == \
        ref.generate(prompt[None], do_sample=False, max_new_tokens=8)[0, prompt_len:].tolist()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"params": params, "ours_tok_s": med["ours"], "transformers_tok_s": med["transformers"],
            "ratio": med["ours"] / med["transformers"], "greedy_identical": same,
            "runs": rates, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,mid")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache", default=str(Path(os.environ.get("FREETOKEN_CACHE", Path.home() / ".cache" / "freetoken")) / "bench"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from freetoken_agent.runtime.threads import configure_threads

    configure_threads(args.threads)
    results = {}
    for name in args.models.split(","):
        folder = build(name, Path(args.cache))
        results[name] = measure(folder, args.rounds, args.tokens, args.prompt_len)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode tok/s, fp32 CPU, {torch.get_num_threads()} thread(s), median of {args.rounds}")
    for col in ("model", "params", "ours", "transformers", "ours / transformers", "greedy identical"):
        table.add_column(col)
    for name, r in results.items():
        table.add_row(name, f"{r['params'] / 1e6:.1f}M", f"{r['ours_tok_s']:.1f}", f"{r['transformers_tok_s']:.1f}",
                      f"{r['ratio']:.2f}×", str(r["greedy_identical"]))
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
