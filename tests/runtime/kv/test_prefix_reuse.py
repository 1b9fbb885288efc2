"""Prefix reuse is exact: random multi-turn sessions (divergences, evictions, pauses) give the same logits and
greedy tokens as recomputing from scratch, and every page comes back when sessions close."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.kv import KVConfig, OutOfPages
from tests.runtime.checkpoints import save_checkpoint

pytest.importorskip("transformers")
VOCAB = 512


@pytest.fixture(scope="module", params=["deepseek_v3", "gpt_oss"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    folder = tmp_path_factory.mktemp(request.param)
    save_checkpoint(request.param, folder)  # MLA latent cache / sliding window + sinks
    return Engine.from_pretrained(folder)


tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
step = st.one_of(
    st.tuples(st.just("append"), tokens),
    st.tuples(st.just("diverge"), st.tuples(st.floats(0, 1), tokens)),
    st.tuples(st.just("evict"), st.integers(1, 8)),
    st.tuples(st.just("new_session"), st.none()),
    st.tuples(st.just("pause"), st.sampled_from(["drop", "offload", "keep"])),
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=20), steps=st.lists(step, min_size=1,
                                                                                          max_size=5))
def test_reuse_equals_recompute(engine: Engine, first: list[int], steps: list) -> None:
    manager = engine.kv_manager(KVConfig(page_size=4, device_pages=48, host_pages=48))
    session = engine.session()
    conv = list(first)
    sessions = [session]
    for action, arg in [("append", []), *steps]:
        if action == "append":
            conv = conv + arg
        elif action == "diverge":
            frac, new = arg
            conv = conv[: max(1, int(len(conv) * frac))] + new
        elif action == "evict":
            manager.radix.evict(arg)
            continue
        elif action == "new_session":
            session = engine.session()
            sessions.append(session)
        elif action == "pause":
            {"drop": session.drop, "offload": session._offload if manager.host else session.drop,
             "keep": lambda: None}[arg]()
            continue
        try:
            reused, logits = session.prefill_logits(conv)
        except OutOfPages:
            continue  # a legal outcome under a tiny pool; accounting is still checked below
        full = engine.logits(conv)
        assert (logits - full[reused:]).abs().max().item() <= 1e-4
        reply = session.generate(conv, max_new_tokens=3, stop_token_ids=[])
        assert reply.token_ids == engine.generate(conv, max_new_tokens=3, stop_token_ids=[]).token_ids
        conv = conv + reply.token_ids
    for s in sessions:
        s.close()
    manager.radix.clear()
    assert manager.pool.num_used == 0 and manager.host is not None and manager.host.num_used == 0
    assert all(r == 0 for r in manager.pool.refs)


def test_turns_prefill_only_new_tokens_and_share_across_sessions(engine: Engine) -> None:
    manager = engine.kv_manager(KVConfig(page_size=8, device_pages=256))
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    a = engine.session()
    conv = system + torch.randint(0, VOCAB, (5,), generator=g).tolist()
    reply = a.generate(conv, max_new_tokens=4, stop_token_ids=[])
    before = manager.stats.prefilled_tokens
    conv2 = conv + reply.token_ids + [7, 8, 9]
    a.generate(conv2, max_new_tokens=4, stop_token_ids=[])
    # turn 2 prefills the last reply token (never fed) and the 3 new ones
    assert manager.stats.prefilled_tokens - before == 4
    b = engine.session()  # a sub-agent with the same system prompt reuses its full pages
    b.generate(system + [1, 2], max_new_tokens=2, stop_token_ids=[])
    assert manager.stats.prefix_hit_tokens >= len(conv) - 1 + 40 // 8 * 8
    snap = engine.stats()["kv"]
    assert snap["turns"] == 3 and snap["prefix_hit_rate"] > 0.5 and len(snap["ttft_s"]) == 3
    for s in (a, b):
        s.close()
    manager.radix.clear()
    assert manager.pool.num_used == 0


def test_pause_policy_keeps_offloads_and_drops(engine: Engine) -> None:
    manager = engine.kv_manager(KVConfig(page_size=4, device_pages=20, host_pages=20))
    s = engine.session()
    conv = list(range(1, 50))
    s.generate(conv, max_new_tokens=1, stop_token_ids=[])
    assert manager.pressure() >= 0.5
    assert s.pause(None) == "keep"  # unknown duration: keep
    decision = s.hint("tool", 3600.0)  # long pause under pressure: reloading beats recomputing on this machine
    assert decision == "offload" and manager.stats.offloads == 1 and manager.host.num_used > 0  # type: ignore
    s.hint("plan")  # the tool finished: KV comes back before the next turn
    assert manager.stats.restores == 1 and manager.host.num_used == 0  # type: ignore[union-attr]
    out = s.generate(conv + [5], max_new_tokens=2, stop_token_ids=[])
    assert manager.stats.restores == 1
    assert out.token_ids == engine.generate(conv + [5], max_new_tokens=2, stop_token_ids=[]).token_ids
    s.close()
    manager.radix.clear()
    assert manager.pool.num_used == 0 and manager.host.num_used == 0  # type: ignore[union-attr]


def test_prefill_during_tool_pause_leaves_only_the_tail(engine: Engine) -> None:
    manager = engine.kv_manager(KVConfig(page_size=4, device_pages=128))
    s = engine.session()
    conv = list(range(3, 40))
    reply = s.generate(conv, max_new_tokens=3, stop_token_ids=[])
    conv = conv + reply.token_ids
    streamed = [11, 12, 13, 14, 15, 16]
    assert s.prefill(conv + streamed[:4]) == 1 + 4  # the unfed last reply token + 4 streamed tool-output tokens
    assert s.prefill(conv + streamed[:4]) == 0  # idempotent
    before = manager.stats.prefilled_tokens
    final = conv + [11, 12, 99] + streamed[3:] + [7]  # the final prompt re-tokenized a boundary differently
    out = s.generate(final, max_new_tokens=3, stop_token_ids=[])
    assert manager.stats.prefilled_tokens - before == len(final) - len(conv) - 2
    assert out.token_ids == engine.generate(final, max_new_tokens=3, stop_token_ids=[]).token_ids
    assert manager.stats.background_prefill_tokens == 5
    s.close()
    manager.radix.clear()
    assert manager.pool.num_used == 0


def test_a_re_sent_prompt_grows_in_place_and_its_path_stays_one_run(engine: Engine,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A session-less client sends the same prompt again (its next turn re-sends the conversation; a retry): the
    request adopts the prompt's full pages and recomputes the page after them, whose cached copy the tree holds
    right after the adopted run. That copy and the reply's pages after it move aside one page at a time, so the
    request grows in place instead of copying every adopted page into a free run; its tokens equal the first
    request's, and once it finishes the cached path is one run of pages again."""
    manager = engine.kv_manager(KVConfig(page_size=4, device_pages=256))
    manager.radix.clear()
    copied: list[int] = []
    copy_to_run = manager.pool.copy_to_run

    def counting(pages: list[int], first: int) -> None:
        copied.append(len(pages))
        copy_to_run(pages, first)

    monkeypatch.setattr(manager.pool, "copy_to_run", counting)
    prompt = [(7 * i + 3) % VOCAB for i in range(30)]
    first = engine.generate(prompt, max_new_tokens=9, stop_token_ids=[])
    moved, evicted = manager.radix.moved_pages, manager.radix.evicted_pages
    for _ in range(3):
        again = engine.generate(prompt, max_new_tokens=9, stop_token_ids=[])
        assert again.token_ids == first.token_ids
        path = manager.radix.match_prefix(prompt + again.token_ids).pages
        assert len(path) == 9 and path == list(range(path[0], path[0] + 9))  # one run again
    assert manager.radix.moved_pages >= moved + 3 and manager.radix.evicted_pages == evicted
    assert copied == []  # never a relocation of the 7 adopted pages
    manager.radix.clear()
    assert manager.pool.num_used == 0
