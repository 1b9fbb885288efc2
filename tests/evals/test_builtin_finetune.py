"""``train --init-from``: continue an exported model (its tokenizer and size kept) with the chat conversations mixed in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .builtin_sessions import write_session

transformers = pytest.importorskip("transformers")  # the training script is a dev tool

TINY = ["--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--experts", "4", "--top-k", "2",
        "--expert-hidden", "16", "--vocab", "384", "--seq-len", "64", "--batch", "2", "--lr", "1e-2", "--warmup", "2",
        "--stdlib-chars", "20000", "--log-every", "1", "--eval-windows", "4", "--holdout-every", "4",
        "--chat-docs", "80", "--chat-batch", "2"]


def test_fine_tune_keeps_the_tokenizer_and_size_and_records_the_base(tmp_path: Path) -> None:
    from freetoken_agent.evals.builtin.train import run

    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        write_session(data, f"proj__proj-{i}", turns=[(f"THOUGHT: read m{i}.py.", f"cat m{i}.py", f"x = {i}")])
    base = tmp_path / "base"
    run(["--data-dir", str(data), "--work-dir", str(tmp_path / "w1"), "--out", str(base), *TINY, "--max-steps", "4"])

    tuned = tmp_path / "tuned"
    # size flags that disagree with the base are ignored: the base folder decides
    final = run(["--data-dir", str(data), "--work-dir", str(tmp_path / "w2"), "--out", str(tuned), *TINY,
                 "--hidden", "64", "--init-from", str(base), "--max-steps", "6"])
    assert (tuned / "tokenizer.json").read_text() == (base / "tokenizer.json").read_text()
    assert json.loads((tuned / "config.json").read_text())["hidden_size"] == 32
    record = json.loads((tuned / "training.json").read_text())
    assert record["base"]["init_from"] == str(base) and record["base"]["run"]["step"] == 4
    assert record["base"]["held_out_ppl_sample"] > 1 and record["base"]["chat_held_out_ppl"] > 1
    assert final["step"] == 6 and final["chat_held_out_ppl"] > 1
    log = [json.loads(line) for line in (tmp_path / "w2" / "loss_log.jsonl").read_text().splitlines()]
    assert all("chat_loss" in r for r in log if "loss" in r)


def test_init_from_a_folder_without_a_model_is_a_clear_error(tmp_path: Path) -> None:
    from freetoken_agent.evals.builtin.train import run

    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(SystemExit, match="not an exported model folder"):
        run(["--data-dir", str(data), "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o"),
             "--init-from", str(tmp_path)])
