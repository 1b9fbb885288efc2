"""The editor configurations in ``examples/editors`` launch a valid ``freetoken acp``, and the demo script plays
through a real ACP client (plan, listing, a write behind a permission request)."""

from __future__ import annotations

import json
from pathlib import Path

import acp
import anyio
import pytest

from freetoken_agent.cli import build_parser
from tests.acp.support import REPO, RecordingClient, acp_agent, start_session

EDITORS = REPO / "examples" / "editors"


@pytest.mark.parametrize("name", ["zed-settings.json", "jetbrains-acp.json"])
def test_editor_configs_launch_freetoken_acp_with_valid_options(name: str) -> None:
    servers = json.loads((EDITORS / name).read_text())["agent_servers"]
    assert servers
    for server in servers.values():
        assert server["command"] == "freetoken" and server["args"][0] == "acp"
        assert all(isinstance(v, str) for v in server.get("env", {}).values())
        args = build_parser().parse_args(server["args"])  # every option exists and parses
        assert args.command == "acp"


def test_demo_script_plays_a_session(tmp_path: Path) -> None:
    (tmp_path / "hello.py").write_text("print('hi')\n")
    client = RecordingClient(answers=["allow-once"])

    async def drive() -> str:
        async with acp_agent("--scripted", str(EDITORS / "demo-script.json"), "--no-sessions",
                             client=client) as (conn, _, _client):
            sid = await start_session(conn, tmp_path)
            with anyio.fail_after(30):
                return (await conn.prompt(session_id=sid, prompt=[acp.text_block("Take notes.")])).stop_reason

    assert anyio.run(drive) == "end_turn"
    kinds = client.kinds()
    assert "plan" in kinds and len(client.permissions) == 1
    assert (tmp_path / "NOTES.md").read_text().startswith("# Notes")
    listing = [u for _, u in client.updates if u.session_update == "tool_call_update" and u.status == "completed"]
    assert any("hello.py" in u.content[-1].content.text for u in listing)
