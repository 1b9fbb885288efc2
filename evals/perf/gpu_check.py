"""GPU check (one command, ≤ 5 minutes): a Qwen3-30B-A3B-shaped MoE at 4 bit under an 8 GB device budget.

Random weights, built in place (no download, no 60 GB checkpoint): dense weights random on the GPU in bf16, the 6,144
routed experts written once as Q4_0 blobs into an expert cache file (16 distinct random experts, repeated). Then,
in one process, decode tok/s for:

- ``lru`` and ``heat`` with the adaptive planner (cold experts fetched or computed on the CPU, per cost model);
- ``lru-fetch``: every cold expert copied to a device slot (the reference server's behaviour);
- ``cpu-moe``: every routed expert on the CPU, dense on the GPU (``--n-cpu-moe``-style static placement);
- the phase-aware run (``phase_gpu``): a synthetic agent session (plan / code / tool pauses) with the host tier at
  ``--phase-host`` of the expert bytes, ``PhaseScheduler`` (staging on hints, prefetch during pauses) vs LRU:
  misses at phase switches (``--phase-turns 0`` skips it).

    python -m freetoken_agent.evals.perf.gpu_check                 # on a machine with a GPU
    python -m freetoken_agent.evals.perf.gpu_check --cpu-dry-run   # tiny shape, simulated device tier (CI/CPU)
    freetoken bench gpu-check [--cpu-dry-run]                      # the same, recorded in the bench history
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.evals.perf.harness import BenchError, module_main, row
from freetoken_agent.evals.perf.timing import DecodeTiming

QWEN3_30B_A3B: dict[str, Any] = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False, hidden_act="silu",
)
TINY = dict(QWEN3_30B_A3B, vocab_size=1024, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4)


def random_dense(spec: Any, device: str, dtype: torch.dtype) -> Any:
    """Dense weights with the loader's exact names and shapes, random (norms at one), experts left empty."""
    from freetoken_agent.runtime.model import weights as weights_mod
    from freetoken_agent.runtime.model.moe import TorchExperts

    gen = torch.Generator(device="cpu").manual_seed(0)

    class RandomLoader(weights_mod._Recorder):
        def take(self, name: str, shape: tuple[int, ...], dt: torch.dtype | None = None) -> torch.Tensor:
            if "norm" in name:
                return torch.ones(shape, device=device, dtype=dt or dtype)
            t = torch.randn(shape, generator=gen) * (1.0 / shape[-1]) ** 0.5
            return t.to(device=device, dtype=dt or dtype)

        def experts(self, prefix: str, m: Any, names: Any, d: int) -> TorchExperts:
            empty = torch.empty(0, dtype=dtype)
            return TorchExperts(m, empty, empty)

    return weights_mod.walk_weights(spec, RandomLoader(), None)


def write_experts(path: Path, spec: Any, layout: Any, moe_layers: list[int]) -> Any:
    """The expert cache file: 16 distinct random Q4_0 experts, repeated over every (layer, expert)."""
    from freetoken_agent.runtime.checkpoint.experts import ExpertTensors
    from freetoken_agent.runtime.experts.cache_file import (
        ExpertCacheFile,
        write_cache_file,
    )

    moe = spec.layers[moe_layers[0]].moe
    if not path.is_file():
        d, i = spec.hidden_size, moe.intermediate
        gen = torch.Generator().manual_seed(1)
        blobs = [layout.encode(ExpertTensors(torch.randn(2 * i, d, generator=gen) / d**0.5,
                                             torch.randn(d, i, generator=gen) / i**0.5)) for _ in range(16)]
        write_cache_file(path, _Encoded(layout, blobs), moe_layers, moe.num_experts,  # type: ignore[arg-type]
                         lambda layer, e: (layer * 7 + e) % 16)  # type: ignore[arg-type,return-value]
    return ExpertCacheFile(path)


class _Encoded:
    """A layout stand-in whose ``encode(k)`` returns pre-quantized blob ``k`` (6,144 experts written in seconds)."""

    def __init__(self, layout: Any, blobs: list[torch.Tensor]) -> None:
        self.layout, self.blobs = layout, blobs
        self.blob_bytes = layout.blob_bytes

    def encode(self, k: int) -> torch.Tensor:
        return self.blobs[k]

    def to_json(self) -> dict[str, object]:
        return self.layout.to_json()


def run_config(name: str, spec: Any, weights: Any, disk_path: Path, args: argparse.Namespace, device: str,
               prompt: list[int]) -> dict[str, Any]:
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.experts.cache_file import ExpertCacheFile
    from freetoken_agent.runtime.experts.core import install
    from freetoken_agent.runtime.experts.loader import tensor_bytes
    from freetoken_agent.runtime.experts.setup import Managed, ResidencyConfig, build_store
    from freetoken_agent.runtime.memory import Budget, parse_bytes
    from freetoken_agent.runtime.model.decoder import Decoder

    policy, planner = {"lru": ("lru", "adaptive"), "heat": ("heat", "adaptive"), "lru-fetch": ("lru", "fetch"),
                       "cpu-moe": ("lru", "host")}[name]
    cfg = ResidencyConfig(policy=policy, planner=planner, device_tier=name != "cpu-moe", prefetch=True,
                          simulate_device=args.cpu_dry_run and name != "cpu-moe")
    budget = Budget(device=parse_bytes(args.device_memory), host=parse_bytes(args.host_memory))
    ledgers = budget.ledgers()
    ledgers["host" if device == "cpu" else "device"].reserve("dense", tensor_bytes(weights))
    ledgers["host"].reserve("kv", 0)
    top_k = spec.layers[-1].moe.top_k
    store, plan = build_store(ExpertCacheFile(disk_path), ledgers, top_k, device, cfg)
    engine = Engine(spec, Decoder(spec, weights, device), None, None)
    install(engine.decoder, Managed(weights, store, plan, ledgers, spec, 0, False).backends())
    engine.residency = store
    engine.generate(prompt[:8], max_new_tokens=4)  # warm-up: kernels, caches, slot pools
    t0 = time.perf_counter()
    out = engine.generate(prompt, max_new_tokens=args.tokens)
    wall = time.perf_counter() - t0
    stats = engine.stats()
    res = stats["residency"]
    store.close()
    rate = DecodeTiming.from_generation(out).tok_s
    return {"run": name, "decode_tok_s": round(rate, 2) if rate else None,
            "prefill_s": round(out.prefill_s, 2), "wall_s": round(wall, 1), "planner": res["planner"],
            "device_hit_rate": res["tiers"].get("device", {}).get("hit_rate"),
            "host_hit_rate": res["tiers"]["host"]["hit_rate"], "stall_s": res["stall_s"],
            "peak": {t: v["peak"] for t, v in res["budget"].items()}, "limits": {t: v["limit"] for t, v in res["budget"].items()},
            "tokens": out.token_ids}


def options(p: argparse.ArgumentParser) -> None:
    from freetoken_agent.evals.perf import phase_gpu

    p.add_argument("--device-memory", default="8GB")
    p.add_argument("--host-memory", default="24GB")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--runs", default="lru,heat,lru-fetch,cpu-moe")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than 48 (a quicker, smaller check)")
    p.add_argument("--cache", default=None, help="folder for the expert cache file (default $FREETOKEN_CACHE)")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    p.add_argument("--cpu-dry-run", action="store_true", help="tiny shape on the CPU with a simulated device tier")
    phase_gpu.add_flags(p)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def format_report(r: dict[str, Any], args: argparse.Namespace | None = None) -> str:
    """The decode table, the phase-aware table and the budget verdict."""
    lines = ["| run | decode tok/s | planner (resident/fetch/host) | device hit rate | stall s |", "|---|---|---|---|---|"]
    for x in r["rows"]:
        pl = x["planner"]
        lines.append(f"| {x['run']} | {x['decode_tok_s']} | {pl['resident']}/{pl['fetch']}/{pl['host']} | "
                     f"{x['device_hit_rate']} | {x['stall_s']} |")
    phase = r["phase"]
    if phase:
        a = r["phase_args"]
        lines += ["", f"phase-aware run: {a['turns']} agent turns ({a['warm']} warm-up), host tier "
                  f"{a['host']:.0%} of the expert bytes, {a['pause']} s tool pauses",
                  "| run | switch misses (plan/code) | host misses | host hit rate | stall s | bytes read in pauses | "
                  "decode tok/s |", "|---|---|---|---|---|---|---|"]
        for x in phase["rows"]:
            sm = x["switch_misses"]
            lines.append(f"| {x['run']} | {x['switch_total']} ({sm.get('plan', 0)}/{sm.get('code', 0)}) | "
                         f"{x['host_misses']} | {x['host_hit_rate']} | {x['stall_s']} | {x['pause_bytes']} | "
                         f"{x['decode_tok_s']} |")
        lines.append(f"phase_switch_miss_reduction: {phase['phase_switch_miss_reduction']}")
    over = r["over_budget"]
    lines += ["", f"budgets respected: {'yes' if not over else 'NO: ' + ', '.join(over)}; total {r['wall_s']:.0f} s"]
    return "\n".join(lines)


def _headline(r: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {x["run"]: x["decode_tok_s"] for x in r["rows"]}
    if r["phase"]:
        out["phase_switch_miss_reduction"] = r["phase"]["phase_switch_miss_reduction"]
    out["budgets_respected"] = not r["over_budget"]
    return out


@row("gpu-check", "GPU check: a Qwen3-30B-A3B-shaped q4 MoE under an 8 GB device budget, per residency policy "
     "(--cpu-dry-run: tiny, simulated device)", options, format=format_report, headline=_headline,
     check=lambda r: not r["over_budget"])
def gpu_check_row(args: argparse.Namespace) -> dict[str, Any]:
    from freetoken_agent.evals.perf import phase_gpu

    phase_gpu.check_flags(args)
    from freetoken_agent.runtime.experts.cache_file import cache_root
    from freetoken_agent.runtime.experts.layout import ExpertLayout
    from freetoken_agent.runtime.hardware import load_or_probe
    from freetoken_agent.runtime.kernels import build
    from freetoken_agent.runtime.model.adapters import spec_from_config
    from freetoken_agent.runtime.threads import configure_threads

    configure_threads(None)  # torch threads = free cores (oversubscribed OpenMP stalls for a scheduler slice)
    t_start = time.perf_counter()
    if not args.cpu_dry_run and not torch.cuda.is_available():
        raise BenchError("no CUDA device: run with --cpu-dry-run for the CPU smoke test")
    device = "cpu" if args.cpu_dry_run else "cuda"
    if args.cpu_dry_run:
        args.device_memory, args.host_memory = "2MB", "64MB"
    profile = load_or_probe(seconds=0.3)
    _say(f"profile: {json.dumps(profile.bench)}")
    config = dict(TINY if args.cpu_dry_run else QWEN3_30B_A3B)
    if args.layers:
        config["num_hidden_layers"] = args.layers
    spec = spec_from_config(config)
    dtype = torch.float32 if args.cpu_dry_run else torch.bfloat16
    weights = random_dense(spec, device, dtype)
    moe_layers = [i for i, layer in enumerate(spec.layers) if layer.moe is not None]
    moe = spec.layers[moe_layers[0]].moe
    layout = ExpertLayout("q4_0", spec.hidden_size, moe.intermediate, False, build.load() is not None)
    root = Path(args.cache) if args.cache else cache_root()
    name = f"{'tiny' if args.cpu_dry_run else 'qwen3-30b-a3b'}-l{spec.num_layers}-{'packed' if layout.packed else 'gguf'}"
    disk_path = root / f"gpu-check-{name}.ftx"
    write_experts(disk_path, spec, layout, moe_layers).close()
    _say(f"experts: {len(moe_layers) * moe.num_experts} x {layout.blob_bytes / 1e6:.2f} MB = "
          f"{disk_path.stat().st_size / 1e9:.2f} GB in {disk_path} ({time.perf_counter() - t_start:.0f} s so far)")
    prompt = torch.randint(0, spec.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    for name in args.runs.split(","):
        rows.append(run_config(name, spec, weights, disk_path, args, device, prompt))
        r = rows[-1]
        _say(f"{name}: {r['decode_tok_s']} tok/s decode, prefill {r['prefill_s']} s, planner {r['planner']}, "
              f"device hit {r['device_hit_rate']}, host hit {r['host_hit_rate']}, stall {r['stall_s']} s, "
              f"peak {r['peak']} (limits {r['limits']})")
    phase = None
    if args.phase_turns:
        from freetoken_agent.runtime.experts.setup import build_store

        phase = phase_gpu.run(spec, weights, disk_path, args, device, build_store)
        rows_all = rows + phase["rows"]
    else:
        rows_all = rows
    over = [r["run"] for r in rows_all for t in ("device", "host")
            if r["limits"][t] is not None and r["peak"][t] > r["limits"][t]]
    report = {"rows": rows, "phase": phase, "profile": profile.to_json(), "over_budget": over,
              "phase_args": {"turns": args.phase_turns, "warm": args.phase_warm, "host": args.phase_host,
                             "pause": args.phase_pause} if phase else None,
              "wall_s": round(time.perf_counter() - t_start, 1)}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m freetoken_agent.evals.perf.gpu_check``: status 1 when a budget was exceeded."""
    return module_main("gpu-check", argv)


if __name__ == "__main__":
    raise SystemExit(main())
