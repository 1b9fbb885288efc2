"""Sessions on hybrid models (recurrent + attention layers): multi-turn reuse through per-turn state snapshots is
exact, divergence rolls back to a snapshot, and the radix tree (pages without states) is never used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.kv import KVConfig

pytest.importorskip("transformers")
from tests.runtime.arch_configs import save_checkpoint  # noqa: E402


@pytest.mark.parametrize("model_type", ["qwen3_next", "jamba", "inkling_text", "inkling2_loop_text", "zaya",
                                        "qwen4_exp_text"])  # conv states, loop visits, n-gram context
def test_hybrid_session_turns_equal_recompute(model_type: str, tmp_path: Path) -> None:
    save_checkpoint(model_type, tmp_path)
    engine = Engine.from_pretrained(tmp_path)
    manager = engine.kv_manager(KVConfig(page_size=4, device_pages=256, host_pages=64))
    session = engine.session()
    assert session.stateful
    g = torch.Generator().manual_seed(5)
    conv = torch.randint(0, 512, (18,), generator=g).tolist()
    prefilled = []
    for turn in range(4):
        before = manager.stats.prefilled_tokens
        reply = session.generate(conv, max_new_tokens=4, stop_token_ids=[])
        prefilled.append(manager.stats.prefilled_tokens - before)
        assert reply.token_ids == engine.generate(conv, max_new_tokens=4, stop_token_ids=[]).token_ids
        if turn == 1:  # the client edits history: roll back to the snapshot at the end of turn 0
            conv = conv[:-6] + torch.randint(0, 512, (5,), generator=g).tolist()
        else:
            conv = conv + reply.token_ids + torch.randint(0, 512, (5,), generator=g).tolist()
        if turn == 2:
            assert session.hint("tool", 3600.0) in ("keep", "offload", "drop")
            session.hint("plan")
    assert prefilled[1] == 6  # last reply token + 5 new: turn 1 continued from turn 0's cache and states
    assert manager.stats.divergences >= 1
    assert manager.radix.num_nodes == 0  # shared pages carry no recurrent state: never published
    other = engine.session()  # a second session recomputes its own states from scratch
    assert other.generate(conv[:12], max_new_tokens=3, stop_token_ids=[]).token_ids == \
        engine.generate(conv[:12], max_new_tokens=3, stop_token_ids=[]).token_ids
    session.close()
    other.close()
    assert manager.pool.num_used == 0
