"""The built-in model's plain-turn data: conversations that end in a text answer, scored on the assistant turns."""

from __future__ import annotations

import json
import random
from pathlib import Path

from freetoken_agent.evals.builtin.chat import assistant_mask_spans, chat_conversation
from freetoken_agent.evals.builtin.corpus import IGNORE, chat_batch, chat_docs
from freetoken_agent.evals.builtin.data import closing_turn, render_session, session_messages
from freetoken_agent.evals.builtin.template import render
from freetoken_agent.runtime.builtin import builtin_model_dir
from tokenizers import Tokenizer

from .builtin_sessions import write_session


def test_conversations_end_in_a_plain_answer_and_vary() -> None:
    rng = random.Random(7)
    conversations = [chat_conversation(rng) for _ in range(300)]
    systems, with_tools, round_trips = set(), 0, 0
    for messages, tools in conversations:
        last = messages[-1]
        assert last["role"] == "assistant" and last["content"].strip() and not last.get("tool_calls")
        if messages[0]["role"] == "system":
            systems.add(messages[0]["content"])
        with_tools += tools is not None
        offered = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in tools or []}
        for m in messages:
            for call in m.get("tool_calls") or []:
                round_trips += 1
                name, args = call["function"]["name"], call["function"]["arguments"]
                assert name in offered and set(args) <= set(offered[name])  # a call uses a tool that was offered
    assert len(systems) >= 20 and 0.4 * 300 <= with_tools <= 0.8 * 300 and round_trips >= 10
    again = random.Random(7)
    assert [chat_conversation(again) for _ in range(300)] == conversations  # seeded


def test_only_assistant_turns_are_scored() -> None:
    tok = Tokenizer.from_file(str(builtin_model_dir() / "tokenizer.json"))
    docs = chat_docs(tok, 40, seed=3)
    rng = random.Random(3)
    texts = sorted((render(*chat_conversation(rng)) + "<|endoftext|>" for _ in range(40)), key=len)
    for ids, labels, text in zip(docs.ids, docs.labels, texts):
        scored = tok.decode(ids[labels != IGNORE].tolist(), skip_special_tokens=False)
        expected = "".join(text[a:b] for a, b in assistant_mask_spans(text))
        assert scored == expected and scored.endswith("<|im_end|>")
        assert bool((labels[labels != IGNORE] == ids[labels != IGNORE]).all())
    ids, labels, mask = chat_batch(docs, 3, None)
    assert ids.shape == labels.shape == mask.shape and ids.shape[0] == 3
    assert int(mask.sum()) == sum(d.numel() for d in docs.ids[:3])
    assert bool((labels[mask == 0] == IGNORE).all())


def test_a_submitted_session_gets_a_closing_answer_only_when_asked(tmp_path: Path) -> None:
    diff = "diff --git a/pkg/rows.py b/pkg/rows.py\n--- a/pkg/rows.py\n+++ b/pkg/rows.py\n@@ -1 +1 @@\n-a\n+b"
    path = write_session(tmp_path, "demo__demo-2", turns=[
        ("THOUGHT: look.", "cat pkg/rows.py", "a"),
        ("THOUGHT: I am ready to submit.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff", diff)])
    data = json.loads(path.read_text())
    data["messages"] = data["messages"][:-1]  # mini-swe-agent stops at the submit's output
    path.write_text(json.dumps(data))
    assert closing_turn(session_messages(path)) == {"role": "assistant",
                                                    "content": "Submitted. The fix changes `pkg/rows.py`."}
    assert render_session(path, closing=True).endswith(
        "<|im_start|>assistant\nSubmitted. The fix changes `pkg/rows.py`.<|im_end|>\n<|endoftext|>")
    assert "Submitted." not in render_session(path)
    unfinished = write_session(tmp_path, "demo__demo-3", turns=[("THOUGHT: look.", "ls", "a.py")])
    assert closing_turn(session_messages(unfinished)) is None


def test_session_openings_end_after_the_first_agent_step(tmp_path: Path) -> None:
    from freetoken_agent.evals.builtin.corpus import session_openings

    path = write_session(tmp_path, "demo__demo-4", turns=[("THOUGHT: look.", "ls", "a.py"), ("THOUGHT: read.", "cat a.py", "x")])
    (opening,) = session_openings([path])
    assert opening.endswith('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
                            "<|endoftext|>")
    assert "<tool_response>" not in opening and opening.count("<|im_start|>assistant") == 1
