"""KV pre-staging: prefixes warmed into the radix tree during a tool pause are reused by the next turn (fewer
tokens prefilled), the live conversation is never touched, outputs are token-identical to a cold recompute, and
warming never takes pages that sessions hold."""

from __future__ import annotations

import pytest
import torch
from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.kv import KVConfig

from tests.runtime.checkpoints import save_checkpoint

pytest.importorskip("transformers")
PS = 4  # page size: small, so page rounding is visible in the counts


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("qwen3_moe")
    save_checkpoint("qwen3_moe", folder)
    return Engine.from_pretrained(folder, threads=1)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tool_turn(engine: Engine, warm: bool) -> tuple[list[int], int, int, dict[str, object]]:
    """Turn 1, a tool pause, turn 2 — the way an agent drives a session. The next prompt re-renders the assistant
    turn differently from what was generated (as chat templates do with tool calls), then the tool-result framing,
    then the tool's output. Returns turn 2's tokens, the prompt tokens it reused and prefilled, the warm stats."""
    manager = engine.kv_manager(KVConfig(page_size=PS, device_pages=256))
    manager.prestage.enabled = warm
    session = engine.session()
    first = ids(30, 1)
    out = session.generate(first, max_new_tokens=6, temperature=0.0).token_ids
    framing = ids(9, 2)
    known = first + out[:3] + [7, 8, 9] + framing  # what the next prompt starts with, before the tool's output
    session.expect(known)
    log, pages = list(session.log), list(session.cache.pages)
    session.hint("tool", 1.0)
    manager.prestage.wait()
    assert session.log == log and session.cache.pages == pages  # the live conversation is untouched
    before = (manager.stats.prefix_hit_tokens, manager.stats.prefilled_tokens)
    second = session.generate(known + ids(20, 3) + ids(4, 4), max_new_tokens=8, temperature=0.0).token_ids
    reused, prefilled = (manager.stats.prefix_hit_tokens - before[0], manager.stats.prefilled_tokens - before[1])
    session.close()
    return second, reused, prefilled, manager.prestage.stats.snapshot()


def test_the_next_turn_reuses_the_warmed_framing_and_its_output_is_identical(engine: Engine) -> None:
    cold, cold_reused, cold_prefilled, off = tool_turn(engine, warm=False)
    hot, hot_reused, hot_prefilled, on = tool_turn(engine, warm=True)
    known = 30 + 3 + 3 + 9
    assert off["runs"] == 0 and on["runs"] == 1 and on["prefixes"] == 1
    assert cold_reused == 33  # without warming: only the common prefix with what the session generated
    assert hot_reused == known // PS * PS  # with it: every full page of the known prefix
    assert hot_prefilled == cold_prefilled - (hot_reused - cold_reused)
    assert on["prefilled_tokens"] > 0 and on["cached_tokens"] > 0  # the session's own pages were matched, not redone
    assert hot == cold
    first = ids(30, 1)
    out = Engine.generate(engine, first, max_new_tokens=6, temperature=0.0).token_ids
    prompt = first + out[:3] + [7, 8, 9] + ids(9, 2) + ids(20, 3) + ids(4, 4)
    assert engine.generate(prompt, max_new_tokens=8, temperature=0.0).token_ids == hot  # = a cold recompute


def test_a_framing_that_continues_the_log_is_fed_into_the_session_itself(engine: Engine) -> None:
    runs = []
    for warm in (False, True):
        manager = engine.kv_manager(KVConfig(page_size=PS, device_pages=256))
        manager.prestage.enabled = warm
        session = engine.session()
        first = ids(30, 1)
        out = session.generate(first, max_new_tokens=6, temperature=0.0).token_ids
        known = first + out + ids(6, 2)  # re-rendered as generated, then the framing: shorter than two pages
        session.expect(known)
        session.hint("tool", 1.0)
        manager.prestage.wait()
        hits = manager.stats.prefix_hit_tokens
        second = session.generate(known + ids(20, 3), max_new_tokens=8, temperature=0.0).token_ids
        runs.append((second, manager.stats.prefix_hit_tokens - hits, manager.stats.divergences))
        session.close()
    (cold, cold_reused, _), (hot, hot_reused, divergences) = runs
    assert cold_reused == 30 + 5 and hot_reused == len(known) == 42  # all of it, not only whole pages
    assert hot == cold and divergences == 0


def test_a_registered_prompt_is_warm_for_the_next_session(engine: Engine) -> None:
    manager = engine.kv_manager(KVConfig(page_size=PS, device_pages=256))
    system = ids(40, 5)
    manager.prestage.register("plan", system)
    main = engine.session()
    main.generate(ids(12, 6), max_new_tokens=2)
    main.hint("tool", 2.0)  # the pause warms the sub-agent's prompt
    manager.prestage.wait()
    assert manager.prestage.stats.prefilled_tokens == 40
    sub = engine.session()
    prompt = system + ids(7, 7)
    out = sub.generate(prompt, max_new_tokens=5, temperature=0.0).token_ids
    assert manager.stats.prefix_hit_tokens == 40  # the sub-agent's first turn prefilled only its own task
    assert out == engine.generate(prompt, max_new_tokens=5, temperature=0.0).token_ids
    main.hint("tool", 2.0)  # already cached: nothing recomputed
    manager.prestage.wait()
    assert manager.prestage.stats.prefilled_tokens == 40 and manager.prestage.stats.cached_tokens == 40


def test_warming_never_takes_pages_that_sessions_hold(engine: Engine) -> None:
    manager = engine.kv_manager(KVConfig(page_size=PS, device_pages=12))
    session = engine.session()
    prompt = ids(40, 8)
    session.generate(prompt, max_new_tokens=4)  # 43 positions: 11 of the 12 pages, pinned by the session
    held = list(session.cache.pages)
    session.expect(prompt + ids(30, 9))  # needs 8 more pages than are free
    assert session.hint("tool") == "keep"  # no expected duration: the session keeps its pages
    manager.prestage.wait()
    assert manager.prestage.stats.skipped == 1 and session.cache.pages == held
    assert manager.pool.num_free == manager.pool.num_pages - len(held)  # the partial warm gave its page back
    session.generate(prompt + ids(1, 10), max_new_tokens=1)  # the session carries on
