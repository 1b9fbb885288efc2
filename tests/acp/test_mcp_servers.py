"""MCP servers named in ``session/new`` are started for the session and their tools reach the model."""

from __future__ import annotations

import sys
from pathlib import Path

import acp
import anyio
import pytest
from acp.schema import McpServerStdio

from tests.acp.support import RecordingClient, acp_agent, tool_call, write_script

pytest.importorskip("mcp.server.mcpserver")

SERVER = '''
from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

server = MCPServer("notes")
NOTES = []


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def remember(text: str) -> str:
    """Store a note."""
    NOTES.append(text)
    return f"stored {len(NOTES)} note(s): {text}"


server.run()
'''


def test_session_mcp_server_tools_run_with_permission_for_writing_ones(tmp_path: Path) -> None:
    server = tmp_path / "notes_server.py"
    server.write_text(SERVER)
    script = write_script(tmp_path, [tool_call("notes_add", {"a": 40, "b": 2}),
                                     tool_call("notes_remember", {"text": "buy milk"}), "Noted."])
    client = RecordingClient(answers=["allow-once"])

    async def drive() -> None:
        async with acp_agent("--scripted", str(script), "--no-sessions", client=client) as (conn, _, _client):
            await conn.initialize(protocol_version=1)
            with anyio.fail_after(60):
                sid = (await conn.new_session(cwd=str(tmp_path), mcp_servers=[
                    McpServerStdio(name="notes", command=sys.executable, args=[str(server)], env=[])])).session_id
                result = await conn.prompt(session_id=sid, prompt=[acp.text_block("Add and remember.")])
            assert result.stop_reason == "end_turn"
            with pytest.raises(acp.RequestError) as broken:
                await conn.new_session(cwd=str(tmp_path), mcp_servers=[
                    McpServerStdio(name="broken", command="/nonexistent/server", args=[], env=[])])
            assert "broken" in str(broken.value) or "broken" in str(broken.value.data)

    anyio.run(drive)
    calls = [u for _, u in client.updates if u.session_update == "tool_call"]
    assert [c.title for c in calls] == ["notes_add", "notes_remember"]
    outputs = [client.tool_updates(c.tool_call_id)[-1] for c in calls]
    assert [o.status for o in outputs] == ["completed", "completed"]
    assert outputs[0].content[-1].content.text == "42"
    assert "stored 1 note(s): buy milk" in outputs[1].content[-1].content.text
    [(_, asked, _)] = client.permissions  # only the tool without a read-only hint asked
    assert asked.title == "notes_remember"
