"""Phase-aware residency on real agent sessions: misses at phase switches, stall, TTFT, decode tok/s per policy.

    python -m freetoken_agent.evals.perf.phase_replay [--trajectories DIR] [--max-sessions N] [--budget 0.4] [--json]

Replays the held-out sessions of ``--trajectories`` (the built-in model's deterministic split: every 10th session,
never trained on) through the built-in model (qwen3_moe, 6 MoE layers × 16 experts, top-2):

1. each session's routing is recorded with the real engine (``phase_trace``: tokens labelled plan / code / tool
   output, tool pauses from a documented duration model);
2. the routing is replayed (``phase_sim``) through a real host ``SlotPool`` of ``--budget`` × the model's expert
   bytes over the disk tier, once per policy: ``lru``, ``heat``, ``phase-heat`` (the residency issue's
   placeholder: heat kept per phase, no staging), ``phase`` (``PhaseScheduler``: profile-blended eviction and
   staging on hints) and ``phase+pause`` (the same, plus prefetching the next plan's experts during tool pauses);
   time is virtual, from costs measured here on the real engine and cache file (decode and prefill time per
   token with all experts resident, one expert read with the page cache dropped).

The phase profile starts from ``--warm-sessions`` training sessions (a model that has run a few sessions before;
its saved profile) and keeps learning over the replay. ``--json`` prints the summary with
``phase_switch_miss_reduction`` = 1 − switch misses of ``phase+pause`` / those of the best of ``lru`` and ``heat``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from freetoken_agent.evals.builtin.data import (
    DEFAULT_DATA_DIR,
    render_session,
    session_files,
    split_sessions,
)
from freetoken_agent.evals.perf.phase_sim import Costs, Replay, SimStore
from freetoken_agent.evals.perf.phase_trace import Trace, cached_trace
from freetoken_agent.evals.perf.harness import row, run_json_main

VARIANTS = ("lru", "heat", "phase-heat", "phase", "phase+pause")


def measure_costs(engine: Any, tokens: list[int], read_gbps: float | None) -> Costs:
    """Decode/prefill seconds per token with every expert in a host slot, and one expert read (cold pages)."""
    store = engine.residency
    engine.generate(tokens[:64], max_new_tokens=4)  # fills every slot (the budget is unlimited here)
    out = engine.generate(tokens[:64], max_new_tokens=24)
    decode_s = out.decode_s / max(1, len(out.token_ids) - 1)
    t0 = time.perf_counter()
    engine.logits(tokens[:512])
    prefill_s = (time.perf_counter() - t0) / len(tokens[:512])
    blob = store.host.layout.blob_bytes
    if read_gbps is None:
        disk, slot = store.disk, store.host.data[0]
        t0, n = time.perf_counter(), 0
        for layer in disk.layers:
            for e in range(disk.num_experts):
                os.posix_fadvise(disk._fd, 0, 0, os.POSIX_FADV_DONTNEED)
                disk.read_into(layer, e, slot)
                n += 1
        read_s = (time.perf_counter() - t0) / n
    else:
        read_s = blob / (read_gbps * 1e9)
    return Costs(decode_s, prefill_s, read_s, blob)


def learn(profiles: Any, traces: list[Trace], layout: Any, costs: Costs, top_k: int) -> None:
    """What a session's phase scheduler records (routing per phase, onset and script positions, one turn per
    hint): the traces replayed through a ``PhaseScheduler`` that only records (all experts resident, no staging)."""
    from freetoken_agent.runtime.experts.phase import PhaseScheduler
    from freetoken_agent.runtime.experts.policies import make_policy
    from freetoken_agent.runtime.experts.pool import SlotPool
    from freetoken_agent.runtime.memory import MemoryBudget

    n_slots = len(profiles.layers) * profiles.experts
    ledger = MemoryBudget("host", n_slots * layout.stride)
    pool = SlotPool("host", layout, n_slots, "cpu", ledger.reserve("experts"), make_policy("lru"))
    replay = Replay(pool, costs, len(profiles.layers))
    replay.scheduler = PhaseScheduler(SimStore(replay), profiles, top_k, stage_fraction=0.0, pause_prefetch=False)
    for trace in traces:
        replay.run(trace)
    profiles.end_turn()


def run_variant(name: str, traces: list[Trace], layout: Any, n_slots: int, costs: Costs, warm: Any,
                top_k: int, stage_fraction: float) -> dict[str, Any]:
    from freetoken_agent.runtime.experts.phase import PhaseScheduler
    from freetoken_agent.runtime.experts.policies import make_policy
    from freetoken_agent.runtime.experts.pool import SlotPool
    from freetoken_agent.runtime.memory import MemoryBudget

    ledger = MemoryBudget("host", n_slots * layout.stride)
    pool = SlotPool("host", layout, n_slots, "cpu", ledger.reserve("experts"),
                    make_policy({"lru": "lru", "heat": "heat", "phase-heat": "phase"}.get(name, "lru")))
    replay = Replay(pool, costs, len(traces[0].layers))
    sched = None
    if name in ("phase", "phase+pause"):
        sched = PhaseScheduler(SimStore(replay), warm.copy(), top_k, stage_fraction=stage_fraction,
                               pause_prefetch=name == "phase+pause", read_gbps=costs.blob_bytes / costs.read_s / 1e9)
        pool.policy = sched.policy
        replay.scheduler = sched
    t0 = time.perf_counter()
    for trace in traces:
        replay.run(trace)
    if sched is not None:
        replay.result.staged = sched.stats.snapshot()
    out = replay.result.summary()
    assert ledger.peak <= ledger.limit, f"{name}: host ledger peak {ledger.peak} > budget {ledger.limit}"
    out.update(policy=name, peak_bytes=ledger.peak, budget_bytes=ledger.limit, sim_s=round(time.perf_counter() - t0, 2))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m freetoken_agent.evals.perf.phase_replay", description=__doc__.split("\n")[0])
    p.add_argument("--trajectories", type=Path, default=DEFAULT_DATA_DIR, help="folder of *.traj.json sessions")
    p.add_argument("--max-sessions", type=int, default=None, help="held-out sessions to replay (default: all)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per session at most")
    p.add_argument("--budget", type=float, default=0.4, help="host expert slots as a fraction of the expert bytes")
    p.add_argument("--warm-sessions", type=int, default=3, help="training sessions that warm the phase profile")
    p.add_argument("--stage-fraction", type=float, default=0.9, help="share of the slots a hint may stage")
    p.add_argument("--read-gbps", type=float, default=None, help="model this disk read rate instead of measuring")
    p.add_argument("--model", type=Path, default=None, help="model folder (default: the built-in model)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if not 0 < args.budget < 1:
        raise SystemExit(f"phase_replay: error: --budget must be a fraction in (0, 1), got {args.budget}")
    if not args.trajectories.is_dir():
        raise SystemExit(f"phase_replay: error: trajectories folder {args.trajectories} does not exist")
    from freetoken_agent.runtime.builtin import builtin_model_dir
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.experts.phase_profiles import (
        PhaseProfiles,
        model_key,
        profiles_root,
    )
    from freetoken_agent.runtime.experts.setup import ResidencyConfig
    from freetoken_agent.runtime.memory import Budget
    from tokenizers import Tokenizer

    model = args.model or builtin_model_dir()
    try:
        split = split_sessions(session_files(args.trajectories))
    except FileNotFoundError as exc:
        raise SystemExit(f"phase_replay: error: {exc}") from None
    held = split.held_out[: args.max_sessions]
    engine = Engine.from_pretrained(model, threads=1, budget=Budget(), residency=ResidencyConfig(policy="lru"))
    tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    cache, key = profiles_root().parent / "phase_traces", model_key(model)
    traces = [cached_trace(engine, tokenizer, f, cache, key, 512, args.max_tokens) for f in held]
    warm_traces = [cached_trace(engine, tokenizer, f, cache, key, 512, args.max_tokens)
                   for f in split.train[: args.warm_sessions]]
    costs = measure_costs(engine, tokenizer.encode(render_session(held[0])).ids, args.read_gbps)
    layout = engine.residency.host.layout
    layers, experts = traces[0].layers, engine.spec.layers[traces[0].layers[0]].moe.num_experts
    top_k = traces[0].ids.shape[2]
    n_slots = max(int(args.budget * len(layers) * experts), 16)
    warm = PhaseProfiles(layers, experts)
    learn(warm, warm_traces, layout, costs, top_k)
    rows = [run_variant(v, traces, layout, n_slots, costs, warm, top_k, args.stage_fraction) for v in VARIANTS]
    best = min((r for r in rows if r["policy"] in ("lru", "heat")), key=lambda r: r["switch_misses"])
    ours = next(r for r in rows if r["policy"] == "phase+pause")
    reduction = 1 - ours["switch_misses"] / best["switch_misses"] if best["switch_misses"] else None
    summary = {
        "model": str(model), "sessions": [t.name for t in traces], "tokens": sum(len(t.labels) for t in traces),
        "warm_sessions": [f.name for f in split.train[: args.warm_sessions]],
        "slots": n_slots, "experts_total": len(layers) * experts, "budget_fraction": args.budget,
        "costs": {"decode_ms": round(costs.decode_s * 1e3, 3), "prefill_ms_per_token": round(costs.prefill_s * 1e3, 4),
                  "expert_read_ms": round(costs.read_s * 1e3, 4), "expert_bytes": costs.blob_bytes},
        "best_phase_agnostic": best["policy"],
        "phase_switch_miss_reduction": None if reduction is None else round(reduction, 4),
        "policies": rows,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(format_table(summary))
    return 0


def format_table(s: dict[str, Any]) -> str:
    c = s["costs"]
    lines = [(f"phase replay: {len(s['sessions'])} held-out sessions, {s['tokens']} tokens; {s['slots']}/"
             f"{s['experts_total']} expert slots ({s['budget_fraction']:.0%}); decode {c['decode_ms']} ms/token, "
             f"expert read {c['expert_read_ms']} ms"), "",
             ("| policy | switch misses (plan+code) | by phase plan/code/tool | all misses | hit rate | stall s "
             "| visible stall s | TTFT median ms | decode tok/s |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in s["policies"]:
        b = r["switch_misses_by_phase"]
        lines.append(f"| {r['policy']} | {r['switch_misses']} | {b['plan']}/{b['code']}/{b['tool']} | {r['misses']} | "
                     f"{r['hit_rate']} | {r['stall_s']} | {r['visible_stall_s']} | {r['ttft_median_ms']} | "
                     f"{r['decode_tok_s']} |")
    lines += ["", (f"phase_switch_miss_reduction (phase+pause vs {s['best_phase_agnostic']}): "
                  f"{s['phase_switch_miss_reduction']}")]
    return "\n".join(lines)




@row("phase-replay", "phase-aware expert residency replayed on recorded agent sessions in virtual time: switch misses, stall, TTFT per policy; flags are phase_replay's", passthrough=True, format=lambda r, a: format_table(r))
def phase_replay_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, args.passthrough)

if __name__ == "__main__":
    sys.exit(main())
