"""The suite's parts on their own: replay turns from trajectory files, and llama.cpp's mapping held to a budget."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from freetoken_agent.evals.perf import bench_gguf_decode, suite_replay
from freetoken_agent.runtime.errors import FreeTokenError
from freetoken_agent.runtime.models import resolve_model
from freetoken_agent.runtime.tokenizer import Tokenizer

SMALL = {**bench_gguf_decode.CONFIG, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 16,
         "num_experts_per_tok": 2, "moe_intermediate_size": 128}  # fmt: skip


def _encode() -> Callable[[str], list[int]]:
    return Tokenizer.from_pretrained(resolve_model("builtin")).encode


def _write_traj(folder: Path, name: str, turns: int) -> None:
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": [{"type": "text", "text": "Fix the failing test in utils.py."}]}]
    for i in range(turns):
        messages.append({"role": "assistant", "content": f"THOUGHT: step {i}\n```bash\ncat utils.py | head -{i}\n```"})
        messages.append({"role": "user", "content": "def f(x):\n    return x + 1\n" * (i + 1)})
    (folder / f"{name}.traj.json").write_text(json.dumps({"messages": messages}))


def test_turns_from_trajectories_extend_each_other(tmp_path: Path) -> None:
    _write_traj(tmp_path, "a_short", 1)
    _write_traj(tmp_path, "b_long", 5)
    _write_traj(tmp_path, "c_mid", 3)
    source, convs = suite_replay.conversations(tmp_path, _encode(), 3, 4, 4096, 1000)
    assert source == str(tmp_path)
    assert [name for name, _ in convs] == ["b_long", "c_mid"]  # most turns first; 1-turn sessions dropped
    prompts = convs[0][1]
    assert len(prompts) == 4  # max_turns
    for prev, cur in itertools.pairwise(prompts):
        assert cur[: len(prev)] == prev and len(cur) > len(prev)  # append-only log: turn N+1 extends turn N
    assert all(259 <= t < 1000 for p in prompts for t in p)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "more " * 50}, {"role": "assistant", "content": "ok"}]
    first = suite_replay.turn_prompts(messages, _encode(), 8, 4096, 1000)
    assert len(first) == 2
    assert suite_replay.turn_prompts(messages, _encode(), 8, len(first[1]) - 1, 1000) == first[:1]  # max_context
    with pytest.raises(FreeTokenError, match="no \\*.traj.json"):
        suite_replay.conversations(tmp_path / "missing", _encode(), 1, 4, 4096, 1000)


def test_synthetic_session_is_multi_turn_and_deterministic() -> None:
    a, b = suite_replay.synthetic_session(6, seed=3), suite_replay.synthetic_session(6, seed=3)
    assert a == b and [m["role"] for m in a[:4]] == ["system", "user", "assistant", "user"]
    assert sum(m["role"] == "assistant" for m in a) == 6
    source, convs = suite_replay.conversations(None, _encode(), 1, 6, 8192, 8192)
    assert source == "synthetic" and len(convs[0][1]) == 6
    with pytest.raises(FreeTokenError, match="2 turns"):  # the limit leaves fewer than 2 turns
        suite_replay.measure(None, None, None, 1, 6, 100, 8192)


def test_mapped_budget_holds_llamas_file_to_the_budget(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from freetoken_agent.evals.perf.suite_llama import MappedBudget, open_llama

    folder = bench_gguf_decode.write_checkpoint(tmp_path / "m", config=SMALL)
    path = bench_gguf_decode.ensure_gguf(folder)
    llm = open_llama(path, 1, n_ctx=128, n_batch=64, repack=False)  # --no-repack: experts used from the mmap
    guard = MappedBudget(path, 0)
    assert len(guard.experts) == 2 * 3 * 16  # layers x (gate, up, down) x experts
    guard.drop_all()
    assert guard.resident() < path.stat().st_size // 8
    llm.eval(list(range(300, 364)))  # 64 tokens route to most experts: their pages come in
    held = guard._resident_pages()
    in_experts = sum(int(held[o // 4096 : (o + n) // 4096].sum()) * 4096 for o, n in guard.experts)
    assert in_experts > 0
    guard.budget = guard.resident() - in_experts // 2  # room for half of the resident experts
    freed = guard.enforce()
    assert freed >= in_experts // 2 - 4096 * len(guard.experts) and guard.resident() <= guard.budget + 8 * 4096
    assert guard.peak >= guard.budget and guard.evicted == freed
    llm.eval([400])  # the model still runs: evicted experts fault back in from the file
    guard.close()
