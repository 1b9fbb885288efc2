"""Phase scheduling on the live engine: switch misses with the real store, threads and gate look-ahead.

    python -m freetoken_agent.evals.perf.phase_live [--trajectories DIR] [--max-sessions N] [--max-tokens 4000] [--json]
    python -m freetoken_agent.evals.perf.phase_live --kv [--kv-turns 24] [--kv-rounds 2] [--json]  # see phase_kv

The companion of ``phase_replay`` (which replays whole sessions in virtual time, without the store's gate
look-ahead): here the built-in model really runs each held-out session's first ``--max-tokens`` tokens under a host
budget (``--budget`` × its expert bytes), token by token where the agent generated (plan, code) and in chunks where
it prefilled (task, tool output), with the hints an agent sends. Rows: ``lru``, ``heat`` and ``phase+pause``
(``PhaseScheduler``), each with and without the store's gate look-ahead. Switch misses are the scheduler's live
windows (host misses in the first 16 tokens after each plan/code hint); the baselines run with a scheduler that
only measures (its staging off, the baseline's own policy restored). The phase profile is warmed on
``--warm-sessions`` training sessions first. Look-ahead timing makes these numbers vary from run to run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from freetoken_agent.evals.builtin.data import (
    DEFAULT_DATA_DIR,
    render_session,
    session_files,
    split_sessions,
)
from freetoken_agent.evals.perf.phase_trace import Trace, segments
from freetoken_agent.evals.perf.harness import row, run_json_main

ROWS = (("lru", True), ("heat", True), ("phase+pause", True), ("lru", False), ("heat", False), ("phase+pause", False))


def run_session(model: Path, tokenizer: Any, path: Path, policy: str, lookahead: bool, host: int,
                max_tokens: int) -> tuple[dict[str, Any], Any]:
    """One session on a fresh budgeted engine; returns (scheduler snapshot, host tier counters)."""
    from freetoken_agent.evals.perf.routing_report import token_phases
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.evals.perf.feeding import Feeder
    from freetoken_agent.runtime.experts.phase import PhaseScheduler
    from freetoken_agent.runtime.experts.policies import make_policy
    from freetoken_agent.runtime.experts.setup import ResidencyConfig
    from freetoken_agent.runtime.memory import Budget

    text = render_session(path)
    enc = tokenizer.encode(text)
    ids, labels = enc.ids[:max_tokens], token_phases(text, enc.offsets)[:max_tokens]
    trace = Trace(path.name, labels, torch.zeros(len(ids), 1, 2, dtype=torch.int16), [0], [])
    engine = Engine.from_pretrained(model, threads=1, budget=Budget(host=host),
                                    residency=ResidencyConfig(policy="lru", prefetch=lookahead))
    sched = PhaseScheduler.attach(engine)  # loads (and on close saves) the model's profile
    if policy != "phase+pause":  # measure only: the baseline's own policy, no staging
        engine.residency.host.policy = make_policy(policy)
        sched.stage_fraction, sched.pause_prefetch, sched.script = 0.0, False, False
    feeder = Feeder(engine)  # teacher forcing through the engine's scheduler
    for seg in segments(trace):
        if seg.hint is not None:
            engine.hint(seg.hint, seg.pause_s or None)
        step = 1 if seg.kind == "decode" else 512
        for a in range(seg.start, seg.end, step):
            feeder.feed(ids[a : min(seg.end, a + step)])
        engine.residency.drain()
    if policy != "phase+pause":
        sched.save_path = None  # a measuring run does not write the profile
    sched.close()
    return sched.snapshot(), engine.residency.counters["host"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m freetoken_agent.evals.perf.phase_live", description=__doc__.split("\n")[0])
    p.add_argument("--trajectories", type=Path, default=DEFAULT_DATA_DIR, help="folder of *.traj.json sessions")
    p.add_argument("--max-sessions", type=int, default=None, help="held-out sessions (default: all)")
    p.add_argument("--max-tokens", type=int, default=4000, help="tokens per session")
    p.add_argument("--budget", type=float, default=0.4, help="host expert slots as a fraction of the expert bytes")
    p.add_argument("--warm-sessions", type=int, default=3, help="training sessions that warm the phase profile")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--kv", action="store_true", help="instead: TTFT per turn with KV pre-staging on vs off (phase_kv)")
    p.add_argument("--kv-turns", type=int, default=24, help="--kv: assistant turns replayed per session")
    p.add_argument("--kv-rounds", type=int, default=2, help="--kv: alternating off/on rounds")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if not 0 < args.budget < 1:
        raise SystemExit(f"phase_live: error: --budget must be a fraction in (0, 1), got {args.budget}")
    if args.kv and (args.kv_turns < 2 or args.kv_rounds < 1):  # flags first: no data needed to reject them
        raise SystemExit("phase_live: error: --kv-turns must be at least 2 and --kv-rounds at least 1")
    if not args.trajectories.is_dir():
        raise SystemExit(f"phase_live: error: trajectories folder {args.trajectories} does not exist")
    from freetoken_agent.runtime.builtin import builtin_model_dir
    from tokenizers import Tokenizer

    model = builtin_model_dir()
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    split = split_sessions(session_files(args.trajectories))
    if args.kv:
        return kv_main(split.held_out[: args.max_sessions], args)
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.experts.setup import ResidencyConfig
    from freetoken_agent.runtime.memory import Budget

    full = Engine.from_pretrained(model, threads=1, budget=Budget(), residency=ResidencyConfig())
    ledger = full.residency.ledgers["host"]
    dense, experts = ledger.reservations["dense"].nbytes, ledger.reservations["experts"].nbytes
    host = dense + ledger.reservations["step"].nbytes + int(args.budget * experts)  # + a step's working memory
    for f in split.train[: args.warm_sessions]:
        run_session(model, tokenizer, f, "phase+pause", True, host, args.max_tokens)
    rows = []
    for policy, lookahead in ROWS:
        tot: dict[str, Any] = {"policy": policy, "lookahead": lookahead, "switch_misses": 0, "plan": 0, "code": 0,
                               "windows": 0, "hits": 0, "misses": 0}
        for f in split.held_out[: args.max_sessions]:
            snap, host_c = run_session(model, tokenizer, f, policy, lookahead, host, args.max_tokens)
            for phase, n in snap["switch_misses"].items():
                tot[phase] += n
                tot["switch_misses"] += n
            tot["windows"] += sum(snap["switches"].values())
            tot["hits"] += host_c.hits
            tot["misses"] += host_c.misses
        rows.append(tot)
        if not args.json:
            print(f"{policy:12} look-ahead {'on ' if lookahead else 'off'}  switch misses {tot['switch_misses']:5} "
                  f"(plan {tot['plan']}, code {tot['code']}; {tot['windows']} windows)  "
                  f"host hit rate {tot['hits'] / max(1, tot['hits'] + tot['misses']):.4f}", flush=True)
    if args.json:
        print(json.dumps({"budget_fraction": args.budget, "max_tokens": args.max_tokens, "rows": rows}, indent=1))
    return 0


def kv_main(files: list[Path], args: argparse.Namespace) -> int:
    """``--kv``: the KV pre-staging comparison of ``phase_kv`` (rows off / on)."""
    from freetoken_agent.evals.perf.phase_kv import compare

    if args.kv_turns < 2 or args.kv_rounds < 1:
        raise SystemExit("phase_live: error: --kv-turns must be at least 2 and --kv-rounds at least 1")
    result = compare(files, args.kv_turns, args.kv_rounds)
    if args.json:
        print(json.dumps({"sessions": len(files), "kv_turns": args.kv_turns, "kv_rounds": args.kv_rounds,
                          **result}, indent=1))
        return 0
    print("| KV pre-staging | turns after a tool | TTFT median ms | TTFT mean ms | turn prefill tokens | "
          "reused | warmed in pauses | warm > pause |\n|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['kv_prestage']} | {r['turns']} | {r['ttft_median_ms']} | {r['ttft_mean_ms']} | "
              f"{r['turn_prefill_tokens']} | {r['turn_reused_tokens']} | {r['warmed_tokens']} | {r['warm_over_pause']} |")
    print(f"TTFT median on/off: {result['ttft_median_ratio_on_vs_off']}; "
          f"turn prefill saved: {result['turn_prefill_saved']} tokens")
    return 0




@row("phase-live", "phase scheduling on the live engine under a host budget: switch misses per policy, with and without gate look-ahead; flags are phase_live's", passthrough=True)
def phase_live_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, args.passthrough)


@row("phase-kv", "time to first token per agent turn with KV pre-staging during tool pauses on vs off (phase_kv); "
     "flags are phase_live --kv's", passthrough=True)
def phase_kv_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, ["--kv", *args.passthrough])


if __name__ == "__main__":
    sys.exit(main())
