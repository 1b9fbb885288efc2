"""The protocol stream stays clean (stray prints, native writes, child processes go to stderr), the CLI reports bad
options in one line, and the real engine path runs behind ACP on a tiny random-weight checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import acp
import anyio
import pytest

from tests.acp.support import SHUTDOWN_S, RecordingClient, child_env, freetoken_command, write_script
from tests.sdk.tiny_checkpoint import shared_tiny_qwen3_moe

STRAY = """
from freetoken_agent.acp.stdio import reserve_stdout
import os, sys
fd = reserve_stdout()
print("stray print")
sys.stdout.write("stray write\\n"); sys.stdout.flush()
os.write(1, b"native write\\n")
os.system("echo child process")
os.write(fd, b'{"jsonrpc":"2.0","method":"ok"}\\n')
"""


def test_reserved_stdout_carries_only_protocol_bytes() -> None:
    done = subprocess.run([sys.executable, "-c", STRAY], capture_output=True, env=child_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b'{"jsonrpc":"2.0","method":"ok"}\n'
    for text in (b"stray print", b"stray write", b"native write", b"child process"):
        assert text in done.stderr


@pytest.mark.parametrize("args, message", [
    (["--scripted", "/nonexistent/script.json"], "cannot read script"),
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--scripted", "BAD_JSON"], "not valid JSON"),
    (["--scripted", "NOT_A_LIST"], "expected a list of turns"),
    (["--max-steps", "0", "--scripted", "OK"], "argument --max-steps: must be an integer ≥ 1, got 0"),
    (["--scripted", "EMPTY_JSONL"], "holds no assistant messages"),
    (["--scripted", "BROKEN_JSONL"], "not a JSON line"),
])
def test_bad_options_fail_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "dict.json").write_text('{"turns": 5}')
    (tmp_path / "empty.jsonl").write_text('{"type": "run_started", "task": "x"}\n')
    (tmp_path / "broken.jsonl").write_text('{"type": "run_started"}\nnot json\n{"type": "x"}\n')
    write_script(tmp_path, ["hi"], name="ok.json")
    swap = {"BAD_JSON": "bad.json", "NOT_A_LIST": "dict.json", "OK": "ok.json", "EMPTY_JSONL": "empty.jsonl",
            "BROKEN_JSONL": "broken.jsonl"}
    args = [str(tmp_path / swap[a]) if a in swap else a for a in args]
    done = subprocess.run([*freetoken_command(), "acp", *args], capture_output=True, env=child_env(), timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and done.stdout == b""
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tiny_qwen3_moe(tmp_path_factory)


def test_engine_path_on_a_tiny_checkpoint(tiny: Path, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    tee = tmp_path / "stdout.jsonl"  # a copy of every byte the agent wrote to stdout
    command = " ".join([*freetoken_command(), "acp", "--model", str(tiny), "--threads", "1", "--max-steps", "2",
                        "--max-step-tokens", "6", "--mode", "read-only", "--no-sessions"])
    client = RecordingClient()

    async def drive() -> tuple[float, list]:
        async with acp.spawn_agent_process(client, "bash", "-c", f"{command} | tee {tee}", env=child_env(),
                                           transport_kwargs={"stderr": subprocess.DEVNULL,
                                                             "shutdown_timeout": SHUTDOWN_S}) as (conn, _):
            started = time.monotonic()
            await conn.initialize(protocol_version=1)
            handshake = time.monotonic() - started
            sid = (await conn.new_session(cwd=str(ws), mcp_servers=[])).session_id
            with anyio.fail_after(120):
                first = await conn.prompt(session_id=sid, prompt=[acp.text_block("Fix the failing test.")])
                second = await conn.prompt(session_id=sid, prompt=[acp.text_block("And the other one.")])
        return handshake, [first, second]

    handshake, (first, second) = anyio.run(drive)
    assert handshake < 5  # the model loads after initialize, not before it answers
    for result in (first, second):
        assert result.stop_reason in ("end_turn", "max_turn_requests")
        assert 0 < result.usage.output_tokens <= 12 and result.usage.cached_read_tokens is not None
    assert second.usage.input_tokens > first.usage.input_tokens  # the second turn carries the first
    # ... and its prompt starts with the first turn's, which the engine's prefix cache serves
    assert second.usage.cached_read_tokens > 0
    usage = [u for _, u in client.updates if u.session_update == "usage_update"]
    engine = usage[-1].field_meta["freetoken"]["engine"]
    assert engine["requests"] >= 2 and engine["generated_tokens"] > 0 and "prefix_hit_rate" in engine
    assert engine["phase_hints"]["plan"] >= 2 and usage[-1].size > 0
    for raw in tee.read_bytes().splitlines():  # torch, the engine and the tokenizer wrote nothing to stdout
        assert json.loads(raw)["jsonrpc"] == "2.0"


def test_a_model_that_cannot_load_fails_the_prompt_not_the_server(tmp_path: Path) -> None:
    empty = tmp_path / "empty-model"
    empty.mkdir()
    client = RecordingClient()

    async def drive() -> None:
        async with acp.spawn_agent_process(client, *freetoken_command(), "acp", "--model", str(empty),
                                           "--no-sessions", env=child_env(),
                                           transport_kwargs={"stderr": subprocess.DEVNULL,
                                                             "shutdown_timeout": SHUTDOWN_S}) as (conn, _):
            await conn.initialize(protocol_version=1)
            sid = (await conn.new_session(cwd=str(tmp_path), mcp_servers=[])).session_id
            for _ in range(2):
                with pytest.raises(acp.RequestError) as failed:
                    await conn.prompt(session_id=sid, prompt=[acp.text_block("hi")])
                assert "did not load" in str(failed.value.data or failed.value) or \
                    "did not load" in str(failed.value)
            assert (await conn.initialize(protocol_version=1)).protocol_version == 1

    anyio.run(drive)
