"""Experts that do not fit: disk-tier streaming under a hard host budget vs plain mmap of the same weights.

One synthetic MoE (random weights, ``qwen3_moe`` shape) whose quantized experts are ``--ratio`` × the expert part of
the host budget. In one process, alternating, on the same expert cache file:

- ``ours``: ``Engine(budget=Budget(host=...))`` — host slot pool sized by the budget, misses read from the cache file
  with ``pread`` (pages dropped after each read, so the page cache holds nothing beyond the budget), gate
  look-ahead prefetch, per policy (``lru``, ``heat``, ``phase``; ``lru/noprefetch`` without look-ahead;
  ``lru/pagecache`` keeps the OS page cache, i.e. reads may come from RAM the budget does not count, as mmap's do;
  ``lru/fast`` lets decode make one fused kernel call over the slot pool although fp32 sums then reorder);
- ``mmap``: the cache file memory-mapped and the same C kernels run over the mapping (the OS page cache decides what
  stays). ``cold``: file pages dropped before the run; the mapping's resident bytes are reported — it is not held to
  the budget (there is no cgroup here), which is exactly the difference.

Prints a markdown table (decode tok/s, host hit rate, prefetch accuracy, disk bytes per token, peak bytes vs budget)
and checks that every run generated the same tokens.

    python -m freetoken_agent.evals.perf.residency_bench --ratio 2.5 --tokens 48 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.evals.perf.harness import row, run_json_main
from freetoken_agent.evals.perf.timing import timed

CODE_PROMPT = '''def read_config(path):
    """Read a JSON config file and return it as a dict; missing files give an empty config."""
    import json, os
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        return json.load(fh)


class Cache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}

    def get(self, key):
'''


def build_model(folder: Path, args: argparse.Namespace) -> Path:
    from freetoken_agent.runtime.synthetic import write_synthetic

    if not (folder / "model.safetensors").is_file():
        write_synthetic("qwen3_moe", folder, seed=0, hidden_size=args.hidden, moe_intermediate_size=args.inter,
                        num_experts=args.experts, num_experts_per_tok=args.top_k, num_hidden_layers=args.layers,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=4096)
    return folder


def mmap_resident(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    try:
        for line in Path("/proc/self/smaps").read_text().splitlines():
            parts = line.split()
            if parts and not parts[0].endswith(":"):  # a mapping header: address range, perms, ..., path
                inside = parts[-1] == str(path)
            elif inside and parts and parts[0] == "Rss:":
                total += int(parts[1]) * 1024
    except OSError:
        return -1
    return total


def install_mmap(engine: Any, file: Any) -> Any:
    """Replace the managed experts by ``QuantizedExperts`` over an mmap of the cache file (OS page cache)."""
    from freetoken_agent.runtime.experts.core import install
    from freetoken_agent.runtime.experts.quantized import quantized_experts

    lay = file.layout
    n = file.data_start + len(file.layers) * file.num_experts * file.stride
    mapped = torch.from_file(str(file.path), shared=True, size=n, dtype=torch.uint8)
    rows = mapped[file.data_start :].view(len(file.layers), file.num_experts, file.stride)
    backends = {}
    for j, layer in enumerate(file.layers):
        views = lay.views(rows[j])
        act = engine.decoder.weights.layers[layer].moe.experts.act  # the loader's empty experts carry it
        backends[layer] = quantized_experts(lay.fmt, views.w13, views.w2, lay.hidden, engine.spec.layers[layer].moe,
                                            act, lay.packed, (views.gate_up_bias, views.down_bias), "mapped")
    install(engine.decoder, backends)
    return mapped


def host_budget(model: Path, quant: str, ratio: float) -> tuple[int, int, int]:
    """(host budget, fixed bytes, expert bytes) such that the quantized experts are ``ratio`` x the budget's expert
    share; the fixed bytes are the dense weights and a step's working memory (the ledger's ``dense`` and ``step``).
    Loading the probe writes the expert cache file once."""
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.memory import Budget

    probe = Engine.from_pretrained(model, quant=quant, budget=Budget())
    held = probe.residency.ledgers["host"].reservations
    dense = held["dense"].nbytes + held["step"].nbytes
    experts = probe.residency.disk.nbytes
    probe.residency.close()
    return dense + int(experts / ratio), dense, experts


def run_one(model: Path, name: str, args: argparse.Namespace, host: int | None, prompt: list[int]) -> dict[str, Any]:
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.experts.setup import ResidencyConfig
    from freetoken_agent.runtime.memory import Budget

    policy, _, variant = name.partition("/")
    mmap = policy == "mmap"
    cfg = ResidencyConfig(policy="lru" if mmap else policy, prefetch=variant != "noprefetch",
                          drop_page_cache=variant != "pagecache", exact=variant != "fast")
    engine = Engine.from_pretrained(model, quant=args.quant, threads=args.threads,
                                    budget=Budget(host=None if mmap else host), residency=cfg)
    store = engine.residency
    mapped = None
    if mmap:
        mapped = install_mmap(engine, store.disk)
        os.posix_fadvise(store.disk._fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold start, like ours
    out, wall = timed(lambda: engine.generate(prompt, max_new_tokens=args.tokens))
    stats = engine.stats()
    res = stats["residency"]
    row = {"run": name, "tokens": out.token_ids, "decode_tok_s": stats["decode_tok_s"], "decode_s": stats["decode_s"],
           "prefill_s": round(out.prefill_s, 2), "wall_s": round(wall, 2)}
    if mmap:
        row.update(hit_rate=None, accuracy=None, disk_mb_per_tok=None,
                   peak_mb=round((res["budget"]["host"]["reservations"]["dense"] + mmap_resident(store.disk.path)) / 1e6, 1))
    else:
        host_t = res["tiers"]["host"]
        row.update(hit_rate=host_t["hit_rate"], accuracy=res["prefetch"]["accuracy"],
                   disk_mb_per_tok=round(res["tiers"]["disk"]["bytes_read"] / 1e6 / (len(prompt) + args.tokens), 2),
                   peak_mb=round(host_t["peak"] / 1e6, 1), peak_bytes=host_t["peak"], stall_s=res["stall_s"])
    store.close()
    del mapped
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", default=None, help="where the synthetic model goes (default: $FREETOKEN_CACHE/...)")
    p.add_argument("--model", default=None,
                   help="a real model folder or 'builtin' (the trained built-in model) instead of the synthetic one; "
                        "the prompt is then code text")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--quant", default="q4", choices=["q4", "q8", "none"])
    p.add_argument("--ratio", type=float, default=2.5, help="quantized experts / expert part of the host budget")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds over --runs (median reported)")
    p.add_argument("--runs", default="mmap,lru,heat,phase,lru/noprefetch,lru/pagecache,lru/fast")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from freetoken_agent.runtime.synthetic import cache_dir

    folder = Path(args.folder) if args.folder else cache_dir() / "bench" / (
        f"residency-h{args.hidden}-i{args.inter}-e{args.experts}-k{args.top_k}-l{args.layers}")
    if args.model:
        from freetoken_agent.runtime.models import resolve_model

        model = folder = resolve_model(args.model)
    else:
        model = build_model(folder, args)
    host, dense, experts = host_budget(model, args.quant, args.ratio)  # writes the expert cache file once
    if args.model:
        from freetoken_agent.runtime.tokenizer import Tokenizer

        prompt = (Tokenizer.from_pretrained(model).encode(CODE_PROMPT) * 64)[: args.prompt]
    else:
        prompt = torch.randint(0, 4096, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"model {folder.name}: {args.quant} experts {experts / 1e6:.1f} MB, dense {dense / 1e6:.1f} MB, "
          f"host budget {host / 1e6:.1f} MB (experts = {args.ratio}x the expert share), {args.threads} thread(s)",
          file=sys.stderr if args.json else sys.stdout)
    names = list(dict.fromkeys(args.runs.split(",")))
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for _ in range(args.rounds):  # alternate the configurations; report the median of each
        for name in args.runs.split(","):
            runs[name].append(run_one(model, name, args, host, prompt))
    rows = []
    for name in names:
        rs = sorted(runs[name], key=lambda r: r["decode_tok_s"] or 0.0)
        med = dict(rs[len(rs) // 2])
        med["decode_tok_s"] = f"{med['decode_tok_s']} ({rs[0]['decode_tok_s']}–{rs[-1]['decode_tok_s']})"
        rows.append(med)
    exact = [n for n in names if not n.endswith("/fast")]  # /fast may reorder fp32 sums: not required to match
    same = all(r["tokens"] == runs[exact[0]][0]["tokens"] for n in exact for r in runs[n])
    if args.json:
        print(json.dumps({"model": str(folder), "quant": args.quant, "host_budget_bytes": host, "dense_bytes": dense,
                          "expert_bytes": experts, "ratio": args.ratio, "same_tokens": same,
                          "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}, indent=1))
        return 0
    print()
    print("| run | decode tok/s, median (min–max) | host hit rate | prefetch accuracy | disk MB/token | peak host MB (budget "
          f"{host / 1e6:.1f}) | stall s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['decode_tok_s']} | {r['hit_rate']} | {r['accuracy']} | {r['disk_mb_per_tok']} | "
              f"{r['peak_mb']} | {r.get('stall_s', '-')} |")
    print(f"\nsame tokens in every run: {'yes' if same else 'NO'}")
    return 0 if same else 1



@row("residency", "experts that do not fit: disk-tier streaming under a hard host budget vs mmap of the same weights, "
     "per residency policy; flags are residency_bench's", passthrough=True)
def residency_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, args.passthrough)


if __name__ == "__main__":
    raise SystemExit(main())
