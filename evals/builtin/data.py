"""Training text for the built-in model: agent sessions rendered through the chat template, plus stdlib code.

Sessions are mini-swe-agent trajectories (``trajectory_format: mini-swe-agent-1``). Each becomes OpenAI-style
messages: the system prompt, the task, assistant turns as their THOUGHT text plus one ``bash`` tool call (the
command of the fenced block), and tool turns carrying the command output. :func:`phase_spans` labels the
rendered text by phase (plan text, code/commands, tool output) for the routing report.
"""

from __future__ import annotations

import json
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken_agent.evals.builtin.template import BASH_TOOL, render

DEFAULT_DATA_DIR = Path("../shared/data/agent-trajectories")
_BASH_BLOCK = re.compile(r"```bash\s*\n(.*?)\n?```", re.DOTALL)


@dataclass(frozen=True)
class Split:
    """Session files divided deterministically: every ``every``-th file (sorted by name) is held out."""

    train: list[Path]
    held_out: list[Path]


def session_files(data_dir: Path) -> list[Path]:
    """All ``*.traj.json`` files of ``data_dir``, sorted by name; a clear error if there are none."""
    files = sorted(Path(data_dir).glob("*.traj.json"))
    if not files:
        raise FileNotFoundError(f"no *.traj.json session files in {data_dir}")
    return files


def split_sessions(files: list[Path], every: int = 10) -> Split:
    """Hold out files ``every-1, 2*every-1, ...`` (about 1/every of them, at least one when there are two or more)."""
    held = [f for i, f in enumerate(files) if i % every == every - 1]
    if not held and len(files) > 1:
        held = [files[-1]]
    return Split(train=[f for f in files if f not in held], held_out=held)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def session_messages(path: Path) -> list[dict[str, Any]]:
    """Convert one trajectory file to OpenAI-style messages (system, user, assistant + tool_calls, tool)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise ValueError(f"{path}: not a mini-swe-agent trajectory (no 'messages' list)")  # noqa: TRY004
    out: list[dict[str, Any]] = []
    pending_call: str | None = None
    for raw in data["messages"]:
        role, text = raw.get("role"), _text(raw.get("content", ""))
        if role == "assistant":
            match = _BASH_BLOCK.search(text)
            if match is None:
                out.append({"role": "assistant", "content": text.strip()})
                pending_call = None
                continue
            thought = (text[: match.start()] + text[match.end():]).strip()
            pending_call = f"call_{len(out)}"
            call = {"id": pending_call, "type": "function",
                    "function": {"name": "bash", "arguments": {"command": match.group(1)}}}
            out.append({"role": "assistant", "content": thought, "tool_calls": [call]})
        elif role == "user" and pending_call is not None:
            out.append({"role": "tool", "tool_call_id": pending_call, "content": text})
            pending_call = None
        elif role in ("system", "user"):
            out.append({"role": role, "content": text})
    return out


_DIFF_FILE = re.compile(r"^diff --git a/(\S+) b/", re.MULTILINE)


def closing_turn(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A short final text answer for a session that ends with its submit command's output (the diff), naming the
    files the diff changes; None when the session ends otherwise (mini-swe-agent stops at the submit, so the
    sessions never show the turn a chat client expects after the last tool result)."""
    if len(messages) < 2 or messages[-1]["role"] != "tool":
        return None
    calls = messages[-2].get("tool_calls") or []
    if not calls or "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" not in str(calls[0]["function"]["arguments"]):
        return None
    files = list(dict.fromkeys(_DIFF_FILE.findall(messages[-1]["content"])))
    if not files:
        return {"role": "assistant", "content": "I submitted the task; the diff is empty."}
    listed = ", ".join(f"`{f}`" for f in files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
    return {"role": "assistant", "content": f"Submitted. The fix changes {listed}."}


def render_session(path: Path, closing: bool = False) -> str:
    """One session as training text: the chat template with the ``bash`` tool, ending in ``<|endoftext|>``.

    ``closing`` adds :func:`closing_turn` after a submitted session (training text only; the held-out text is
    rendered without it, so perplexities stay comparable across runs)."""
    messages = session_messages(path)
    final = closing_turn(messages) if closing else None
    return render(messages + ([final] if final else []), tools=[BASH_TOOL]) + "<|endoftext|>"


def stdlib_sources(max_chars: int) -> Iterator[str]:
    """Python standard-library modules (tests excluded), sorted by path, until ``max_chars`` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts)
        if total >= max_chars or "site-packages" in parts or "test" in parts or "tests" in parts:
            if total >= max_chars:
                return
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = text[: max_chars - total]
        total += len(text)
        yield f"# {path.relative_to(root).as_posix()}\n{text}<|endoftext|>"


# The three phases the runtime schedules for, as they appear in the rendered template.
_SPAN_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("code", re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)),
    ("tool", re.compile(r"<tool_response>.*?</tool_response>", re.DOTALL)),
    ("plan", re.compile(r"(?<=<\|im_start\|>assistant\n)(?:(?!<tool_call>|<\|im_end\|>).)+", re.DOTALL)),
]


def phase_spans(text: str) -> list[tuple[int, int, str]]:
    """Character spans ``(start, end, phase)`` of plan text, code/commands and tool output in rendered text.

    The system prompt and the task are in no span (neither phase). Spans do not overlap: the ``plan`` pattern
    stops at the first ``<tool_call>`` of an assistant turn.
    """
    first_turn = text.find("<|im_start|>assistant")  # the tools block of the system turn is no phase
    if first_turn < 0:
        return []
    spans = [(m.start(), m.end(), name) for name, pattern in _SPAN_PATTERNS for m in pattern.finditer(text)
             if m.start() >= first_turn]
    return sorted(spans)
