"""The workload of ``bench_concurrent``: recorded agent sessions replayed concurrently over HTTP, and its metrics.

A session is one mini-swe-agent trajectory cut into turns: the prompt before each assistant message (rendered with
the model's chat template, the recorded assistant text teacher-forced into later prompts, as in ``agent_replay``),
and the pause before it. Trajectories carry only each response's ``created`` time (whole seconds), so a pause is
the recorded gap between two responses (the frontier model's latency plus the tool's run), times ``pause_scale``,
at most ``max_pause_s``. Each message is cut to ``max_message_chars`` (mini-swe-agent itself cuts long tool output)
and a session ends before the first turn whose prompt plus ``max_tokens`` would overflow ``ctx``.

``run_sessions`` plays N sessions at once: each sends its turns one after another (streaming, greedy,
``max_tokens`` each), sleeping the pause in between; ``summarize`` turns the per-request timings into throughput
and latency percentiles.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freetoken_agent.evals.perf.agent_replay import load_sessions

TRUNCATED = "\n[... output truncated for the benchmark]"


@dataclass(frozen=True)
class Turn:
    """One request of a session."""

    text: str
    """The rendered prompt (what ``freetoken serve`` tokenizes)."""
    ids: list[int]
    """The same prompt as our tokenizer's ids (what llama-server is sent)."""
    pause_s: float
    """Seconds the client waits before sending it (the scaled tool pause; 0 for the first turn)."""


@dataclass(frozen=True)
class Session:
    name: str
    turns: list[Turn]


@dataclass(frozen=True)
class Workload:
    """How trajectories become sessions."""

    turns: int = 3
    """Turns replayed per session; sessions with fewer turns within ``ctx`` are skipped."""
    ctx: int = 2048
    """Context per session (tokens): a turn's prompt plus ``max_tokens`` must fit."""
    max_tokens: int = 32
    """Tokens generated per request."""
    max_message_chars: int = 800
    """Each message's content is cut to this many characters."""
    pause_scale: float = 0.05
    """Recorded pauses are multiplied by this ..."""
    max_pause_s: float = 2.0
    """... and capped at this."""


def response_times(file: Path) -> list[float]:
    """``created`` of each assistant message's recorded response (seconds), in order; 0 where absent."""
    data = json.loads(file.read_text(encoding="utf-8"))
    out = []
    for m in data["messages"]:
        if m["role"] == "assistant":
            created = ((m.get("extra") or {}).get("response") or {}).get("created")
            out.append(float(created) if isinstance(created, (int, float)) else 0.0)
    return out


def build_sessions(folder: Path, count: int, workload: Workload, render: Callable[[list[dict[str, str]]], str],
                   encode: Callable[[str], list[int]]) -> list[Session]:
    """The first ``count`` trajectories (file-name order) with ``workload.turns`` turns that fit ``workload.ctx``."""
    w = workload
    sessions = []
    for name, messages in load_sessions(folder, 10_000):
        messages = [{**m, "content": m["content"] if len(m["content"]) <= w.max_message_chars
                     else m["content"][: w.max_message_chars] + TRUNCATED} for m in messages]
        times = response_times(folder / f"{name}.traj.json")
        turns: list[Turn] = []
        for i, m in enumerate(messages):
            if len(turns) == w.turns:
                break
            if m["role"] != "assistant":
                continue
            text = render(messages[:i])
            ids = encode(text)
            if len(ids) + w.max_tokens > w.ctx:
                break
            k = len(turns)
            gap = times[k] - times[k - 1] if k and times[k] and times[k - 1] else 0.0
            turns.append(Turn(text, ids, min(max(gap, 0.0) * w.pause_scale, w.max_pause_s)))
        if len(turns) == w.turns:
            sessions.append(Session(name, turns))
        if len(sessions) == count:
            break
    if len(sessions) < count:
        raise ValueError(f"only {len(sessions)} trajectories in {folder} have {w.turns} turns within {w.ctx} tokens "
                         f"(wanted {count}); lower --turns or raise --ctx")
    return sessions


@dataclass
class RequestResult:
    """One streamed request, timed on the client."""

    session: int
    turn: int
    sent_prompt_tokens: int
    start: float = 0.0
    end: float = 0.0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    """Seconds between consecutive chunks that carried text (the inter-token latencies)."""
    chunks: int = 0
    completion_tokens: int | None = None
    """As the server reported it (usage), else None."""
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.chunks


async def stream_request(client: Any, url: str, body: dict[str, Any], result: RequestResult) -> RequestResult:
    """POST ``body`` with ``stream: true`` and time the server-sent events into ``result``."""
    result.start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if any(c.get("text") for c in chunk.get("choices") or []):
                    if result.ttft_s is None:
                        result.ttft_s = now - result.start
                    else:
                        result.gaps_s.append(now - last)
                    last = now
                    result.chunks += 1
                usage = chunk.get("usage")
                if usage:
                    result.completion_tokens = usage.get("completion_tokens")
                    result.prompt_tokens = usage.get("prompt_tokens")
    except Exception as exc:  # a timeout or a dropped connection is one failed request, reported in the table
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.end = time.perf_counter()
    return result


async def run_sessions(url: str, sessions: list[Session], body: Callable[[Turn], dict[str, Any]],
                       request_timeout_s: float, deadline_s: float) -> tuple[list[RequestResult], float]:
    """Play ``sessions`` at once against ``url``; returns every request's timing and the wall time. No session
    starts a turn after ``deadline_s`` (seconds from the start); a failed request ends its session."""
    import httpx

    t0 = time.perf_counter()
    results: list[RequestResult] = []

    async def play(index: int, session: Session) -> None:
        for k, turn in enumerate(session.turns):
            await asyncio.sleep(turn.pause_s)
            if time.perf_counter() - t0 > deadline_s:
                return
            r = await stream_request(client, url, body(turn), RequestResult(index, k, len(turn.ids)))
            results.append(r)
            if r.error:
                return

    limits = httpx.Limits(max_connections=len(sessions) + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s), limits=limits) as client:
        await asyncio.gather(*(play(i, s) for i, s in enumerate(sessions)))
    return results, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated ``q``-th percentile (0..100); None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """Aggregate generated tok/s over the wall time, p50/p99 TTFT and inter-token latency (seconds), counts."""
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    tokens = sum(r.tokens for r in ok)
    mismatched = [r for r in ok if r.prompt_tokens is not None and r.prompt_tokens != r.sent_prompt_tokens]
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
        "tokens": tokens, "wall_s": round(wall_s, 2), "tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
        "prompt_tokens": sum(r.sent_prompt_tokens for r in ok),
        "prompt_token_mismatches": len(mismatched),
        "mean_tokens_per_request": statistics.fmean(r.tokens for r in ok) if ok else 0.0,
    }  # fmt: skip
