"""``freetoken bench resend`` on a tiny checkpoint: a re-sent cached prompt moves the tree's tail aside in one mode
and copies its prefix in the other, and both give the same tokens."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from freetoken_agent.evals.perf.agent_replay import format_resend, resend_row

pytest.importorskip("transformers")
from tests.runtime.arch_configs import save_checkpoint  # noqa: E402


def test_resend_row_moves_tails_in_one_mode_only(tmp_path: Path) -> None:
    save_checkpoint("qwen3_moe", tmp_path)
    args = argparse.Namespace(model=str(tmp_path), prompt_len=100, tokens=20, rounds=2, threads=None,
                              kv_dtype="auto")
    r = resend_row(args)
    move, relocate = r["runs"]["move"], r["runs"]["relocate"]
    assert len(move) == len(relocate) == 2
    assert all(x["moved_pages"] > 0 for x in move) and all(x["moved_pages"] == 0 for x in relocate)
    assert all(x["reused"] > 0 and x["decode_tok_s"] > 0 for x in move + relocate)
    text = format_resend(r)
    assert "| move |" in text and "| relocate |" in text
