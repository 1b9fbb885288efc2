"""The built-in model's data path: trajectory → messages → chat template → phase spans."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from freetoken_agent.evals.builtin.data import (
    phase_spans,
    render_session,
    session_messages,
    split_sessions,
)
from freetoken_agent.evals.builtin.template import BASH_TOOL, CHAT_TEMPLATE, render

from .builtin_sessions import write_session


def test_trajectory_becomes_tool_calls_and_tool_turns(tmp_path: Path) -> None:
    path = write_session(tmp_path, "demo__demo-1", turns=[("THOUGHT: look around.", "ls -la", "a.py\nb.py")])
    messages = session_messages(path)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    call = messages[2]["tool_calls"][0]["function"]
    assert call == {"name": "bash", "arguments": {"command": "ls -la"}}
    assert messages[2]["content"] == "THOUGHT: look around."
    assert messages[3]["content"].startswith("<returncode>0</returncode>") and "b.py" in messages[3]["content"]
    # the final assistant turn without a bash block stays plain text
    assert "tool_calls" not in messages[4]


def test_user_message_without_pending_call_stays_user(tmp_path: Path) -> None:
    data = {"trajectory_format": "mini-swe-agent-1", "messages": [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "task"},
        {"role": "assistant", "content": "no block here"},
        {"role": "user", "content": [{"type": "text", "text": "Please always provide EXACTLY ONE action"}]}]}
    path = tmp_path / "x.traj.json"
    path.write_text(json.dumps(data))
    assert [m["role"] for m in session_messages(path)] == ["system", "user", "assistant", "user"]


def test_bad_file_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.traj.json"
    path.write_text(json.dumps({"no": "messages"}))
    with pytest.raises(ValueError, match="not a mini-swe-agent trajectory"):
        session_messages(path)


def test_split_is_deterministic_and_disjoint(tmp_path: Path) -> None:
    files = [tmp_path / f"s{i:02d}.traj.json" for i in range(25)]
    split = split_sessions(files, every=10)
    assert [f.name for f in split.held_out] == ["s09.traj.json", "s19.traj.json"]
    assert set(split.train).isdisjoint(split.held_out) and len(split.train) == 23
    assert split_sessions(files[:3], every=10).held_out == [files[2]]


def test_render_matches_transformers_apply_chat_template(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw)
    tok.chat_template = CHAT_TEMPLATE
    messages = session_messages(write_session(tmp_path, "a__a-1", turns=[
        ("THOUGHT: one.", "cat x.py", "print(1)"), ("THOUGHT: two.", "python x.py", "1")]))
    messages.insert(4, {"role": "tool", "tool_call_id": "extra", "content": "second result"})
    for tools in (None, [BASH_TOOL]):
        for gen in (False, True):
            expected = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
            assert render(messages, tools=tools, add_generation_prompt=gen) == expected
    text = render(messages, tools=[BASH_TOOL], add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "cat x.py"}}\n</tool_call><|im_end|>' in text
    assert "<tool_response>\nprint(1)" not in text  # tool output keeps its <returncode> wrapper
    assert text.count("<|im_start|>user\n<tool_response>") == 2  # two grouped tool results form one user turn


def test_phase_spans_label_plan_code_and_tool(tmp_path: Path) -> None:
    text = render_session(write_session(tmp_path, "b__b-1", turns=[("THOUGHT: check it.", "grep -n foo x.py", "3:foo")]))
    spans = phase_spans(text)
    by_phase = {phase: [text[a:b] for a, b, p in spans if p == phase] for phase in ("plan", "code", "tool")}
    assert by_phase["plan"][0] == "THOUGHT: check it.\n"
    assert by_phase["code"] == ['<tool_call>\n{"name": "bash", "arguments": {"command": "grep -n foo x.py"}}\n</tool_call>']
    assert by_phase["tool"][0].startswith("<tool_response>\n<returncode>0</returncode>") and "3:foo" in by_phase["tool"][0]
    # the tools block of the system turn (which shows a <tool_call> example) is not labelled
    first_assistant = text.index("<|im_start|>assistant")
    assert all(a >= first_assistant for a, _, _ in spans)
    assert all(b1 <= a2 for (_, b1, _), (a2, _, _) in itertools.pairwise(spans))  # no overlaps
