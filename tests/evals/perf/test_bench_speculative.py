"""``bench_speculative``'s draft-model measurements on a tiny model: teacher-forced predictions of a model over its
own greedy output are all right (top-1 1.0, every draft accepted, k + 1 tokens per step but at the span's end), and
the real drafter's cost is measured; the oracle with the engine's history drafts a reply another session wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from freetoken_agent.evals.perf.bench_speculative import (
    DRAFTS,
    EDIT,
    builtin_tokenizer,
    draft_cost,
    draft_oracle,
    oracle_table,
    phase_spans,
    record_replies,
)
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.generation.sampling import SamplingParams

pytest.importorskip("transformers")
from tests.runtime.arch_configs import save_checkpoint  # noqa: E402
from tests.runtime.batched_engines import batch_invariant  # noqa: E402,F401 (autouse fixture)


def test_a_model_predicts_its_own_greedy_output(tmp_path: Path) -> None:
    save_checkpoint("qwen3_moe", tmp_path)
    engine = Engine.from_pretrained(tmp_path, speculate=False)
    prompt = [(7 * i) % 500 + 1 for i in range(40)]
    out = engine.generate(prompt, SamplingParams(max_new_tokens=60, stop_token_ids=())).token_ids
    engine.close()
    ids = prompt + out
    labels: list[str | None] = [None] * len(prompt) + ["code"] * len(out)
    r = draft_oracle([("s", ids, labels)], "code", tmp_path, window=64)
    assert r["top1"] == 1.0 and r["positions"] == 60
    for k in DRAFTS:
        steps = -(-60 // (k + 1))  # every draft accepted: k + 1 tokens a step, the last step what is left
        assert r[str(k)]["steps"] == steps and r[str(k)]["acceptance"] == 1.0
        assert r[str(k)]["tokens"] == 60 and r[f"+{k}"]["tokens"] == 60
    cost = draft_cost(tmp_path, ids, context=40, k=4, proposals=5)
    assert cost["ms_per_draft_token"] > 0 and cost["proposals"] == 5


def test_the_oracle_drafts_from_the_replies_of_earlier_sessions() -> None:
    from freetoken_agent.runtime.generation.speculative import TokenHistory

    reply = [900 + i for i in range(40)]  # a reply the first session wrote and the second writes again
    sessions = []
    for n in range(2):
        prompt = [10 * n + i % 7 for i in range(30)]
        thought = [500 + n]
        ids = prompt + thought + reply + [1, 2, 3]
        labels = [None] * len(prompt) + ["plan"] + ["code"] * len(reply) + [None] * 3
        sessions.append((f"s{n}", ids, labels))
    plain, with_history = oracle_table(sessions, "code", False), oracle_table(sessions, "code", True)
    for k in (*map(str, DRAFTS), "adaptive"):
        assert plain[k]["tokens"] == with_history[k]["tokens"] == 80
        assert with_history[k]["steps"] < plain[k]["steps"]  # the second session's reply comes from the history
    # first session: one token a step; second: two before the key (last two tokens) matches, then 8 a step
    assert with_history["7"]["steps"] == 40 + 2 + 5
    history = TokenHistory(prompt_tail=2)
    record_replies(history, *sessions[0][1:])  # the thought and the code after it are one reply
    assert history.snapshot()["documents"] == 1 and history.size == 2 + 41


def test_edit_turns_are_the_tool_calls_that_write_a_file() -> None:
    """The ``edit`` selection: code spans whose tool call writes a file, and nothing else."""
    writes = ["cat <<'EOF' > reproduce.py\nprint(1)\nEOF", "cat <<EOF >> tests/test_a.py\nx\nEOF",
              "sed -i 's/a/b/' src/mod.py", "echo x | tee out.txt", "git apply fix.diff", "echo 1 > notes.md",
              "python -c \"open('a.py', 'w').write('x')\""]
    reads = ["ls -R", "cat astropy/io/ascii/rst.py", "sed -n '240,260p' a.py", "grep -n \"class A\" a.py",
             "python3 reproduce.py", "pytest -q tests 2>&1 | tail -5"]
    assert all(EDIT.search(c) for c in writes) and not any(EDIT.search(c) for c in reads)
    tok = builtin_tokenizer()
    ids, labels = [], []
    for text, label in [("prompt ", None), (reads[1], "code"), (" out ", None), (writes[0], "code"),
                        (" more ", None), (writes[2], "code")]:
        piece = tok.encode(text).ids
        ids += piece
        labels += [label] * len(piece)
    code = phase_spans(ids, labels, "code")
    assert len(code) == 3 and phase_spans(ids, labels, "edit") == code[1:]


def test_turns_decode_with_and_without_speculation_best_of_repeats(tmp_path: Path) -> None:
    """The built-in-model row on a tiny checkpoint: every turn gives the same tokens with and without speculation in
    every repeat, and a turn's repeats draft from the history as it was before the turn — not from their own earlier
    run (which would accept the whole reply)."""
    from freetoken_agent.evals.perf.bench_speculative import builtin_decode
    from freetoken_agent.runtime.generation.speculative import SpeculationConfig

    save_checkpoint("qwen3_moe", tmp_path)
    sessions = []
    for n in range(2):
        ids = [(37 * i + 11 * n) % 400 + 20 for i in range(120)]
        labels: list[str | None] = [None] * 40 + ["code"] * 20 + [None] * 30 + ["code"] * 30
        sessions.append((f"s{n}", ids, labels))
    runs = {}
    for repeats in (1, 2):
        runs[repeats] = builtin_decode(sessions, "code", 2, 32, 24, tmp_path, repeats=repeats,
                                       speculate=SpeculationConfig(verify_cost=0.1))
    one, two = runs[1], runs[2]
    assert one["turns"] == two["turns"] == 4 and two["repeats"] == 2
    assert one["identical_turns"] == two["identical_turns"] == "4/4"
    assert two["off"]["tokens"] == one["off"]["tokens"] > 0 and two["on"]["decode_tok_s"] > 0
    assert two["first_runs_speedup"] > 0 and two["speedup"] > 0
    assert two["on"]["drafted"] > 0
    assert two["on"]["acceptance"] <= one["on"]["acceptance"] + 0.2, (one["on"], two["on"])
