"""Replay recorded coding-agent sessions turn by turn and measure what prefix reuse buys.

Each session (mini-swe-agent trajectory JSON) is rendered with the model's chat template up to each assistant turn;
the recorded assistant text is teacher-forced (it becomes part of the next prompt, like a real agent loop) and the
tool output follows. Per turn we time TTFT (prompt → first token) in three modes:

- ``reuse``: one engine session across turns (radix prefix cache on): only new tokens are prefilled;
- ``no_reuse``: every turn prefills the whole prompt (what a stateless server does);
- ``drop``: a session whose KV is dropped at every tool pause and evicted (recompute after each tool).

    freetoken bench kv-reuse [--trajectories DIR] [--model M] [--max-sessions N] [--max-turns N]
        [--max-context TOKENS] [--json]            (also python -m freetoken_agent.evals.perf.agent_replay)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from freetoken_agent.evals.perf.harness import BenchError, module_main, row
from freetoken_agent.evals.perf.timing import timed

DEFAULT_TRAJECTORIES = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "agent-trajectories"


def load_sessions(folder: Path, limit: int) -> list[tuple[str, list[dict[str, str]]]]:
    """(name, messages) of up to ``limit`` trajectories, in file-name order; content flattened to text."""
    out = []
    for file in sorted(folder.glob("*.traj.json"))[:limit]:
        data = json.loads(file.read_text(encoding="utf-8"))
        messages = []
        for m in data["messages"]:
            content = m["content"]
            if isinstance(content, list):
                content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
            messages.append({"role": m["role"], "content": content})
        out.append((file.name.removesuffix(".traj.json"), messages))
    return out


def turn_prompts(engine: Any, messages: list[dict[str, str]], max_turns: int, max_context: int) -> list[list[int]]:
    """Token ids of the prompt before each assistant message (teacher forcing), up to the limits."""
    prompts = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        ids = engine.tokenizer.encode(engine.render_chat(messages[:i], add_generation_prompt=True))
        if len(ids) > max_context or len(prompts) >= max_turns:
            break
        prompts.append(ids)
    return prompts


def replay(engine: Any, prompts: list[list[int]]) -> dict[str, list[float]]:
    """TTFT per turn in each mode; modes run one after another so none can borrow another's cached pages."""
    manager = engine.kv_manager()
    kw = dict(max_new_tokens=1, stop_token_ids=[])
    times: dict[str, list[float]] = {}
    session = engine.session()
    times["reuse"] = [timed(lambda: session.generate(p, **kw))[1] for p in prompts]
    session.close()
    manager.radix.clear()
    times["no_reuse"] = [timed(lambda: engine.generate(p, **kw))[1] for p in prompts]
    session, times["drop"] = engine.session(), []
    for p in prompts:
        session.drop()  # the tool pause: this session's KV is dropped ...
        manager.radix.clear()  # ... and evicted, so the turn recomputes
        times["drop"].append(timed(lambda: session.generate(p, **kw))[1])
    session.close()
    manager.radix.clear()
    return times


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trajectories", default=str(DEFAULT_TRAJECTORIES))
    parser.add_argument("--model", default=None, help="model folder, 'builtin' (default) or 'synthetic:ARCH'")
    parser.add_argument("--max-sessions", type=int, default=3)
    parser.add_argument("--max-turns", type=int, default=16)
    parser.add_argument("--max-context", type=int, default=8192)
    parser.add_argument("--min-turns", type=int, default=12,
                        help="use only sessions with at least this many turns within --max-context")
    parser.add_argument("--threads", type=int, default=None)


@row("kv-reuse", "recorded agent sessions on our engine: time to first token per turn with session prefix reuse, "
     "without it, and with the KV dropped at every tool pause", options, format=lambda r, a: format_report(r))
def kv_reuse_row(args: argparse.Namespace) -> dict[str, Any]:
    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.models import resolve_model

    folder = Path(args.trajectories)
    if not folder.is_dir():
        raise BenchError(f"trajectory folder not found: {folder} (pass --trajectories DIR)")
    engine = Engine.from_pretrained(resolve_model(args.model), threads=args.threads, require_tokenizer=True)
    rows, per_turn_ratio, all_prompt_tokens, all_prefilled = [], [], 0, 0
    chosen = []
    for name, messages in load_sessions(folder, 10_000):
        prompts = turn_prompts(engine, messages, args.max_turns, args.max_context)
        if len(prompts) >= args.min_turns:
            chosen.append((name, prompts))
        if len(chosen) == args.max_sessions:
            break
    for name, prompts in chosen:
        before = engine.kv_manager().stats.prefilled_tokens
        times = replay(engine, prompts)
        tokens = [len(p) for p in prompts]
        prefilled_reuse = [tokens[0]] + [max(1, b - a) for a, b in zip(tokens, tokens[1:])]
        for turn, (t_r, t_n, t_d) in enumerate(zip(times["reuse"], times["no_reuse"], times["drop"])):
            rows.append({"session": name, "turn": turn, "prompt_tokens": tokens[turn],
                         "prefill_tokens_reuse": prefilled_reuse[turn], "ttft_reuse_s": t_r,
                         "ttft_no_reuse_s": t_n, "ttft_drop_s": t_d})
            if turn >= 10:
                per_turn_ratio.append(t_n / t_r)
        all_prompt_tokens += sum(tokens)
        all_prefilled += engine.kv_manager().stats.prefilled_tokens - before
    summary = {
        "model": str(engine.path),
        "sessions": len({r["session"] for r in rows}),
        "turns": len(rows),
        "median_ttft_reuse_s": statistics.median(r["ttft_reuse_s"] for r in rows) if rows else None,
        "median_ttft_no_reuse_s": statistics.median(r["ttft_no_reuse_s"] for r in rows) if rows else None,
        "median_ttft_drop_s": statistics.median(r["ttft_drop_s"] for r in rows) if rows else None,
        "median_ttft_ratio_turn_ge_10": statistics.median(per_turn_ratio) if per_turn_ratio else None,
        "turns_ge_10": len(per_turn_ratio),
        "prefill_tokens_no_reuse": all_prompt_tokens,
        "prefill_tokens_reuse_and_drop_sessions": all_prefilled,
        "threads": engine.threads,
    }
    return {"summary": summary, "turns": rows}


def format_report(report: dict[str, Any]) -> str:
    """TTFT per turn (median over sessions) in the three modes, then the summary."""
    import io

    from rich.console import Console
    from rich.table import Table

    summary, rows = report["summary"], report["turns"]
    table = Table(title="agent-session replay: TTFT per turn (median over sessions)")
    for col in ("turn", "prompt tokens", "prefilled (reuse)", "TTFT reuse", "TTFT no reuse", "TTFT drop@tool",
                "no-reuse / reuse"):
        table.add_column(col)
    by_turn: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_turn.setdefault(r["turn"], []).append(r)
    for turn, rs in sorted(by_turn.items()):
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        table.add_row(str(turn), f"{med('prompt_tokens'):.0f}", f"{med('prefill_tokens_reuse'):.0f}",
                      f"{med('ttft_reuse_s') * 1e3:.1f} ms", f"{med('ttft_no_reuse_s') * 1e3:.1f} ms",
                      f"{med('ttft_drop_s') * 1e3:.1f} ms", f"{med('ttft_no_reuse_s') / med('ttft_reuse_s'):.1f}×")
    console = Console(file=io.StringIO(), width=120)
    console.print(table)
    return console.file.getvalue() + json.dumps(summary, indent=2)


def resend_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder or GGUF, 'builtin' (default) or 'synthetic:ARCH'")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=17, help="greedy tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kv-dtype", default="auto")


@row("resend", "a session-less request re-sending a cached prompt: its prefill and decode with the radix tree's tail "
     "moved aside (now) and with the prefix copied into a fresh run (before)", resend_options,
     format=lambda r, a: format_resend(r))
def resend_row(args: argparse.Namespace) -> dict[str, Any]:
    """The same random prompt sent ``--rounds`` times per mode after a first request cached it; the modes alternate
    by round (the tree each request finds is the one the previous request left)."""
    import random

    from freetoken_agent.runtime.engine import Engine
    from freetoken_agent.runtime.models import resolve_model

    if args.prompt_len < 2 or args.tokens < 2 or args.rounds < 1:
        raise BenchError("--prompt-len and --tokens must be >= 2, --rounds >= 1")
    engine = Engine.from_pretrained(resolve_model(args.model), threads=args.threads, speculate=False,
                                    require_tokenizer=False, kv_dtype=args.kv_dtype)
    try:
        vocab = engine.spec.vocab_size
        g = random.Random(0)
        prompt = [g.randrange(min(300, vocab // 2), vocab) for _ in range(args.prompt_len)]
        kw = dict(max_new_tokens=args.tokens, stop_token_ids=[])
        engine.generate(prompt, **kw)
        radix = engine.kv_manager().radix
        runs: dict[str, list[dict[str, float]]] = {"move": [], "relocate": []}
        for r in range(args.rounds):
            for mode in ("move", "relocate") if r % 2 == 0 else ("relocate", "move"):
                radix.move_tails = mode == "move"
                moved, reused = radix.moved_pages, engine.scheduler.stats.reused_tokens
                out = engine.generate(prompt, **kw)
                runs[mode].append({"prefill_ms": round(out.prefill_s * 1e3, 1),
                                   "decode_tok_s": round((len(out.token_ids) - 1) / out.decode_s, 2),
                                   "reused": engine.scheduler.stats.reused_tokens - reused,
                                   "moved_pages": radix.moved_pages - moved})
        radix.move_tails = True
    finally:
        engine.close()
    summary = {mode: {"median_prefill_ms": statistics.median(x["prefill_ms"] for x in rs),
                      "median_decode_tok_s": statistics.median(x["decode_tok_s"] for x in rs)}
               for mode, rs in runs.items()}
    return {"model": str(engine.path), "prompt_len": args.prompt_len, "tokens": args.tokens,
            "kv_dtype": args.kv_dtype, "summary": summary, "runs": runs}


def format_resend(r: dict[str, Any]) -> str:
    lines = [f"{r['model']}: a cached {r['prompt_len']}-token prompt sent again, {r['tokens']} greedy tokens, KV "
             f"{r['kv_dtype']}", "| mode | prefill ms (each round) | decode tok/s (each round) | pages moved |",
             "|---|---|---|---|"]
    for mode, rs in r["runs"].items():
        lines.append(f"| {mode} | {' / '.join(str(x['prefill_ms']) for x in rs)} | "
                     f"{' / '.join(str(x['decode_tok_s']) for x in rs)} | {sum(x['moved_pages'] for x in rs)} |")
    return "\n".join(lines) + "\n" + json.dumps(r["summary"], indent=2)


def main(argv: list[str] | None = None) -> int:
    return module_main("kv-reuse", argv)


if __name__ == "__main__":
    raise SystemExit(main())
