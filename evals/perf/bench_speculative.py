"""Speculative decoding on recorded agent turns: decode tok/s with and without it, oracle acceptance, verify cost.

Four measurements (the recorded mini-swe-agent trajectories, rendered through the built-in model's chat template
and labelled per token by phase as ``phase_trace`` does: ``plan`` text, ``code`` = the tool call, ``tool`` output):

1. **Built-in model, real decode.** For each assistant span of a phase (``code``: the tool call; ``edit``: the tool
   calls that write a file, ``EDIT``; ``plan``: the thought before it), the prompt is the ``--window`` tokens before the span; the model decodes ``--max-new`` tokens
   greedily with speculation off and on (defaults of ``SpeculationConfig``), the request tagged with its phase as
   the SDK's ``Agent`` tags it. Decode tok/s = generated tokens after
   the first / seconds after the first (``RequestResult.decode_s``), summed over the turns; the outputs with and
   without are compared token for token. One engine decodes a phase's turns in order, so with speculation on it
   drafts from its history of the earlier turns' outputs too (only runs with speculation on are recorded: a turn
   never drafts from its own run without speculation). Each run prefills its whole prompt (no prefix-cache reuse,
   so neither mode starts from the other's cached prompt), and each turn runs ``--decode-repeats`` times per mode
   (default 3, order alternated): a turn's seconds per mode are its fastest run's, since on a shared machine a
   neighbour's burst lands on one run and not the others (measured on the AMX Xeon VM: the ``code`` row of single
   runs spread over 1.5-2.2x); the first runs' own ratio is reported beside it.
2. **Oracle acceptance** (model-free; what a model that writes exactly the recorded reply would accept): at each
   position of a phase's spans, ``PromptLookup`` over the whole session so far proposes k tokens; the longest prefix
   equal to the recorded next tokens is kept plus one token, and decoding moves on. Again with the engine's history
   (``ContextLookup``): the recorded replies of the sessions before, as an engine that served them would hold. Reported per phase: tokens per
   verification step (fixed k, and the adaptive ``DraftPolicy``), acceptance rate.
3. **Verify cost** on a random-weight synthetic MoE at q4: seconds of one step with a row of k + 1 tokens vs 1 token
   after a ``--cost-context``-token prompt (the engine's own runner and paged KV; rows rolled back between runs).
   With (2) it gives the **projected** speedup for a trained model of that size: tokens per step / (cost of the
   step relative to a 1-token step). A random model accepts nothing of its own, so this is a projection.
4. **Draft model** (``--draft-model``, default the built-in model; only the held-out sessions it was not trained
   on): its greedy prediction at each position of a phase's spans given the recorded tokens before it (a greedy
   chain of k drafts matches the recorded reply exactly as far as these do), giving tokens per step for fixed k;
   and the real ``DraftModel``'s milliseconds per draft token along a session. With (3): the projected speedup of
   a model of the synthetic's size that writes like the recorded agent, drafted by the draft model — tokens per
   step / (relative verify cost + k · draft ms / 1-token step ms).

    nice -n 10 python -m freetoken_agent.evals.perf.bench_speculative [--trajectories DIR] [--sessions N]
        [--turns N] [--window N] [--max-new N] [--decode-repeats N] [--moe DIR] [--draft-model DIR]
        [--skip-draft] [--json]

``--moe``: a ``qwen3_moe`` folder (default: the 7.5B of ``bench_concurrent`` when it exists, else a 4-layer
synthetic of the same block, 1.26B parameters, written under ``--scratch`` once).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from freetoken_agent.evals.perf.harness import row, run_json_main

DEFAULT_TRAJECTORIES = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "agent-trajectories"
DEFAULT_MOE = Path("/tmp/freetoken-bench-concurrent/qwen3_moe-7b")
SCRATCH = Path("/tmp/freetoken-bench-speculative")
DRAFTS = (2, 4, 7)
"""Draft lengths the oracle and the verify cost are measured at: 7 is ``SpeculationConfig.max_draft`` (a row of 8,
the most one fused step carries)."""


# ------------------------------------------------------------------------------------------------ sessions


@functools.lru_cache(maxsize=1)
def builtin_tokenizer() -> Any:
    """The built-in model's ``tokenizers.Tokenizer`` (loaded once)."""
    from freetoken_agent.runtime.builtin import builtin_model_dir
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(builtin_model_dir() / "tokenizer.json"))


def labelled_sessions(folder: Path, limit: int) -> list[tuple[str, list[int], list[str | None]]]:
    """(name, token ids, phase label per token) of up to ``limit`` trajectories, rendered as the built-in model
    was trained on them."""
    from freetoken_agent.evals.builtin.data import render_session
    from freetoken_agent.evals.perf.routing_report import token_phases

    tokenizer = builtin_tokenizer()
    out = []
    for path in sorted(folder.glob("*.traj.json"))[:limit]:
        text = render_session(path)
        enc = tokenizer.encode(text)
        out.append((path.name.removesuffix(".traj.json"), list(enc.ids), token_phases(text, enc.offsets)))
    return out


def spans(labels: list[str | None], phase: str) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of ``phase`` labels."""
    out, start = [], None
    for i, label in enumerate([*labels, None]):
        if label == phase and start is None:
            start = i
        elif label != phase and start is not None:
            out.append((start, i))
            start = None
    return out


EDIT = re.compile(r"""<<-?\s*\\?['"]?\w+['"]?\s*>|\bsed\s+-i|\btee\b|\bpatch\b|\bgit\s+apply|"""
                  r""">>?\s*[\w./-]+\.\w+|open\([^)]*['"][wa]""")
"""A tool call that writes a file: a heredoc redirected into one, ``sed -i``, ``tee``, a patch, a redirect into a
named file, or Python opening one to write. The ``edit`` selection of ``code`` turns (a quarter of the recorded
ones: 610 of 2,452) is the edit-heavy workload of the speculation issue; ``code`` is every tool call."""

AGENT_PHASE = {"edit": "code"}
"""The phase an agent announces for a selection's turns (an edit is a ``code`` turn)."""


def phase_spans(ids: list[int], labels: list[str | None], phase: str) -> list[tuple[int, int]]:
    """The spans of ``phase`` (``spans``), or of the ``code`` spans whose recorded tool call writes a file
    (``EDIT``) for the ``edit`` selection."""
    if phase != "edit":
        return spans(labels, phase)
    tokenizer = builtin_tokenizer()
    return [(a, b) for a, b in spans(labels, "code") if EDIT.search(tokenizer.decode(ids[a:b]))]


# ------------------------------------------------------------------------------------------------ oracle


def oracle(ids: list[int], span_list: list[tuple[int, int]], k: int | None, phase: str,
           history: Any = None) -> dict[str, float]:
    """Speculation with the recorded tokens as the model's output over ``span_list``: k fixed, or None for the
    adaptive policy (``DraftPolicy`` with the default config, its phase's prior). ``history``: a ``TokenHistory`` of
    what came before this session (``record_replies``): drafts come from the session or from it
    (``ContextLookup``), else from the session only (``PromptLookup``)."""
    from freetoken_agent.runtime.generation.speculative import (
        ContextLookup,
        DraftPolicy,
        PhaseAcceptance,
        PromptLookup,
        SpeculationConfig,
    )

    config = SpeculationConfig()
    phases = PhaseAcceptance(config)
    steps = tokens = drafted = accepted = 0
    # the session's tokens only grow: one index for all its spans
    lookup = ContextLookup(history, config.key) if history is not None else PromptLookup(config.key)
    for start, end in span_list:
        policy = DraftPolicy(config, phases, lookup)
        i = start
        while i < end:
            limit = end - i - 1
            context = ids[:i]
            if k is None:
                draft = policy.draft(context, phase, limit)
            else:
                draft = lookup.propose(context, min(k, limit)) if limit > 0 else []
            kept = 0
            while kept < len(draft) and draft[kept] == ids[i + kept]:
                kept += 1
            if draft and k is None:
                policy.observe(phase, min(kept + 1, len(draft)), kept)
            steps += 1
            tokens += kept + 1
            drafted += len(draft)
            accepted += kept
            i += kept + 1
    return {"steps": steps, "tokens": tokens, "tokens_per_step": round(tokens / steps, 3) if steps else 0.0,
            "drafted": drafted, "accepted": accepted,
            "acceptance": round(accepted / drafted, 3) if drafted else 0.0}


def record_replies(history: Any, ids: list[int], labels: list[str | None]) -> None:
    """Add a session's assistant replies (each run of adjacent ``plan`` and ``code`` spans) to ``history``, as the
    engine records what it generated."""
    replies: list[list[int]] = []
    for a, b in sorted(spans(labels, "plan") + spans(labels, "code")):
        if replies and replies[-1][1] == a:
            replies[-1][1] = b
        else:
            replies.append([a, b])
    for a, b in replies:
        history.add(ids[max(0, a - history.prompt_tail) : a], ids[a:b])


def oracle_table(sessions: list, phase: str, with_history: bool) -> dict[str, dict[str, Any]]:
    """``oracle`` summed over the sessions for each k in ``DRAFTS`` and the adaptive policy; ``with_history``: each
    session also drafts from the replies of the sessions before it."""
    from freetoken_agent.runtime.generation.speculative import TokenHistory

    per_k = {}
    for k in (*DRAFTS, None):
        agg = {"steps": 0, "tokens": 0, "drafted": 0, "accepted": 0}
        history = TokenHistory() if with_history else None
        for _, ids, labels in sessions:
            r = oracle(ids, phase_spans(ids, labels, phase), k, AGENT_PHASE.get(phase, phase), history)
            for key in agg:
                agg[key] += r[key]
            if history is not None:
                record_replies(history, ids, labels)
        agg["tokens_per_step"] = round(agg["tokens"] / agg["steps"], 3) if agg["steps"] else 0.0
        agg["acceptance"] = round(agg["accepted"] / agg["drafted"], 3) if agg["drafted"] else 0.0
        per_k["adaptive" if k is None else str(k)] = agg
    return per_k


# ------------------------------------------------------------------------------------------------ draft model


def split_held(folder: Path) -> list[Path]:
    """The sessions the built-in model was not trained on (its held-out split)."""
    from freetoken_agent.evals.builtin.data import session_files, split_sessions

    return split_sessions(session_files(folder)).held_out


def draft_predictions(engine: Any, ids: list[int], start: int, end: int, window: int) -> list[int]:
    """The draft model's greedy next token at each position of [start, end) given the recorded tokens before it
    (teacher forcing; context: up to ``window`` tokens before ``start``). A chain of greedy drafts from position i
    matches the recorded tokens exactly as far as these single predictions do."""
    s0 = max(0, start - window)
    logits = engine.logits(ids[s0:end])  # [end - s0, V]: row j predicts position s0 + j + 1
    return [int(t) for t in logits[start - 1 - s0 : end - 1 - s0].argmax(-1)]


def draft_oracle(sessions: list, phase: str, draft_path: Path, window: int) -> dict[str, Any]:
    """Tokens per verification step when the draft model drafts k tokens and the recorded reply is the model's
    output (k in ``DRAFTS``), over every span of ``phase``."""
    from freetoken_agent.runtime.engine import Engine

    from freetoken_agent.runtime.generation.speculative import PromptLookup

    engine = Engine.from_pretrained(draft_path, speculate=False)
    limit = engine.spec.max_position
    agg = {f"{how}{k}": {"steps": 0, "tokens": 0, "drafted": 0, "accepted": 0} for k in DRAFTS for how in ("", "+")}
    top1 = total = 0
    for _, ids, labels in sessions:
        lookups = {k: PromptLookup() for k in DRAFTS}  # each sees the session's positions in increasing order
        for start, end in phase_spans(ids, labels, phase):
            if start < 16:
                continue
            end = min(end, start + limit - window - 1)
            preds = draft_predictions(engine, ids, start, end, window)
            ok = [p == t for p, t in zip(preds, ids[start:end])]
            top1 += sum(ok)
            total += len(ok)
            for k in DRAFTS:
                for how in ("", "+"):  # "+": prompt lookup where it matches 4 tokens or more, else the model
                    a = agg[f"{how}{k}"]
                    i = start
                    while i < end:
                        n = min(k, end - i - 1)
                        kept = 0
                        copy = lookups[k].propose(ids[:i], n) if how and n > 0 else []
                        if copy and lookups[k].match >= 4:
                            while kept < len(copy) and copy[kept] == ids[i + kept]:
                                kept += 1
                        else:
                            while kept < n and ok[i - start + kept]:
                                kept += 1
                        a["steps"] += 1
                        a["tokens"] += kept + 1
                        a["drafted"] += n
                        a["accepted"] += kept
                        i += kept + 1
    engine.close()
    for a in agg.values():
        a["tokens_per_step"] = round(a["tokens"] / a["steps"], 3) if a["steps"] else 0.0
        a["acceptance"] = round(a["accepted"] / a["drafted"], 3) if a["drafted"] else 0.0
    return {"top1": round(top1 / total, 3) if total else 0.0, "positions": total, **agg}


def draft_cost(draft_path: Path, ids: list[int], context: int, k: int, proposals: int) -> dict[str, Any]:
    """Seconds per draft token of the real drafter (``DraftModel``: a session of the draft engine, incremental KV)
    along a recorded session: each proposal after the last advances the context by half a draft."""
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.generation.draft_model import DraftModel

    model = DraftModel(Engine.from_pretrained(draft_path), lookup_match=0)  # the model's own forwards only
    drafter = model.drafter()
    at = min(context, len(ids) - proposals * k)
    drafter.propose(ids[:at], k)  # the context's prefill, not timed
    model.seconds = 0.0
    drafted = 0
    t0 = time.perf_counter()
    for _ in range(proposals):
        at += max(1, k // 2)
        drafted += len(drafter.propose(ids[:at], k))
    seconds = time.perf_counter() - t0
    model.close()
    return {"model": str(draft_path), "context": context, "k": k, "proposals": proposals,
            "ms_per_draft_token": round(seconds / max(drafted, 1) * 1e3, 3)}


# ------------------------------------------------------------------------------------------------ built-in model


def builtin_decode(sessions: list, phase: str, turns: int, window: int, max_new: int, model: Path | None = None,
                   draft_model: Path | None = None, history_tokens: int | None = None, repeats: int = 1,
                   **load: Any) -> dict[str, Any]:
    """Greedy decode of each span's turn with speculation off, then on (see the module docstring). ``model``: the
    model decoding (default: the built-in one; ``load``: its ``from_pretrained`` options); ``draft_model``: drafts
    come from it instead of prompt lookup; ``history_tokens``: ``SpeculationConfig.history_tokens`` (None: the
    default).

    Every run prefills its whole prompt (no prefix-cache reuse: the second mode of a turn would otherwise find the
    prompt cached, skip most of the prefill and start decoding with warmer caches). ``repeats`` > 1 runs each turn
    that many times per mode, in alternating order, and a mode's seconds for the turn are its fastest run's (what a
    shared machine's interference leaves untouched, as ``timeit`` takes); each run with speculation on drafts from
    the history as it was before the turn's first run. ``first_runs_speedup``: the ratio of the first runs alone."""
    from freetoken_agent.runtime.builtin import builtin_model_dir
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.generation.sampling import SamplingParams
    from freetoken_agent.runtime.generation.speculative import SpeculationConfig
    from freetoken_agent.runtime.scheduler import Request

    if history_tokens is not None:  # a config (and history) of this engine's own
        load["speculate"] = SpeculationConfig(history_tokens=history_tokens)

    engine = Engine.from_pretrained(model or builtin_model_dir(), draft_model=draft_model, **load)
    with_draft = engine.speculation
    params = SamplingParams(max_new_tokens=max_new)
    prompts = []
    for _, ids, labels in sessions:
        for start, _end in phase_spans(ids, labels, phase)[:turns]:
            if start >= 16:
                prompts.append(ids[max(0, start - window) : start])
    out: dict[str, Any] = {"turns": len(prompts), "repeats": repeats}
    results: dict[str, list] = {"off": [], "on": []}
    totals = {mode: [0, 0.0] for mode in results}  # generated tokens after the first, seconds (fastest runs)
    firsts = {mode: 0.0 for mode in results}  # seconds of the first runs
    steady = True  # every repeat of a turn gave the first run's tokens
    engine.generate(prompts[0][-64:], SamplingParams(max_new_tokens=8))  # warm-up (kernels, allocator)
    s0 = engine.scheduler.speculation_snapshot()
    for i, p in enumerate(prompts):  # modes interleaved per turn (and their order alternated): the same load
        before = copy.deepcopy(with_draft.history) if repeats > 1 else None
        fastest: dict[str, float] = {}
        for r in range(repeats):
            for mode in ("off", "on") if (i + r) % 2 == 0 else ("on", "off"):
                if mode == "on" and r and before is not None:
                    with_draft.history = copy.deepcopy(before)  # this turn's earlier runs are not drafted from
                engine.speculation = with_draft if mode == "on" else False
                res = engine.submit(Request(p, params, phase=AGENT_PHASE.get(phase, phase), reuse=False)).result()
                if r == 0:
                    results[mode].append(res.token_ids)
                    firsts[mode] += res.decode_s
                else:
                    steady &= res.token_ids == results[mode][-1]
                fastest[mode] = min(fastest.get(mode, res.decode_s), res.decode_s)
        for mode in results:
            if len(results[mode][-1]) > 1:
                totals[mode][0] += len(results[mode][-1]) - 1
                totals[mode][1] += fastest[mode]
    s1 = engine.scheduler.speculation_snapshot()
    for mode, (toks, secs) in totals.items():
        out[mode] = {"decode_tok_s": round(toks / secs, 1) if secs else None, "tokens": toks,
                     "seconds": round(secs, 3)}
    out["model"], out["drafter"] = str(model or "built-in"), s1["drafter"]
    drafted, acc = s1["drafted"] - s0["drafted"], s1["accepted"] - s0["accepted"]
    by_source = {}
    for name, c in s1["by_source"].items():
        before_c = s0["by_source"].get(name, {"drafted": 0, "accepted": 0})
        d, a = c["drafted"] - before_c["drafted"], c["accepted"] - before_c["accepted"]
        by_source[name] = {"drafted": d, "accepted": a, "acceptance": round(a / d, 3) if d else None}
    out["on"].update(drafted=drafted, accepted=acc, acceptance=round(acc / drafted, 3) if drafted else None,
                     verify_rows=s1["verify_rows"] - s0["verify_rows"], k_hist=s1["k_hist"], by_source=by_source,
                     row_cost=s1["row_cost"])
    same = sum(a == b for a, b in zip(results["off"], results["on"]))
    out["identical_turns"] = f"{same}/{len(prompts)}" + ("" if steady else " (a repeat differed)")
    if out["off"]["decode_tok_s"] and out["on"]["decode_tok_s"]:
        out["speedup"] = round(out["on"]["decode_tok_s"] / out["off"]["decode_tok_s"], 3)
    if firsts["on"] > 0:
        out["first_runs_speedup"] = round(firsts["off"] / firsts["on"], 3)
    engine.close()
    return out


# ------------------------------------------------------------------------------------------------ verify cost


def synthetic_moe(folder: Path) -> Path:
    from freetoken_agent.evals.perf.bench_gguf_decode import CONFIG, write_checkpoint

    return write_checkpoint(folder, config={**CONFIG, "eos_token_id": 2})


def verify_cost(model: Path, quant: str, context: int, ks: list[int], repeats: int) -> dict[str, Any]:
    """Seconds per step for a row of k + 1 tokens (k in ``ks``, 0 = plain decode) after ``context`` tokens."""
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.kv import KVConfig
    from freetoken_agent.runtime.kv.paged import PagedKVCache
    from freetoken_agent.runtime.runner import Row

    t0 = time.perf_counter()
    engine = Engine.from_pretrained(model, quant=quant)
    load_s = time.perf_counter() - t0
    manager = engine.kv_manager(KVConfig(page_size=16, device_pages=max(64, (context + 64) // 16 + 8)))
    cache = PagedKVCache(manager.pool, manager.alloc)
    g = torch.Generator().manual_seed(0)
    vocab = engine.spec.vocab_size
    prompt = torch.randint(0, vocab, (context,), generator=g)
    with engine.lock:
        for i in range(0, context, 256):
            chunk = prompt[i : i + 256]
            cache.reserve(int(chunk.shape[0]))
            engine.runner.run([Row(cache, chunk, "none")])
        times: dict[int, list[float]] = {k: [] for k in ks}
        for r in range(repeats + 1):
            for k in ks:
                row = torch.randint(0, vocab, (k + 1,), generator=g)
                cache.reserve(k + 1)
                t = time.perf_counter()
                engine.runner.run([Row(cache, row, "draft" if k else "last", None, k)])
                dt = time.perf_counter() - t
                cache.truncate(context)
                if r:  # the first round warms up
                    times[k].append(dt)
        engine.runner.idle()
    cache.release()
    engine.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"model": str(model), "quant": quant, "layers": engine.spec.num_layers, "load_s": round(load_s, 1),
            "context": context, "step_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
            "relative": {k: round(v / med[0], 3) for k, v in med.items()}}


# ------------------------------------------------------------------------------------------------ report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trajectories", type=Path, default=DEFAULT_TRAJECTORIES)
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=6, help="spans per session and phase decoded on the built-in model")
    ap.add_argument("--window", type=int, default=1536, help="prompt tokens before each decoded span")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--decode-repeats", type=int, default=3,
                    help="runs of each turn per mode on the built-in model (and --decode-moe); a mode's time for a "
                         "turn is its fastest run's")
    ap.add_argument("--phases", default="code,edit,plan",
                    help="code: every tool call; edit: the tool calls that write a file (EDIT); plan: the thought")
    ap.add_argument("--moe", type=Path, default=None, help="the synthetic MoE for the verify cost (see above)")
    ap.add_argument("--quant", default="q4", choices=["none", "q8", "q4"])
    ap.add_argument("--dense", default="none", choices=["none", "q8", "q4"], help="--decode-moe's dense weights")
    ap.add_argument("--cost-context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-builtin", action="store_true")
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--draft-model", type=Path, default=None,
                    help="a draft model of the built-in tokenizer for the draft-model oracle (default: the built-in "
                         "model, on the held-out sessions it was not trained on)")
    ap.add_argument("--skip-draft", action="store_true")
    ap.add_argument("--decode-moe", action="store_true",
                    help="also decode the recorded turns on --moe itself (speculation off vs on with prompt lookup, "
                         "and with --draft-model or the built-in model drafting)")
    ap.add_argument("--history-tokens", type=int, default=None,
                    help="SpeculationConfig.history_tokens of the decoding engines (0: drafts from each sequence's "
                         "own tokens only; default: the engine's default)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.history_tokens is not None and args.history_tokens < 0:
        ap.error("--history-tokens must be >= 0")
    if args.decode_repeats < 1:
        ap.error("--decode-repeats must be >= 1")
    spec_load = {"history_tokens": args.history_tokens}
    if not args.trajectories.is_dir():
        ap.error(f"no trajectories at {args.trajectories} (pass --trajectories DIR)")
    sessions = labelled_sessions(args.trajectories, args.sessions)
    phases = [p for p in args.phases.split(",") if p]
    report: dict[str, Any] = {"sessions": len(sessions), "tokens": sum(len(ids) for _, ids, _ in sessions)}

    report["oracle"] = {phase: oracle_table(sessions, phase, False) for phase in phases}
    report["oracle_history"] = {phase: oracle_table(sessions, phase, True) for phase in phases}

    if not args.skip_draft:
        from freetoken_agent.runtime.builtin import builtin_model_dir

        draft_path = args.draft_model or builtin_model_dir()
        held = {p.name.removesuffix(".traj.json") for p in split_held(args.trajectories)}
        held_sessions = [s for s in labelled_sessions(args.trajectories, 10**6) if s[0] in held]
        report["draft"] = {"model": str(draft_path), "sessions": len(held_sessions),
                           "oracle": {p: draft_oracle(held_sessions, p, draft_path, args.window) for p in phases},
                           "cost": draft_cost(draft_path, held_sessions[0][1], args.window, 4, 40)}

    if not args.skip_builtin:
        report["builtin"] = {p: builtin_decode(sessions, p, args.turns, args.window, args.max_new,
                                               repeats=args.decode_repeats, **spec_load)
                             for p in phases}

    if args.decode_moe and args.moe is not None:
        from freetoken_agent.runtime.builtin import builtin_model_dir

        held = {p.name.removesuffix(".traj.json") for p in split_held(args.trajectories)}
        held_sessions = [s for s in labelled_sessions(args.trajectories, 10**6) if s[0] in held]
        report["moe_decode"] = {
            f"{p} {how}": builtin_decode(held_sessions, p, args.turns, args.window, args.max_new, args.moe,
                                         draft, repeats=args.decode_repeats, quant=args.quant,
                                         dense_quant=args.dense, **spec_load)
            for p in phases for how, draft in (("lookup", None), ("draft", args.draft_model or builtin_model_dir()))}

    if not args.skip_cost:
        model, note = args.moe, ""
        if model is None:
            if (DEFAULT_MOE / "config.json").is_file():
                model = DEFAULT_MOE
            else:
                model = synthetic_moe(SCRATCH / "qwen3_moe-4L")
                note = (f"{DEFAULT_MOE} absent: a 4-layer synthetic of its block (hidden 2048, 64 experts top-8, "
                        "1.26B parameters)")
        cost = verify_cost(model, args.quant, args.cost_context, [0, 1, *DRAFTS], args.repeats)
        cost["note"] = note
        rel = cost["relative"]
        proj = {}
        for phase in phases:
            for k in DRAFTS:
                o = report["oracle"][phase][str(k)]
                proj[f"{phase} k={k}"] = round(o["tokens_per_step"] / rel[k], 3)
                o = report["oracle_history"][phase][str(k)]
                proj[f"{phase} k={k}, + history"] = round(o["tokens_per_step"] / rel[k], 3)
        cost["projected_speedup"] = proj
        if "draft" in report:  # the draft model's tokens per step over the verify row plus the drafting
            d = report["draft"]
            one_ms = cost["step_ms"][0]
            draft_ms = d["cost"]["ms_per_draft_token"]
            d["projected_speedup"] = {
                f"{phase} k={k}": round(d["oracle"][phase][str(k)]["tokens_per_step"]
                                        / (rel[k] + k * draft_ms / one_ms), 3)
                for phase in phases for k in DRAFTS}
            d["projected_speedup"].update({
                f"{phase} k=+{k}": round(d["oracle"][phase][f"+{k}"]["tokens_per_step"]
                                         / (rel[k] + k * draft_ms / one_ms), 3)
                for phase in phases for k in DRAFTS})
        report["verify_cost"] = cost

    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report))
    return 0


def format_report(r: dict[str, Any]) -> str:
    lines = [f"{r['sessions']} sessions, {r['tokens']} tokens", "",
             "Oracle (recorded reply as the model's output; prompt lookup over the whole session so far, and also "
             "over the replies of the sessions before it — the engine's history):",
             "| phase | k | tokens/step | acceptance | + history: tokens/step | acceptance |",
             "|---|---|---|---|---|---|"]
    for phase, per_k in r["oracle"].items():
        for k, o in per_k.items():
            h = r.get("oracle_history", {}).get(phase, {}).get(k, {})
            lines.append(f"| {phase} | {k} | {o['tokens_per_step']} | {o['acceptance']} | "
                         f"{h.get('tokens_per_step')} | {h.get('acceptance')} |")
    if "draft" in r:
        d = r["draft"]
        lines += ["", f"Draft model {d['model']} on {d['sessions']} held-out sessions (recorded reply as the model's "
                  f"output; {d['cost']['ms_per_draft_token']} ms per draft token):",
                  "| phase | top-1 | k (+k: prompt lookup where it matches >= 4 tokens) | tokens/step | acceptance |",
                  "|---|---|---|---|---|"]
        for phase, o in d["oracle"].items():
            for k in (*DRAFTS, *(f"+{k}" for k in DRAFTS)):
                lines.append(f"| {phase} | {o['top1']} | {k} | {o[str(k)]['tokens_per_step']} | "
                             f"{o[str(k)]['acceptance']} |")
    for key, title, first in (("moe_decode", "The synthetic MoE decoding the held-out turns", "phase, drafter"),
                              ("builtin", "Built-in model, greedy decode of the recorded turns", "phase")):
        if key not in r:
            continue
        lines += ["", f"{title} (speculation off → on; each turn's fastest of its runs per mode):",
                  f"| {first} | turns | runs | tok/s off | tok/s on | speedup | first runs' speedup | acceptance | "
                  "identical | drafted (accepted) by source |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, b in r[key].items():
            sources = ", ".join(f"{n} {c['drafted']} ({c['accepted']})"
                                for n, c in b["on"].get("by_source", {}).items() if c["drafted"])
            lines.append(f"| {name} | {b['turns']} | {b.get('repeats', 1)} | {b['off']['decode_tok_s']} | "
                         f"{b['on']['decode_tok_s']} | {b.get('speedup')} | {b.get('first_runs_speedup')} | "
                         f"{b['on'].get('acceptance')} | {b['identical_turns']} | {sources} |")
    if "verify_cost" in r:
        c = r["verify_cost"]
        lines += ["", f"Verify cost on {c['model']} ({c['layers']} layers, {c['quant']}, context {c['context']})"
                  + (f" — {c['note']}" if c["note"] else "") + ":",
                  "| k | step ms | vs 1 token |", "|---|---|---|"]
        for k, ms in c["step_ms"].items():
            lines.append(f"| {k} | {ms} | {c['relative'][k]} |")
        lines += ["", "Projected speedup there (oracle tokens/step ÷ relative step cost; a projection):"]
        lines += [f"  {name}: {v}x" for name, v in c["projected_speedup"].items()]
        if "projected_speedup" in r.get("draft", {}):
            lines += ["", "Projected speedup there with the draft model (its tokens/step ÷ (relative verify cost + "
                      "k · draft ms / step ms); a projection):"]
            lines += [f"  {name}: {v}x" for name, v in r["draft"]["projected_speedup"].items()]
    return "\n".join(lines)


@row("speculative", "speculative decoding on recorded agent turns: tok/s with and without, oracle acceptance, verify "
     "cost; flags are bench_speculative's", passthrough=True, format=lambda r, a: format_report(r))
def speculative_row(args: argparse.Namespace) -> dict[str, Any]:
    return run_json_main(main, args.passthrough)


if __name__ == "__main__":
    raise SystemExit(main())
