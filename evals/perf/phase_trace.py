"""Routing traces of real agent sessions, cut into the phases an agent loop would announce, with tool pauses.

A trace is one session rendered through the built-in model's chat template (``evals/builtin/data``), tokenized,
labelled per token by phase (plan text, code/commands, tool output; the labelling of ``routing_report``), and run
through the model in ``window``-token windows from an empty cache (as the model was trained) while every MoE
layer's top-k choice is recorded. ``segments`` turns the token stream into what the engine would see:

- ``prefill`` of the session start (system prompt + task), under a ``plan`` hint;
- ``decode`` of plan text (``plan`` hint at the turn start) and of the tool call (``code`` hint mid-stream);
- a tool ``pause`` (``tool`` hint with the modelled duration) during which the tool output is prefilled as it
  streams in;
- ``prefill`` of the next turn's framing (``<|im_end|>``, ``<|im_start|>assistant``): the TTFT tail.

Tool durations (seconds) come from ``tool_seconds``, a documented model of the recorded bash commands (the
trajectories carry no timings): test runs 6 s, installs/builds 15 s, Python scripts 1.5 s, searches 0.4 s, git
0.2 s, file views and edits 0.05 s, anything else 0.5 s; plus the output streamed at 200 kB/s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from freetoken_agent.evals.builtin.data import render_session, session_messages
from freetoken_agent.evals.perf.routing_report import token_phases

_RULES: list[tuple[re.Pattern[str], float]] = [
    (re.compile(r"\b(pytest|tox|unittest|runtests\.py|nosetests|manage\.py test)\b"), 6.0),
    (re.compile(r"\b(pip|conda) install\b|\bsetup\.py\b|\bmake\b"), 15.0),
    (re.compile(r"\bpython3?\b"), 1.5),
    (re.compile(r"^\s*(grep|find|rg|ag)\b|\|\s*grep\b"), 0.4),
    (re.compile(r"^\s*git\b"), 0.2),
    (re.compile(r"^\s*(cat|head|tail|ls|sed|nl|echo|wc|cd|mkdir|cp|mv|rm|touch|diff)\b"), 0.05),
]
STREAM_BYTES_PER_S = 200_000.0


def tool_seconds(command: str, output_chars: int) -> float:
    """Modelled wall time of one bash tool call (see the module docstring)."""
    base = next((s for pattern, s in _RULES if pattern.search(command)), 0.5)
    return base + output_chars / STREAM_BYTES_PER_S


def tool_durations(path: Path) -> list[float]:
    """The modelled duration of each tool result of a session, in order."""
    out, command = [], ""
    for m in session_messages(path):
        if m["role"] == "assistant":
            calls = m.get("tool_calls") or []
            command = calls[0]["function"]["arguments"]["command"] if calls else ""
        elif m["role"] == "tool":
            out.append(tool_seconds(command, len(m["content"])))
    return out


@dataclass
class Trace:
    """One session: per token its phase label and each MoE layer's top-k experts."""

    name: str
    labels: list[str | None]
    ids: torch.Tensor
    """[T, L_moe, K] int16 expert ids."""
    layers: list[int]
    """The MoE layer index of each column of ``ids``."""
    tools: list[float]
    """Modelled seconds of each tool result, in order."""


def collect(engine, tokenizer, path: Path, window: int = 512, max_tokens: int | None = None) -> Trace:
    """Run ``engine`` over the session at ``path`` and record its routing (see the module docstring)."""
    layers = [i for i, layer in enumerate(engine.spec.layers) if layer.moe is not None]
    seen: dict[int, torch.Tensor] = {}

    def record(layer: int, ids: torch.Tensor) -> None:
        seen[layer] = ids.detach().to(torch.int16).cpu()

    text = render_session(path)
    enc = tokenizer.encode(text)
    ids, labels = enc.ids[:max_tokens], token_phases(text, enc.offsets)[:max_tokens]
    chunks = []
    engine.decoder.routing_observers.append(record)
    try:
        for start in range(0, len(ids), window):
            engine.logits(ids[start : start + window])
            chunks.append(torch.stack([seen[i] for i in layers], dim=1))  # [t, L_moe, K]
    finally:
        engine.decoder.routing_observers.remove(record)
    return Trace(path.name, labels, torch.cat(chunks), layers, tool_durations(path))


def cached_trace(engine, tokenizer, path: Path, cache: Path, key: str, window: int,
                 max_tokens: int | None) -> Trace:
    """``collect``, kept in ``cache`` (keyed by model, session, window, length) so reruns skip the forwards."""
    file = cache / f"{key}-{path.name}-{window}-{max_tokens or 'all'}.pt"
    if file.is_file():
        data = torch.load(file, weights_only=False)
        return Trace(**data)
    trace = collect(engine, tokenizer, path, window, max_tokens)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    torch.save(trace.__dict__, tmp)
    tmp.replace(file)
    return trace


@dataclass
class Segment:
    """A stretch of tokens ``[start, end)`` the engine handles one way, and the hint announced before it."""

    kind: str
    """``prefill`` (TTFT path), ``decode`` (generated) or ``pause`` (tool output prefilled while the tool runs)."""
    phase: str
    """The phase its tokens are recorded under (``plan``, ``code`` or ``tool``)."""
    start: int
    end: int
    hint: str | None
    """The hint sent when the segment starts (None: no change)."""
    pause_s: float = 0.0
    """``pause`` segments: the tool's modelled duration."""
    turn_start: bool = False
    """The first segment of an assistant turn (TTFT is measured from its start)."""


def segments(trace: Trace) -> list[Segment]:
    """The engine's view of a trace (see the module docstring); unlabelled tokens join their neighbour's role."""
    runs: list[tuple[str | None, int, int]] = []
    for t, lab in enumerate(trace.labels):
        if runs and runs[-1][0] == lab:
            runs[-1] = (lab, runs[-1][1], t + 1)
        else:
            runs.append((lab, t, t + 1))
    out: list[Segment] = []
    phase, tools = None, iter(trace.tools)
    for j, (lab, a, b) in enumerate(runs):
        nxt = next((r[0] for r in runs[j + 1 :] if r[0] is not None), None)
        if lab in ("plan", "code"):
            out.append(Segment("decode", lab, a, b, lab if phase != lab else None))
            phase = lab
        elif lab == "tool" or (lab is None and nxt == "tool" and phase is not None):
            if phase != "tool":  # the tool starts: its framing and output are prefilled during the pause
                out.append(Segment("pause", "tool", a, b, "tool", pause_s=next(tools, 0.5)))
            else:
                out.append(Segment("pause", "tool", a, b, None))
            phase = "tool"
        else:  # session start, or the framing of the next assistant turn: prefilled when the turn starts
            start_turn = phase != "plan"
            out.append(Segment("prefill", "plan", a, b, "plan" if start_turn else None, turn_start=start_turn))
            phase = "plan"
    return out
