"""The agent-session row: recorded sessions through the SDK's Agent on a tiny budgeted model (phase on and off),
and against llama-server where its binary exists. The tiny model (2 layers of 64 experts) and its GGUF twin are
written once per test module."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from freetoken_agent.evals.perf import agent_session, harness, llama_server
from freetoken_agent.evals.perf.agent_session import Workload, load_workload

HOST = "62MB"
"""The tiny model's dense weights (18.4 MB) + a step's working memory (32.5 MB) + KV + about half of its 14.2 MB of
q4 experts."""


def _trajectory(folder: Path, name: str, turns: int) -> None:
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": [{"type": "text", "text": "Fix the bug. " + "y" * 500}]}]
    for k in range(turns):
        reply = f"THOUGHT: look at file {k} " + "and think " * 20 + f"\n\n```bash\ncat file{k}.py\n```"
        messages.append({"role": "assistant", "content": reply, "extra": {"response": {"created": 1000 + 10 * k}}})
        messages.append({"role": "user", "content": f"<returncode>0</returncode>\n<output>{'x' * 300}</output>"})
    (folder / f"{name}.traj.json").write_text(json.dumps({"messages": messages, "info": {}}))


def _tokenizer() -> Any:
    from freetoken_agent.runtime.builtin import builtin_model_dir
    from freetoken_agent.runtime.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(builtin_model_dir())


def test_recorded_turns_are_cut_to_the_limits(tmp_path: Path) -> None:
    _trajectory(tmp_path, "a", 5)
    tok = _tokenizer()
    w = Workload(sessions=1, turns=4, max_prompt=4096, max_reply=16, max_message_chars=100, pause_scale=0.01,
                 max_pause_s=0.05)
    source, [session] = load_workload(tmp_path, w, tok.encode, tok.decode)
    assert source == str(tmp_path) and session.name == "a" and len(session.turns) == 4
    assert session.task.startswith("Fix the bug.") and len(session.task) < 100 + 60  # cut, with its marker
    for k, turn in enumerate(session.turns):
        assert len(turn.reply_ids) == 16 and turn.reply == tok.decode(turn.reply_ids)  # the first 16 tokens
        assert turn.cuts[0] == 0 and turn.cuts[-1] == len(turn.reply) and turn.cuts == sorted(turn.cuts)
        assert turn.reply.startswith(f"THOUGHT: look at file {k}")
        assert turn.pause_s == 0.05  # 10 s recorded x 0.01, capped at 0.05
    assert [t.command for t in session.turns] == ["cat file0.py", "cat file1.py", "cat file2.py", None]  # last: none
    short = load_workload(tmp_path, Workload(turns=4, max_prompt=300, max_message_chars=100), tok.encode, tok.decode)
    assert short[1] == [] or len(short[1][0].turns) < 4  # the prompt limit ends the session early


def test_synthetic_session_when_there_are_no_trajectories() -> None:
    tok = _tokenizer()
    source, [session] = load_workload(None, Workload(turns=3, max_reply=400, max_prompt=4096), tok.encode, tok.decode)
    assert source == "synthetic" and len(session.turns) == 3
    assert all(t.command for t in session.turns[:-1]) and session.turns[-1].command is None
    assert all(0 < t.pause_s <= 5.0 for t in session.turns)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny model's folder; its expert cache files (ours, and the one its GGUF is written from) stay in this
    session's temp folder."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FREETOKEN_CACHE", str(tmp_path_factory.getbasetemp() / "ftcache"))
        yield tmp_path_factory.mktemp("agent-session")


def _run(model_dir: Path, *flags: str) -> dict[str, Any]:
    r = harness.load_rows()["agent-session"]
    args = harness.parse(r, ["--model", "tiny", "--dir", str(model_dir), "--trajectories", "synthetic", "--turns",
                             "3", "--max-reply", "40", "--max-prompt", "1536", "--max-message-chars", "600",
                             "--pause-scale", "0.03", "--host-memory", HOST, "--threads", "1", *flags], "test", False)
    return r.run(args)


def test_ours_phase_on_and_off_replay_the_session_under_the_budget(model_dir: Path) -> None:
    report = _run(model_dir, "--peer", "none")
    assert report["peer"] == {"skipped": "--peer none"} and report["exact"]
    [s] = report["sessions"]
    assert s["turns"] == 3 and len(s["reply_tokens"]) == 3 and len(s["pauses_s"]) == 2
    assert set(s["sides"]) == {"ours_phase", "ours_lru"}
    for name, side in s["sides"].items():
        assert side["generated"] == s["reply_tokens"]  # each turn generated exactly the recorded reply's length
        assert side["prompt_tokens"] == s["sides"]["ours_phase"]["prompt_tokens"]  # the same conversation
        assert side["prompt_tokens"] == sorted(side["prompt_tokens"])  # the history grows turn by turn
        assert all(g >= p for g, p in zip(side["gaps_s"], s["pauses_s"]))  # the tool pauses happened
        assert side["wall_s"] >= sum(s["pauses_s"]) and len(side["ttft_s"]) == 3 and side["decode_tok_s"] > 0
        assert side["disk_read_bytes"] > 0 and side["host_slots"] < side["experts"]  # experts came from disk
        assert side["host_peak_bytes"] <= report["host_memory_bytes"]
        assert side["phase_hints"]["plan"] == 3 and side["phase_hints"]["tool"] == 2 and side["refused"] is None
    on, off = s["sides"]["ours_phase"], s["sides"]["ours_lru"]
    assert on["phase_scheduler"] and on["policy"] != "lru" and on["phase_hints"].get("code", 0) >= 1
    assert not off["phase_scheduler"] and off["policy"] == "lru"
    assert report["lru_over_phase"] > 0 and "llama.cpp" not in report["totals"]
    text = agent_session.format_report(report)
    assert "| ours, phase on |" in text and "llama.cpp: skipped (--peer none)" in text


def test_llama_server_replays_the_same_turns(model_dir: Path) -> None:
    if llama_server.find_peer() is None:
        pytest.skip(f"llama.cpp peer: {llama_server.why_missing()}")
    report = _run(model_dir, "--phase", "on")
    [s] = report["sessions"]
    ours, peer = s["sides"]["ours_phase"], s["sides"]["llama.cpp"]
    assert peer["generated"] == s["reply_tokens"] and peer["prompt_token_mismatches"] == 0
    assert peer["prompt_tokens"] == ours["prompt_tokens"]  # the ids our engine prefilled, as llama-server counted them
    assert all(g >= p for g, p in zip(peer["gaps_s"], s["pauses_s"]))
    assert peer["io_read_bytes"] is not None and peer["memory_limit"]
    if peer["memory_limit_bytes"] is None:
        print(f"llama.cpp ran without a memory cap here: {peer['memory_limit']}", file=sys.stderr)
    else:  # --peer-cap ours: what our process used in the same session
        assert peer["memory_limit_bytes"] == ours["peak_memory_bytes"] >= peer["peak_memory_bytes"]
    assert report["exact"] and report["peer_over_ours"] > 0 and "ours_lru" not in s["sides"]
    assert "llama.cpp wall / side" in agent_session.format_report(report)


def test_bad_flags_are_one_line(model_dir: Path) -> None:
    with pytest.raises(SystemExit, match="--sessions, --turns"):
        agent_session.main(["--sessions", "0", "--peer", "none"])
    with pytest.raises(SystemExit, match="cannot read memory size"):
        agent_session.main(["--host-memory", "lots", "--peer", "none"])
