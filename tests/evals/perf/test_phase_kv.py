"""``phase_live --kv``: TTFT per turn with KV pre-staging on vs off, on a held-out session replayed through
``LocalEngine`` (the built-in model)."""

from __future__ import annotations

import json

import pytest
import torch
from freetoken_agent.evals.builtin.data import DEFAULT_DATA_DIR
from freetoken_agent.evals.perf import phase_live


def test_kv_prestaging_moves_framing_prefill_into_the_pauses(capsys: pytest.CaptureFixture[str]) -> None:
    if not DEFAULT_DATA_DIR.is_dir():
        pytest.skip(f"no trajectories at {DEFAULT_DATA_DIR}")
    torch.set_num_threads(1)
    assert phase_live.main(["--kv", "--max-sessions", "1", "--kv-turns", "4", "--kv-rounds", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    off, on = out["rows"]
    assert (off["kv_prestage"], on["kv_prestage"]) == ("off", "on") and off["turns"] == on["turns"] == 3
    assert off["warmed_tokens"] == 0 and on["warmed_tokens"] > 0 and on["warm_over_pause"] == 0
    saved = off["turn_prefill_tokens"] - on["turn_prefill_tokens"]
    assert saved == out["turn_prefill_saved"] > 0 and saved <= on["warmed_tokens"]
    assert on["turn_reused_tokens"] - off["turn_reused_tokens"] == saved
    assert on["ttft_median_ms"] > 0 and out["ttft_median_ratio_on_vs_off"] > 0


def test_kv_flags_are_checked() -> None:
    with pytest.raises(SystemExit, match="--kv-turns must be at least 2"):
        phase_live.main(["--kv", "--kv-turns", "1"])
