"""TTFT with KV pre-staging on vs off: held-out agent sessions replayed turn by turn through ``LocalEngine``.

    python -m freetoken_agent.evals.perf.phase_live --kv [--max-sessions N] [--kv-turns 24] [--kv-rounds 2] --json

Each held-out session's messages (system, task, assistant + bash call, tool result, ...) are replayed the way the
agent loop drives ``LocalEngine``: before each assistant message a ``plan`` hint and a turn on the engine session
(the rendered conversation so far, one token generated: its TTFT is what is measured); the assistant's reply is
then fed as if decoded (``Session.prefill`` of the rendered reply, outside TTFT); before each tool result the
loop's ``expect_prompt`` (the conversation plus the tool-result framing) and a ``tool`` hint with the modelled
duration (``phase_trace.tool_seconds``). With pre-staging on, the pause warms the known prefix in the prefix cache;
the pause is modelled as over when the warm is done (``warm_over_pause`` counts warms longer than their modelled
pause). Off and on alternate per session and round (same process, same machine state); the built-in model runs
without a memory budget, so the difference is the KV path alone. The replay feeds the recorded replies, which
re-render exactly, so what is warmed is the framing (``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n``), whole
16-token pages only; live runs whose re-rendered history diverges from the generated tokens save more.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def replay(local: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]], prestage: bool,
           max_turns: int) -> dict[str, Any]:
    """One session through ``local`` (a fresh KV manager: nothing cached from other runs)."""
    from freetoken_agent.evals.perf.phase_trace import tool_seconds
    from freetoken_agent.runtime.kv import KVConfig

    from freetoken_agent.backends import GenerateRequest
    from freetoken_agent.phases import Phase

    engine, tokenizer, key = local.engine, local.engine.tokenizer, "replay"
    manager = engine.kv_manager(KVConfig(page_size=16, device_pages=4096))
    manager.prestage.enabled = prestage
    session = local._session(key)
    ttft, turn_prefill, reused, over, turns = [], 0, 0, 0, 0
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if turns == max_turns:
            break
        local.hint(Phase.PLAN, None, session=key)
        ids = tokenizer.encode(local.render(GenerateRequest(messages=messages[:k], tools=tools)))
        hits = manager.stats.prefix_hit_tokens
        session.generate(ids, max_new_tokens=1, temperature=0.0)
        if turns:  # turns after a tool pause (the first turn is the task: nothing to warm before it)
            ttft.append(manager.stats.ttft_s[-1])
            turn_prefill += len(ids) - (manager.stats.prefix_hit_tokens - hits)
            reused += manager.stats.prefix_hit_tokens - hits
        turns += 1
        reply = tokenizer.encode(engine.render_chat(messages[: k + 1], tools, add_generation_prompt=False))
        session.prefill(reply[:-2])  # as if decoded: the reply up to its end-of-turn token (sampled, not fed)
        result = messages[k + 1] if k + 1 < len(messages) else None
        if result is None or result["role"] != "tool":
            continue
        calls = message.get("tool_calls") or [{}]
        command = str(calls[0].get("function", {}).get("arguments", {}).get("command", ""))
        pause_s = tool_seconds(command, len(result["content"]))
        local.expect_prompt(key, [*messages[: k + 1], {**result, "content": ""}], tools)
        local.hint(Phase.TOOL, pause_s, session=key)
        before = manager.prestage.stats.seconds
        manager.prestage.wait()  # the engine idles through the pause; the warm runs inside it
        over += manager.prestage.stats.seconds - before > pause_s
    local.end_session(key)
    manager.prestage.close()  # the next replay gets a fresh manager (and stager thread)
    return {"ttft_s": ttft, "turn_prefill_tokens": turn_prefill, "turn_reused_tokens": reused,
            "warm": manager.prestage.stats.snapshot(), "warm_over_pause": over}


def compare(files: list[Path], max_turns: int, rounds: int) -> dict[str, Any]:
    """Off and on, alternating per session and round; per-turn TTFT medians and prefill totals."""
    from freetoken_agent.evals.builtin.data import session_messages
    from freetoken_agent.evals.builtin.template import BASH_TOOL
    from freetoken_agent.runtime.builtin import builtin_model_dir

    from freetoken_agent.backends.local import LocalEngine

    local = LocalEngine.from_pretrained(builtin_model_dir(), threads=1)
    out: dict[str, dict[str, Any]] = {m: {"ttft_s": [], "turn_prefill_tokens": 0, "turn_reused_tokens": 0,
                                          "warmed_tokens": 0, "warm_over_pause": 0} for m in ("off", "on")}
    for r in range(rounds):
        for i, f in enumerate(files):
            messages = session_messages(f)
            order = ("off", "on") if (r + i) % 2 == 0 else ("on", "off")
            for mode in order:
                got = replay(local, messages, [BASH_TOOL], mode == "on", max_turns)
                row = out[mode]
                row["ttft_s"] += got["ttft_s"]
                for name in ("turn_prefill_tokens", "turn_reused_tokens", "warm_over_pause"):
                    row[name] += got[name] if r == 0 else 0  # token counts are the same every round
                row["warmed_tokens"] += got["warm"]["prefilled_tokens"] if r == 0 else 0
    rows = []
    for mode, row in out.items():
        times = row.pop("ttft_s")
        rows.append({"kv_prestage": mode, "turns": len(times) // rounds,
                     "ttft_median_ms": round(1e3 * statistics.median(times), 3) if times else None,
                     "ttft_mean_ms": round(1e3 * statistics.fmean(times), 3) if times else None, **row})
    off, on = rows
    ratio = on["ttft_median_ms"] / off["ttft_median_ms"] if off["ttft_median_ms"] else None
    return {"rows": rows, "ttft_median_ratio_on_vs_off": round(ratio, 4) if ratio else None,
            "turn_prefill_saved": off["turn_prefill_tokens"] - on["turn_prefill_tokens"]}
