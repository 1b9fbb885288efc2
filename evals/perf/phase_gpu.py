"""The GPU check's phase-aware run: one synthetic agent session, phase scheduling vs LRU, misses at phase switches.

Random weights have no agent phases of their own, so the session gives each phase its own small vocabulary (64
token ids, Zipf-weighted: plan text, code, tool output), which makes routing phase-specific and repetitive from turn
to turn, as it is in trained models. Each turn: a ``plan`` hint, the tool output + framing prefilled in one chunk,
``--phase-plan`` plan tokens and, after a ``code`` hint, ``--phase-code`` code tokens fed one at a time (decode
steps), then a ``tool`` hint and a real pause (``--phase-pause`` seconds, the engine idle). The host tier holds
``--phase-host`` × the expert bytes, so experts stream from the cache file and the scheduler's staging (disk → host
slots) matters; the device tier is the GPU's (simulated in CPU memory on ``--dry-run``).

Rows, same session, same engine build, in one process: ``agent-lru`` (LRU, a scheduler that only measures: no
staging, no pause prefetch) and ``agent-phase`` (``PhaseScheduler``: profile-blended eviction, staging on hints,
prefetch during pauses). The first ``--phase-warm`` turns train the profile in both rows and are not counted.
Switch misses = host-tier misses in the 16 tokens after each plan/code hint (the scheduler's windows).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

ROWS = ("agent-lru", "agent-phase")
PHASE_VOCAB = 64


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("phase-aware run (agent session, phase scheduling vs LRU)")
    g.add_argument("--phase-turns", type=int, default=10, help="agent turns replayed (0: skip the phase run)")
    g.add_argument("--phase-warm", type=int, default=3, help="first turns that train the profile, not counted")
    g.add_argument("--phase-host", type=float, default=0.4, help="host expert slots, fraction of the expert bytes")
    g.add_argument("--phase-plan", type=int, default=8, help="plan tokens per turn")
    g.add_argument("--phase-code", type=int, default=12, help="code tokens per turn")
    g.add_argument("--phase-output", type=int, default=48, help="tool output + framing tokens per turn")
    g.add_argument("--phase-pause", type=float, default=None,
                   help="seconds each tool pause lasts (default 0.3; 0.05 on --dry-run)")


def check_flags(args: argparse.Namespace) -> None:
    """One-line errors for bad phase flags (before anything is built); fills in the pause default."""
    if args.phase_pause is None:
        args.phase_pause = 0.05 if args.dry_run else 0.3
    if args.phase_turns and args.phase_warm >= args.phase_turns:
        raise SystemExit("gpu_check: error: --phase-warm must be smaller than --phase-turns")
    if not 0 < args.phase_host < 1:
        raise SystemExit(f"gpu_check: error: --phase-host must be a fraction in (0, 1), got {args.phase_host}")
    if args.phase_turns < 0 or args.phase_pause < 0:
        raise SystemExit("gpu_check: error: --phase-turns and --phase-pause cannot be negative")


def session(vocab: int, args: argparse.Namespace, seed: int = 0) -> list[tuple[str, str, list[int]]]:
    """(hint, kind, tokens) segments: kind ``prefill`` (one chunk), ``decode`` (one token per step), ``pause``."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, PHASE_VOCAB + 1, dtype=torch.float)
    zipf = 1.0 / ranks
    words = {p: torch.randperm(vocab, generator=gen)[:PHASE_VOCAB] for p in ("plan", "code", "tool")}

    def draw(phase: str, n: int) -> list[int]:
        return words[phase][torch.multinomial(zipf, n, replacement=True, generator=gen)].tolist()

    out: list[tuple[str, str, list[int]]] = [("plan", "prefill", draw("plan", 2 * args.phase_output))]
    for turn in range(args.phase_turns):
        if turn:
            out.append(("plan", "prefill", draw("tool", args.phase_output)))
        out += [("", "decode", draw("plan", args.phase_plan)), ("code", "decode", draw("code", args.phase_code)),
                ("tool", "pause", [])]
    return out


def run_row(name: str, build: Any, args: argparse.Namespace) -> dict[str, Any]:
    """One row: ``build(policy)`` gives a fresh budgeted engine; the session is replayed with hints."""
    from freetoken_agent.evals.perf.feeding import Feeder
    from freetoken_agent.runtime.experts.phase import PhaseScheduler
    from freetoken_agent.runtime.experts.phase_profiles import PhaseProfiles
    from freetoken_agent.runtime.experts.policies import make_policy

    engine = build("lru")  # the device tier (when there is one) evicts LRU in both rows
    store = engine.residency
    moe = [i for i, layer in enumerate(engine.spec.layers) if layer.moe is not None]
    profiles = PhaseProfiles(moe, engine.spec.layers[moe[0]].moe.num_experts)  # never the user's saved profile
    sched = PhaseScheduler.attach(engine, profiles)
    if name == "agent-lru":  # measure only: LRU eviction, no staging, no pause prefetch
        store.host.policy = make_policy("lru")
        sched.stage_fraction, sched.pause_prefetch, sched.script = 0.0, False, False
    feeder = Feeder(engine)  # teacher forcing: the session's tokens are given, fed through the engine's scheduler
    segments = session(engine.spec.vocab_size, args)
    pauses = decode_s = 0.0
    decoded = 0
    base: dict[str, Any] = {}
    host0 = (0, 0)
    for hint, kind, tokens in segments:
        if hint == "plan" and sched.stats.switches.get("plan", 0) == args.phase_warm:  # the counted turns start
            sched.drain()
            base = sched.snapshot()
            host0 = (store.counters["host"].hits, store.counters["host"].misses)
            base["stall_s"] = store.stall_s
        if hint:
            engine.hint(hint, args.phase_pause if hint == "tool" else None)
        if kind == "pause":
            t0 = time.perf_counter()
            time.sleep(args.phase_pause)  # the tool runs; the engine is idle (pause prefetch reads now)
            pauses += time.perf_counter() - t0
            continue
        if kind == "prefill":
            feeder.feed(tokens)
            continue
        for t in tokens:
            t0 = time.perf_counter()
            feeder.feed([t])
            if base:
                decode_s += time.perf_counter() - t0
                decoded += 1
    sched.close()
    snap, res = sched.snapshot(), store.stats()
    misses = {p: n - base.get("switch_misses", {}).get(p, 0) for p, n in snap["switch_misses"].items()}
    hits, miss = store.counters["host"].hits - host0[0], store.counters["host"].misses - host0[1]
    row = {"run": name, "switch_misses": misses, "switch_total": sum(misses.values()),
           "switches": {p: n - base.get("switches", {}).get(p, 0) for p, n in snap["switches"].items()},
           "host_misses": miss, "host_hit_rate": round(hits / max(1, hits + miss), 4),
           "device_hit_rate": res["tiers"].get("device", {}).get("hit_rate"),
           "stall_s": round(store.stall_s - base.get("stall_s", 0.0), 4), "pause_bytes": snap["pause_bytes"],
           "staged": snap["staged"], "accuracy": snap["accuracy"],
           "decode_tok_s": round(decoded / decode_s, 2) if decode_s else None,
           "peak": {t: v["peak"] for t, v in res["budget"].items()},
           "limits": {t: v["limit"] for t, v in res["budget"].items()}}
    store.close()
    return row


def run(spec: Any, weights: Any, disk_path: Path, args: argparse.Namespace, device: str,
        build_store: Any) -> dict[str, Any]:
    """Both rows and ``phase_switch_miss_reduction`` (1 − agent-phase / agent-lru switch misses)."""
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.experts.cache_file import ExpertCacheFile
    from freetoken_agent.runtime.experts.core import install
    from freetoken_agent.runtime.experts.loader import tensor_bytes
    from freetoken_agent.runtime.experts.setup import Managed, ResidencyConfig
    from freetoken_agent.runtime.memory import Budget, parse_bytes
    from freetoken_agent.runtime.model.decoder import Decoder

    check_flags(args)
    dense = tensor_bytes(weights)
    disk = ExpertCacheFile(disk_path)
    experts_bytes = len(disk.layers) * disk.num_experts * disk.layout.stride
    disk.close()
    host = int(args.phase_host * experts_bytes) + (dense if device == "cpu" else 0)

    def build(policy: str) -> Any:
        cfg = ResidencyConfig(policy=policy, prefetch=True, simulate_device=args.dry_run)
        ledgers = Budget(device=parse_bytes(args.device_memory), host=host).ledgers()
        ledgers["host" if device == "cpu" else "device"].reserve("dense", dense)
        ledgers["host"].reserve("kv", 0)
        store, plan = build_store(ExpertCacheFile(disk_path), ledgers, spec.layers[-1].moe.top_k, device, cfg)
        engine = Engine(spec, Decoder(spec, weights, device), None, None)
        install(engine.decoder, Managed(weights, store, plan, ledgers, spec, 0, False).backends())
        engine.kv_manager()  # before the store is attached: the session's KV stays outside the expert budget
        engine.residency = store
        return engine

    rows = [run_row(name, build, args) for name in ROWS]
    lru, phase = rows[0]["switch_total"], rows[1]["switch_total"]
    return {"rows": rows, "host_budget": host, "expert_bytes": experts_bytes,
            "phase_switch_miss_reduction": round(1 - phase / lru, 4) if lru else None}
