"""The shipped built-in model: complete, small, and the same model in our engine and in ``transformers``."""

from __future__ import annotations

import json

import pytest
import torch
from freetoken_agent.evals.builtin.template import BASH_TOOL
from freetoken_agent.runtime.builtin import BUILTIN_SYSTEM_PROMPT, builtin_model_dir
from freetoken_agent.runtime.engine import Engine

CONVERSATION = [
    {"role": "system", "content": BUILTIN_SYSTEM_PROMPT},
    {"role": "user", "content": "<pr_description>\n`str.split` drops the last field in parse_row().\n</pr_description>"},
    {"role": "assistant", "content": "THOUGHT: Let me find parse_row first.",
     "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "grep -rn parse_row ."}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "<returncode>0</returncode>\n<output>\n./csvtool/rows.py:12:def parse_row(line):\n</output>"},
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(builtin_model_dir(), dtype="float32")


def test_folder_is_complete_small_and_a_qwen3_moe() -> None:
    folder = builtin_model_dir()
    assert sum(p.stat().st_size for p in folder.iterdir() if p.is_file()) <= 25_000_000
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == 16 and config["num_experts_per_tok"] == 2
    assert "<tool_call>" in json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    training = json.loads((folder / "training.json").read_text())
    assert training["held_out_ppl"] > 1 and training["held_out_sessions"]


def test_engine_and_transformers_agree_on_logits_and_greedy_output(engine: Engine) -> None:
    transformers = pytest.importorskip("transformers")
    folder = builtin_model_dir()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert 10e6 <= sum(p.numel() for p in hf.parameters()) <= 30e6

    prompt = engine.render_chat(CONVERSATION, tools=[BASH_TOOL], add_generation_prompt=True)
    assert prompt == hf_tok.apply_chat_template(CONVERSATION, tools=[BASH_TOOL], tokenize=False, add_generation_prompt=True)
    ids = engine.tokenizer.encode(prompt)
    assert ids == hf_tok.encode(prompt, add_special_tokens=False)

    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()  # [T, V]
    got = engine.logits(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4

    ours = engine.generate(ids, max_new_tokens=40, temperature=0.0)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)[0, len(ids):].tolist()
    assert ours.token_ids == theirs
    assert ours.text == hf_tok.decode(theirs, skip_special_tokens=False)


TASKS = [
    "`str.split` drops the last field in parse_row().",
    "Fix the off-by-one in utils.py: range(len(items) - 1) skips the last item.",
    "QuerySet.order_by() ignores a descending field given with a leading minus sign.",
    "The CLI crashes with KeyError: 'path' when the config file has no [paths] section.",
    "Add a --verbose flag to the build script that prints each command before it runs.",
    "DateField.to_python() raises TypeError for an empty string instead of returning None.",
    "The cache never expires entries: set() ignores its ttl argument.",
    "Running the test suite on Windows fails because paths are joined with '/'.",
]
"""PR descriptions in the style of the training sessions' tasks (none of them is one)."""


def test_builtin_model_speaks_the_agent_format(engine: Engine) -> None:
    """Greedy replies to tasks it never saw: THOUGHT text, then a bash tool call in the Hermes format, on most of them
    (a model this small does not on every one; the shipped weights: 6 of 8, measured)."""
    replies = [engine.chat([{"role": "system", "content": BUILTIN_SYSTEM_PROMPT},
                            {"role": "user", "content": f"<pr_description>\n{task}\n</pr_description>"}],
                           tools=[BASH_TOOL], max_new_tokens=150, temperature=0.0).text for task in TASKS]
    good = [r for r in replies if r.startswith("THOUGHT:") and "<tool_call>" in r and '"name": "bash"' in r]
    assert len(good) * 2 > len(TASKS), replies
