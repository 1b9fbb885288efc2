"""MCP tools over stdio, against a real MCP server subprocess built with the official SDK."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from freetoken_agent.tools import ToolContext, ToolError, ToolRegistry, mcp_stdio_tools

pytest.importorskip("mcp.server.mcpserver")
pytestmark = pytest.mark.anyio

SERVER = '''
import sys
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

server = MCPServer("notes")
NOTES: list[str] = []


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def add(a: int, b: int = 2) -> int:
    """Add two integers."""
    return a + b


@server.tool(name="notes.append")
def append(text: str) -> str:
    """Append a note and return how many there are."""
    NOTES.append(text)
    return f"{len(NOTES)} notes"


@server.tool()
def fail(reason: str) -> str:
    """Always fails."""
    if reason == "crash":
        raise ValueError("internal details stay on the server")
    raise ToolError(reason)


print("server starting", file=sys.stderr)
server.run()
'''


async def test_mcp_server_tools_through_the_registry(tmp_path: Path, ctx: ToolContext) -> None:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    async with mcp_stdio_tools([sys.executable, str(script)], prefix="mcp_", timeout_s=30) as tools:
        registry = ToolRegistry(tools)
        assert registry.names == ["mcp_add", "mcp_notes_append", "mcp_fail"]
        add = registry.get("mcp_add")
        assert add.writes is False and add.kind == "read" and add.description == "Add two integers."
        assert add.parameters["required"] == ["a"] and add.parameters["properties"]["a"]["type"] == "integer"
        append = registry.get("mcp_notes_append")
        assert append.writes is True and append.kind == "other"

        assert (await registry.call("mcp_add", '{"a": 40}', ctx)).content == "42"
        assert (await registry.call("mcp_notes_append", {"text": "one"}, ctx)).content == "1 notes"
        second = await registry.call("mcp_notes_append", {"text": "two"}, ctx)
        assert second.content == "2 notes" and not second.is_error  # the server keeps state across calls

        invalid = await registry.call("mcp_add", {"a": "forty"}, ctx)  # caught locally by jsonschema
        assert invalid.is_error and "field 'a': 'forty' is not of type 'integer'" in invalid.content
        failed = await registry.call("mcp_fail", {"reason": "disk on fire"}, ctx)
        assert failed.is_error and "disk on fire" in failed.content
        crashed = await registry.call("mcp_fail", {"reason": "crash"}, ctx)
        assert crashed.is_error and crashed.content == "Error executing tool fail"


@pytest.mark.parametrize(
    "command, reason",
    [
        ([sys.executable, "-c", "import sys; sys.exit(3)"], "Connection closed"),
        (["/nonexistent/mcp-server"], "FileNotFoundError"),
    ],
)
async def test_mcp_server_that_cannot_start(command: list[str], reason: str) -> None:
    with pytest.raises(ToolError, match=f"MCP server .* did not start: .*{reason}"):
        async with mcp_stdio_tools(command, timeout_s=5):
            pass
