"""``freetoken acp`` driven by the real ACP client library over a real subprocess, with a scripted model."""

from __future__ import annotations

import json
from pathlib import Path

import acp
import anyio
import pytest
from acp.schema import ClientCapabilities, FileSystemCapabilities

from tests.acp.support import RecordingClient, acp_agent, start_session, tool_call, write_script

CALC = "def add(a, b):\n    return a - b\n"
FIX = {"path": "calc.py", "old_string": "a - b", "new_string": "a + b"}
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    (root / "calc.py").write_text(CALC)
    return root


def _runs(folder: Path) -> list[list[dict]]:
    """Each trajectory file's records, oldest first."""
    files = sorted(folder.glob("*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


def _messages(records: list[dict]) -> list[dict]:
    return [r["message"] for r in records if r["type"] == "message"]


async def test_handshake_declares_capabilities_and_opens_a_session(tmp_path: Path, ws: Path) -> None:
    script = write_script(tmp_path, [])
    async with acp_agent("--scripted", str(script), "--sessions", str(tmp_path / "s")) as (conn, _, _client):
        init = await conn.initialize(protocol_version=acp.PROTOCOL_VERSION)
        assert init.protocol_version == 1
        caps = init.agent_capabilities
        assert caps.load_session is True and caps.prompt_capabilities.embedded_context is True
        assert caps.session_capabilities.list is not None and caps.session_capabilities.resume is not None
        assert caps.prompt_capabilities.image is False and caps.mcp_capabilities.http is False
        assert init.agent_info.name == "freetoken-agent" and init.auth_methods == []
        await conn.authenticate(method_id="none")
        first = await conn.new_session(cwd=str(ws), mcp_servers=[])
        second = await conn.new_session(cwd=str(ws), mcp_servers=[])
        assert first.session_id != second.session_id
        assert first.modes.current_mode_id == "ask"
        assert {m.id for m in first.modes.available_modes} == {"ask", "auto", "read-only"}
        with pytest.raises(acp.RequestError) as bad:
            await conn.new_session(cwd="relative/dir", mcp_servers=[])
        assert "absolute" in str(bad.value.data or bad.value)
        with pytest.raises(acp.RequestError):
            await conn.prompt(session_id="sess_nope", prompt=[acp.text_block("hi")])


async def test_granted_edit_streams_updates_in_order_and_changes_the_file(tmp_path: Path, ws: Path) -> None:
    script = write_script(tmp_path, [tool_call("edit_file", FIX, "I will fix the sign."), "Fixed the sign."])
    client = RecordingClient(answers=["allow-once"])
    async with acp_agent("--scripted", str(script), "--no-sessions", client=client) as (conn, _, _client):
        sid = await start_session(conn, ws)
        result = await conn.prompt(session_id=sid, prompt=[acp.text_block("Fix add.")])
    assert result.stop_reason == "end_turn"
    assert (ws / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    # the permission request showed the proposed diff and the three choices
    [(psid, call, options)] = client.permissions
    assert psid == sid and call.title == "Edit calc.py" and call.kind == "edit"
    assert call.content[0].type == "diff" and call.content[0].new_text.endswith("a + b\n")
    assert [o.kind for o in options] == ["allow_once", "allow_always", "reject_once"]
    # updates, in order: text, the call (pending → described → running → completed with a diff), usage, answer
    kinds = client.kinds()
    assert kinds[0] == "agent_message_chunk" and kinds[-1] == "usage_update"
    assert client.text().startswith("I will fix the sign.") and client.text().endswith("Fixed the sign.")
    call_id = next(u.tool_call_id for _, u in client.updates if u.session_update == "tool_call")
    stages = client.tool_updates(call_id)
    assert [u.status for u in stages] == ["pending", None, "in_progress", "completed"]
    assert stages[1].raw_input == FIX and stages[1].locations[0].path == str(ws.resolve() / "calc.py")
    diff = stages[-1].content[0]
    assert diff.type == "diff" and diff.old_text == CALC and diff.new_text.endswith("a + b\n")
    first_answer_chunk = max(i for i, k in enumerate(kinds) if k == "tool_call_update") + 1
    assert "usage_update" in kinds[first_answer_chunk - 3:] or kinds.index("usage_update") < first_answer_chunk
    assert result.usage.output_tokens > 0 and result.usage.input_tokens > 0


async def test_rejected_edit_is_not_run_and_the_model_is_told(tmp_path: Path, ws: Path) -> None:
    script = write_script(tmp_path, [tool_call("edit_file", FIX), "Understood, I left it alone."])
    client = RecordingClient(answers=["reject-once"])
    traj = tmp_path / "traj"
    async with acp_agent("--scripted", str(script), "--no-sessions", "--trajectory", str(traj),
                         client=client) as (conn, _, _client):
        sid = await start_session(conn, ws)
        result = await conn.prompt(session_id=sid, prompt=[acp.text_block("Fix add.")])
    assert result.stop_reason == "end_turn"
    assert (ws / "calc.py").read_text() == CALC
    assert len(client.permissions) == 1
    final = [u for _, u in client.updates if u.session_update == "tool_call_update"][-1]
    assert final.status == "failed" and "rejected" in final.content[-1].content.text
    tool_messages = [m for m in _messages(_runs(traj)[0]) if m["role"] == "tool"]
    assert len(tool_messages) == 1 and "rejected" in tool_messages[0]["content"]


async def test_plan_shell_output_and_allow_always(tmp_path: Path, ws: Path) -> None:
    plan = {"steps": [{"content": "Inspect", "status": "completed"}, {"content": "Run checks",
                                                                       "status": "in_progress", "priority": "high"}]}
    script = write_script(tmp_path, [
        tool_call("update_plan", plan),
        tool_call("run_shell", {"command": "echo first-run"}),
        tool_call("run_shell", {"command": "echo second-run; exit 3"}),
        "Both commands ran.",
    ])
    client = RecordingClient(answers=["allow-always"])
    async with acp_agent("--scripted", str(script), "--no-sessions", client=client) as (conn, _, _client):
        sid = await start_session(conn, ws)
        result = await conn.prompt(session_id=sid, prompt=[acp.text_block("Check things.")])
    assert result.stop_reason == "end_turn"
    assert len(client.permissions) == 1  # "always" covers the second run_shell
    [plan_update] = [u for _, u in client.updates if u.session_update == "plan"]
    assert [(e.content, e.status, e.priority) for e in plan_update.entries] == [
        ("Inspect", "completed", "medium"), ("Run checks", "in_progress", "high")]
    calls = [u for _, u in client.updates if u.session_update == "tool_call"]
    assert [c.kind for c in calls] == ["think", "execute", "execute"]
    done = [client.tool_updates(c.tool_call_id)[-1] for c in calls[1:]]
    assert [d.status for d in done] == ["completed", "completed"]
    outputs = [d.content[-1].content.text for d in done]
    assert "first-run" in outputs[0] and "exit code: 0" in outputs[0]
    assert "second-run" in outputs[1] and "exit code: 3" in outputs[1]
    assert done[1].raw_output["data"]["exit_code"] == 3
    assert client.tool_updates(calls[1].tool_call_id)[1].title == "Run `echo first-run`"


async def test_cancel_mid_generation_then_a_second_prompt_continues_the_session(tmp_path: Path, ws: Path) -> None:
    long_text = " ".join(f"word{i}" for i in range(400))
    script = write_script(tmp_path, [long_text, "Second answer."], delay_s=0.02)
    traj = tmp_path / "traj"
    client = RecordingClient()
    async with acp_agent("--scripted", str(script), "--no-sessions", "--trajectory", str(traj),
                         client=client) as (conn, _, _client):
        sid = await start_session(conn, ws)
        cancelled = anyio.Event()

        async def cancel_after_a_few_chunks(update: object) -> None:
            if client.kinds().count("agent_message_chunk") == 5 and not cancelled.is_set():
                cancelled.set()
                await conn.cancel(session_id=sid)

        client.on_update = cancel_after_a_few_chunks
        with anyio.fail_after(10):  # 400 words at 20 ms would take 8 s uncancelled
            started = anyio.current_time()
            first = await conn.prompt(session_id=sid, prompt=[acp.text_block("Write a lot.")])
            elapsed = anyio.current_time() - started
        assert first.stop_reason == "cancelled" and elapsed < 4
        chunks = client.kinds().count("agent_message_chunk")
        assert 5 <= chunks < 100
        client.on_update = None
        client.updates.clear()
        second = await conn.prompt(session_id=sid, prompt=[
            acp.text_block("And now?"),
            acp.resource_link_block(name="calc.py", uri=(ws / "calc.py").resolve().as_uri()),
            acp.resource_block(acp.embedded_text_resource(uri="file:///notes.txt", text="NOTE-42")),
        ])
    assert second.stop_reason == "end_turn" and client.text() == "Second answer."
    runs = _runs(traj)
    assert len(runs) == 2
    assert runs[0][-1]["type"] == "run_finished" and runs[0][-1]["stop_reason"] == "cancelled"
    turn1, turn2 = _messages(runs[0]), _messages(runs[1])
    # the second turn's conversation starts with the first turn's (same system prompt and task, in order)
    assert [m["role"] for m in turn2[:3]] == ["system", "user", "assistant"]
    assert turn2[0] == turn1[0] and turn2[1]["content"] == "Write a lot."
    assert turn2[2]["content"].startswith("word0 word1 word2") and "cancelled" in turn2[2]["content"]
    task = turn2[-2]["content"] if turn2[-1]["role"] == "assistant" else turn2[-1]["content"]
    assert "And now?" in task and "workspace file: calc.py" in task and "NOTE-42" in task
    assert second.usage.input_tokens > 0


async def test_a_saved_session_loads_in_a_new_process_and_replays(tmp_path: Path, ws: Path) -> None:
    sessions = tmp_path / "sessions"
    script = write_script(tmp_path, ["First reply.", "Reply after reload."])
    async with acp_agent("--scripted", str(script), "--sessions", str(sessions)) as (conn, _, _client):
        sid = await start_session(conn, ws)
        assert (await conn.prompt(session_id=sid, prompt=[acp.text_block("Hello there")])).stop_reason == "end_turn"
    script2 = write_script(tmp_path, ["Reply after reload."], name="script2.json")
    client = RecordingClient()
    async with acp_agent("--scripted", str(script2), "--sessions", str(sessions),
                         "--trajectory", str(tmp_path / "t2"), client=client) as (conn, _, _client):
        await conn.initialize(protocol_version=1)
        with pytest.raises(acp.RequestError):
            await conn.load_session(cwd=str(ws), session_id="sess_missing", mcp_servers=[])
        listed = await conn.list_sessions(cwd=str(ws))
        assert [(i.session_id, i.title) for i in listed.sessions] == [(sid, "Hello there")]
        assert (await conn.list_sessions(cwd=str(tmp_path))).sessions == []
        await conn.load_session(cwd=str(ws), session_id=sid, mcp_servers=[])
        assert client.text("user_message_chunk") == "Hello there" and client.text() == "First reply."
        result = await conn.prompt(session_id=sid, prompt=[acp.text_block("Again")])
    assert result.stop_reason == "end_turn"
    roles = [(m["role"], m["content"]) for m in _messages(_runs(tmp_path / "t2")[0])][1:]
    assert roles == [("user", "Hello there"), ("assistant", "First reply."), ("user", "Again"),
                     ("assistant", "Reply after reload.")]


async def test_modes_read_only_refuses_without_asking(tmp_path: Path, ws: Path) -> None:
    script = write_script(tmp_path, [tool_call("write_file", {"path": "new.txt", "content": "x"}), "OK."])
    client = RecordingClient(answers=["allow-once"])
    async with acp_agent("--scripted", str(script), "--no-sessions", client=client) as (conn, _, _client):
        sid = await start_session(conn, ws)
        await conn.set_session_mode(session_id=sid, mode_id="read-only")
        with pytest.raises(acp.RequestError):
            await conn.set_session_mode(session_id=sid, mode_id="yolo")
        result = await conn.prompt(session_id=sid, prompt=[acp.text_block("Write a file.")])
    assert result.stop_reason == "end_turn" and not client.permissions and not (ws / "new.txt").exists()
    assert client.kinds()[0] == "current_mode_update"


async def test_reads_go_through_the_editor_buffer_when_the_client_offers_it(tmp_path: Path, ws: Path) -> None:
    (ws / "notes.txt").write_text("on disk\n")
    script = write_script(tmp_path, [tool_call("read_file", {"path": "calc.py", "start_line": 2}),
                                     tool_call("read_file", {"path": "notes.txt"}), "Read both."])
    calc = str(ws.resolve() / "calc.py")
    client = RecordingClient(buffers={calc: "def add(a, b):\n    return a + b  # unsaved edit\n"})
    async with acp_agent("--scripted", str(script), "--no-sessions", client=client) as (conn, _, _client):
        await conn.initialize(protocol_version=1, client_capabilities=ClientCapabilities(
            fs=FileSystemCapabilities(read_text_file=True)))
        sid = (await conn.new_session(cwd=str(ws), mcp_servers=[])).session_id
        result = await conn.prompt(session_id=sid, prompt=[acp.text_block("Read.")])
    assert result.stop_reason == "end_turn" and not client.permissions
    assert client.reads[0] == (calc, 2, 2000)
    done = [u for _, u in client.updates if u.session_update == "tool_call_update" and u.status == "completed"]
    assert done[0].content[-1].content.text.startswith("     2\t    return a + b  # unsaved edit")
    assert "editor's buffer" in done[0].content[-1].content.text
    assert "on disk" in done[1].content[-1].content.text  # the editor has no buffer for it: read from disk


async def test_cancel_while_a_permission_request_is_open(tmp_path: Path, ws: Path) -> None:
    script = write_script(tmp_path, [tool_call("edit_file", FIX), "Next turn."])
    client = RecordingClient(answers=["cancelled"])
    async with acp_agent("--scripted", str(script), "--no-sessions", client=client) as (conn, _, _client):
        sid = await start_session(conn, ws)

        async def user_presses_stop() -> None:  # an editor cancels the turn, then answers the open request
            await conn.cancel(session_id=sid)

        client.on_permission = user_presses_stop
        with anyio.fail_after(10):
            first = await conn.prompt(session_id=sid, prompt=[acp.text_block("Fix add.")])
        assert first.stop_reason == "cancelled"
        assert (ws / "calc.py").read_text() == CALC
        call_id = next(u.tool_call_id for _, u in client.updates if u.session_update == "tool_call")
        assert client.tool_updates(call_id)[-1].status == "failed"
        client.on_permission = None
        client.updates.clear()
        second = await conn.prompt(session_id=sid, prompt=[acp.text_block("Go on.")])
    # the cancelled call got a result in the history, so the conversation stays valid for the next turn
    assert second.stop_reason == "end_turn" and client.text() == "Next turn."


async def test_thinking_channels_stream_as_thought_chunks(tmp_path: Path, ws: Path) -> None:
    turn = ("<|channel|>analysis<|message|>The sign is wrong.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Change - to +.<|return|>")
    script = tmp_path / "harmony.json"
    script.write_text(json.dumps({"turns": [turn], "tool_format": "harmony"}))
    client = RecordingClient()
    async with acp_agent("--scripted", str(script), "--no-sessions", client=client) as (conn, _, _client):
        sid = await start_session(conn, ws)
        result = await conn.prompt(session_id=sid, prompt=[acp.text_block("Why does it fail?")])
    assert result.stop_reason == "end_turn"
    assert client.text("agent_thought_chunk") == "The sign is wrong."
    assert client.text() == "Change - to +."
    kinds = [k for k in client.kinds() if k != "usage_update"]
    assert kinds.index("agent_message_chunk") > max(i for i, k in enumerate(kinds) if k == "agent_thought_chunk")


async def test_a_recorded_turn_replays_from_its_trajectory(tmp_path: Path, ws: Path) -> None:
    script = write_script(tmp_path, [tool_call("edit_file", FIX, "Fixing it."), "Fixed."])
    traj = tmp_path / "traj"
    async with acp_agent("--scripted", str(script), "--no-sessions", "--mode", "auto",
                         "--trajectory", str(traj)) as (conn, _, _client):
        sid = await start_session(conn, ws)
        await conn.prompt(session_id=sid, prompt=[acp.text_block("Fix add.")])
    [recorded] = sorted(traj.glob("*.jsonl"))
    (ws / "calc.py").write_text(CALC)  # back to the starting point, then replay the run in a fresh agent
    client = RecordingClient()
    async with acp_agent("--scripted", str(recorded), "--no-sessions", "--mode", "auto",
                         client=client) as (conn, _, _client):
        sid = await start_session(conn, ws)
        result = await conn.prompt(session_id=sid, prompt=[acp.text_block("Fix add.")])
    assert result.stop_reason == "end_turn" and client.text() == "Fixing it.Fixed."
    assert (ws / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
