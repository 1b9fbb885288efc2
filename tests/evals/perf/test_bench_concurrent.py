"""The concurrent agent-session benchmark end to end: real ``freetoken serve`` subprocesses on the built-in model,
two sessions from a trajectory written here, N = 1 and 2. The llama.cpp peer runs only where its binary exists."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from freetoken_agent.evals.perf import bench_concurrent, llama_server
from freetoken_agent.evals.perf.concurrent_load import RequestResult, Workload, build_sessions, percentile, summarize


def _trajectory(folder: Path, name: str, turns: int, t0: int) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": [{"type": "text", "text": f"Fix the bug in {name}. " + "x" * 400}]}]
    for k in range(turns):
        messages.append({"role": "assistant", "content": f"THOUGHT: step {k}\n\n```bash\nls\n```",
                         "extra": {"response": {"created": t0 + 10 * k}}})
        messages.append({"role": "user", "content": f"<returncode>0</returncode>\n<output>file{k}.py</output>"})
    (folder / f"{name}.traj.json").write_text(json.dumps(
        {"messages": messages, "trajectory_format": "mini-swe-agent-1", "instance_id": name, "info": {}}))


def test_sessions_cut_messages_and_scale_pauses(tmp_path: Path) -> None:
    _trajectory(tmp_path, "a", 3, 1000)
    w = Workload(turns=3, ctx=4096, max_tokens=4, max_message_chars=100, pause_scale=0.01, max_pause_s=0.05)
    rendered: list[list[dict[str, str]]] = []

    def render(messages: list[dict[str, str]]) -> str:
        rendered.append(messages)
        return "".join(m["content"] for m in messages)

    [session] = build_sessions(tmp_path, 1, w, render, lambda text: list(range(len(text))))
    assert [t.pause_s for t in session.turns] == [0.0, 0.05, 0.05]  # 10 s recorded x 0.01, capped at 0.05
    assert all(len(m["content"]) <= 100 + 60 for ms in rendered for m in ms)  # the cut plus its marker
    assert [len(t.ids) for t in session.turns] == sorted(len(t.ids) for t in session.turns)  # prompts grow
    assert rendered[1][-2]["content"].startswith("THOUGHT: step 0")  # the recorded answer is teacher-forced


def test_too_few_turns_is_one_clear_error(tmp_path: Path) -> None:
    _trajectory(tmp_path, "a", 2, 0)
    try:
        build_sessions(tmp_path, 1, Workload(turns=5), lambda m: "x", lambda t: [1])
    except ValueError as exc:
        assert "lower --turns" in str(exc)
    else:
        raise AssertionError("expected a ValueError")


def test_summary_counts_tokens_and_latencies() -> None:
    a = RequestResult(0, 0, 10, start=0.0, end=1.0, ttft_s=0.5, gaps_s=[0.1, 0.3], chunks=3, completion_tokens=3,
                      prompt_tokens=10)
    b = RequestResult(1, 0, 7, ttft_s=0.7, gaps_s=[0.2], chunks=2, prompt_tokens=8)
    bad = RequestResult(1, 1, 7, error="HTTP 500")
    s = summarize([a, b, bad], wall_s=2.0)
    assert s["tokens"] == 5 and s["tok_s"] == 2.5 and s["errors"] == 1 and s["first_error"] == "HTTP 500"
    assert s["ttft_p50_s"] == percentile([0.5, 0.7], 50) and abs(s["itl_p50_s"] - 0.2) < 1e-9
    assert s["prompt_token_mismatches"] == 1


def test_harness_end_to_end_on_the_builtin_model(tmp_path: Path, capsys) -> None:
    traj = tmp_path / "traj"
    traj.mkdir()
    for i in range(2):
        _trajectory(traj, f"s{i}", 2, 100 * i)
    if llama_server.find_peer() is None:
        print(f"llama.cpp peer skipped: {llama_server.why_missing()}", file=sys.stderr)
    code = bench_concurrent.main(["run", "--model", "builtin", "--servers", "ours,llama.cpp", "--n", "1,2",
                                  "--turns", "2", "--max-tokens", "4", "--ctx", "4096", "--pause-scale", "0.001",
                                  "--trajectories", str(traj), "--dir", str(tmp_path / "out"), "--json",
                                  "--startup-timeout", "120", "--request-timeout", "60"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    rows = {(r["server"], r["n"]): r for r in report["rows"]}
    assert set(rows) == {("ours", 1), ("ours", 2)}  # no GGUF twin for the built-in model: ours only
    for (_, n), r in rows.items():
        assert r["errors"] == 0 and r["requests"] == 2 * n
        assert 0 < r["tokens"] <= 4 * r["requests"] and r["tok_s"] > 0
        assert r["ttft_p50_s"] is not None and r["ttft_p99_s"] >= r["ttft_p50_s"]
        assert r["prompt_token_mismatches"] == 0  # the server tokenized the text into the ids we counted
        # the engine's own split, from /stats before and after: every prompt token it computed was prefilled in a
        # prefill step; decode-only steps made at most the tokens the clients received (first tokens come from
        # prefill steps)
        e = r["engine"]
        assert e["prompt_tokens"] > 0 and e["prefill_s"] > 0 and 0 < e["prefill_share"] <= 1
        assert e["decode_s"] == 0 or e["rows"] >= 1  # one-token rows per decode-only step (a prompt's last token
        # after a prefix hit, or a background KV warm's, also makes a one-token row: not bounded by n)
        assert e["idle_s"] >= 0 and e["prefill_s"] + e["decode_s"] <= r["wall_s"] + 0.5
    assert rows[("ours", 1)]["vs_n1"] == 1.0
    assert report["meta"]["sessions"] == ["s0", "s1"]
    assert (tmp_path / "out" / "logs" / "ours-n2.log").is_file()
