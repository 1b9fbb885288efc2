"""Row ``agent-replay`` (suite row ``agent_replay``): a multi-turn agent session, ours vs llama.cpp, TTFT per turn.

The turns come from recorded trajectories (``--trajectories DIR``: mini-swe-agent ``*.traj.json``, as
``agent_replay.load_sessions`` reads them), else from a synthetic coding session built here, so the row runs on any
clone. Each message is tokenized once (the built-in model's tokenizer: header, content, footer) and appended to a
token log, so the prompt before assistant turn N+1 extends the prompt before turn N exactly, as in an agent runtime;
the recorded assistant text is teacher-forced. Ids are folded into the benchmark model's vocabulary above the
GGUF's 259 special and byte tokens (the weights are random: only lengths and prefixes matter).

Per turn (ours first on even turns, llama.cpp first on odd ones), the time from the turn's full prompt to its first greedy token:
- ours: one ``engine.session()`` for the whole conversation (radix prefix cache: only the new suffix is prefilled);
- llama.cpp: one ``Llama`` whose ``generate`` keeps the previous turn's KV and evaluates only the suffix that
  extends it (llama-cpp-python's prefix match; the same reuse as ``llama-server``'s per-slot prompt cache).
Turn 0 is a cold prefill on both sides (the prefill row covers it); the headline is the median TTFT over turns
>= 1 and the speed ratio llama.cpp / ours. Reused and prefilled token counts are recorded for both sides.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from freetoken_agent.evals.perf.harness import BenchError, row
from freetoken_agent.evals.perf.timing import timed
from freetoken_agent.runtime.errors import FreeTokenError

Messages = list[dict[str, str]]

_FILES = ["src/core/config.py", "src/core/cache.py", "src/io/reader.py", "tests/test_cache.py", "setup.cfg"]
_CODE = [
    "def {n}(self, key, default=None):", '    """Return the value stored under key, or default."""',
    "    if key not in self._items:", "        return default", "    value = self._items.pop(key)",
    "    self._items[key] = value", "    return value", "class {N}Error(ValueError):", "    pass",
    "for path in sorted(paths):", "    with open(path, encoding='utf-8') as fh:", "        data = json.load(fh)",
    "    result.update({{k: v for k, v in data.items() if not k.startswith('_')}})",
]  # fmt: skip
_NAMES = ["get", "load", "evict", "resize", "merge", "parse", "flush", "lookup"]


def synthetic_session(turns: int = 12, seed: int = 0) -> Messages:
    """A coding-agent conversation: system prompt with tool rules, a task, then think + command / tool output turns
    of realistic sizes (assistant ~100-600 characters, tool output ~300-4000)."""
    rng = random.Random(seed)

    def code(lines: int) -> str:
        name = rng.choice(_NAMES)
        return "\n".join(rng.choice(_CODE).format(n=name, N=name.title()) for _ in range(lines))

    system = ("You are a coding agent working in a git repository. Reply with one short THOUGHT and exactly one "
              "bash command in a ```bash block. Read files before editing them, keep edits minimal, and run the "
              "tests after every change. Finish with `echo COMPLETE_TASK` when the tests pass.\n") * 4
    task = ("Fix the bug: `LRUCache.get` does not refresh an entry's position, so recently read keys are evicted "
            f"first. The failing test is tests/test_cache.py::test_get_refreshes.\n\n{code(30)}")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    for i in range(turns):
        path = rng.choice(_FILES)
        command = rng.choice([f"cat -n {path}", f"grep -rn '{rng.choice(_NAMES)}' src/", "python -m pytest -q -x",
                              f"sed -n '{i * 10 + 1},{i * 10 + 40}p' {path}", "git diff"])
        thought = " ".join(rng.choice(["the", "cache", "entry", "moves", "to", "the", "end", "on", "read", "so",
                                       "check", "where", "eviction", "happens"]) for _ in range(rng.randint(15, 80)))
        messages.append({"role": "assistant", "content": f"THOUGHT: {thought}\n\n```bash\n{command}\n```"})
        messages.append({"role": "user", "content": f"<returncode>0</returncode>\n<output>\n"
                                                    f"{code(rng.randint(4, 40))}\n</output>"})
    return messages


def turn_prompts(messages: Messages, encode: Callable[[str], list[int]], max_turns: int, max_context: int,
                 vocab: int) -> list[list[int]]:
    """Token ids before each assistant message (teacher forcing) on an append-only token log, within the limits."""
    fold = lambda ids: [259 + t % (vocab - 259) for t in ids]
    log: list[int] = []
    prompts: list[list[int]] = []
    for m in messages:
        header = fold(encode(f"<|im_start|>{m['role']}\n"))
        if m["role"] == "assistant":
            if len(log) + len(header) > max_context or len(prompts) >= max_turns:
                break
            prompts.append(log + header)
        log += header + fold(encode(m["content"])) + fold(encode("<|im_end|>\n"))
    return prompts


def conversations(folder: Path | None, encode: Callable[[str], list[int]], sessions: int, max_turns: int,
                  max_context: int, vocab: int) -> tuple[str, list[tuple[str, list[list[int]]]]]:
    """(source, [(name, turn prompts)]): from ``folder``'s trajectories — the ``sessions`` with the most turns
    within ``max_context`` — or, with no folder, the synthetic session."""
    if folder is None:
        prompts = turn_prompts(synthetic_session(max_turns), encode, max_turns, max_context, vocab)
        return "synthetic", [("synthetic", prompts)] if len(prompts) >= 2 else []
    from freetoken_agent.evals.perf.agent_replay import load_sessions

    found = [(name, turn_prompts(msgs, encode, max_turns, max_context, vocab))
             for name, msgs in load_sessions(folder, 10_000)]
    if not found:
        raise FreeTokenError(f"no *.traj.json trajectories in {folder}")
    found.sort(key=lambda item: -len(item[1]))  # stable: file-name order among equals
    return str(folder), [item for item in found[:sessions] if len(item[1]) >= 2]


def _ours_turn(ours: Any, session: Any, prompt: list[int]) -> dict[str, Any]:
    before = ours.stats()["reused_tokens"]
    _, ttft = timed(lambda: session.generate(prompt, max_new_tokens=1, stop_token_ids=[]))
    return {"ours_ttft_s": round(ttft, 6), "ours_reused": ours.stats()["reused_tokens"] - before}


def _llama_turn(llm: Any, prompt: list[int]) -> dict[str, Any]:
    import llama_cpp

    evaluated = llama_cpp.llama_perf_context(llm.ctx).n_p_eval
    gen = llm.generate(prompt, top_k=1, temp=0.0)  # keeps the previous KV; evaluates only the new suffix
    _, ttft = timed(lambda: next(gen))  # the generator runs nothing before its first next()
    gen.close()
    return {"peer_ttft_s": round(ttft, 6), "peer_prefilled": llama_cpp.llama_perf_context(llm.ctx).n_p_eval - evaluated}


def replay(ours: Any, llm: Any, name: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Both sides through one conversation, turn by turn, the side that goes first alternating; a fresh session /
    reset KV first."""
    manager = ours.kv_manager()
    manager.radix.clear()
    session = ours.session()
    llm.reset()
    rows = []
    for turn, prompt in enumerate(prompts):
        row: dict[str, Any] = {"session": name, "turn": turn, "prompt_tokens": len(prompt)}
        sides = [lambda p=prompt: _ours_turn(ours, session, p), lambda p=prompt: _llama_turn(llm, p)]
        for fn in sides if turn % 2 == 0 else sides[::-1]:  # A/B, then B/A
            row.update(fn())
        rows.append(row)
    session.close()
    manager.radix.clear()
    return rows


def measure(ours: Any, llm: Any, folder: Path | None, sessions: int, max_turns: int, max_context: int,
            vocab: int) -> dict[str, Any]:
    """The ``agent_replay`` row: per-turn TTFT on both sides, medians over turns >= 1, the speed ratio."""
    from freetoken_agent.runtime.models import resolve_model
    from freetoken_agent.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(resolve_model("builtin"))
    source, convs = conversations(folder, tok.encode, sessions, max_turns, max_context, vocab)
    if not convs:
        raise FreeTokenError(f"no conversation from {source} has 2 turns within {max_context} tokens")
    rows = [r for name, prompts in convs for r in replay(ours, llm, name, prompts)]
    later = [r for r in rows if r["turn"] >= 1]
    ours_med = statistics.median(r["ours_ttft_s"] for r in later)
    peer_med = statistics.median(r["peer_ttft_s"] for r in later)
    return {
        "peer": "llama.cpp Q4_0 prefix reuse", "source": source, "sessions": len(convs), "turns": len(rows),
        "max_context": max_context, "median_prompt_tokens": statistics.median(r["prompt_tokens"] for r in later),
        "median_new_tokens": statistics.median(r["peer_prefilled"] for r in later),
        "ours_ttft_s": round(ours_med, 6), "peer_ttft_s": round(peer_med, 6), "ratio": round(peer_med / ours_med, 3),
        "turn0_ours_ttft_s": statistics.median(r["ours_ttft_s"] for r in rows if r["turn"] == 0),
        "turn0_peer_ttft_s": statistics.median(r["peer_ttft_s"] for r in rows if r["turn"] == 0),
        "per_turn": rows,
    }  # fmt: skip


def options(p: Any) -> None:
    from freetoken_agent.evals.perf.suite import add_trajectories_arg

    add_trajectories_arg(p)
    p.add_argument("--model", default=None, help="a qwen3_moe folder (default: the 1.3B synthetic one)")
    p.add_argument("--sessions", type=int, default=1, help="conversations replayed")
    p.add_argument("--turns", type=int, default=8, help="assistant turns per conversation, at most")
    p.add_argument("--context", type=int, default=3072, help="longest prompt replayed, in tokens")
    p.add_argument("--threads", type=int, default=1)


@row("agent-replay", "agent sessions turn by turn on the same weights: time to first token per turn with prefix "
     "reuse, ours vs llama.cpp", options)
def agent_replay_row(args: Any) -> dict[str, Any]:
    import json

    from freetoken_agent.evals.perf import bench_decode, bench_gguf_decode
    from freetoken_agent.evals.perf.suite import require_llama_cpp, trajectories_from
    from freetoken_agent.evals.perf.suite_llama import open_llama
    from freetoken_agent.runtime.engine import Engine

    if min(args.sessions, args.turns, args.threads) < 1 or args.context < 64:
        raise BenchError("--sessions, --turns and --threads must be at least 1, --context at least 64")
    folder_traj = trajectories_from(args.trajectories)
    require_llama_cpp()
    folder = Path(args.model) if args.model else bench_gguf_decode.write_checkpoint(
        bench_decode.CACHE / "gguf" / "qwen3_moe-1b")
    if not (folder / "config.json").is_file():
        raise BenchError(f"--model {folder}: no config.json there")
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    ours = Engine.from_pretrained(folder, quant="q4", threads=args.threads)
    llm = open_llama(bench_gguf_decode.ensure_gguf(folder, args.threads), args.threads, n_ctx=args.context + 64)
    try:
        return measure(ours, llm, folder_traj, args.sessions, args.turns, args.context, vocab)
    except FreeTokenError as exc:
        raise BenchError(str(exc)) from None
