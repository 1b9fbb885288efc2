"""MCP servers named in ``session/new``: started for the session, their tools added to its registry.

``mcp_stdio_tools`` is an async context manager, and an anyio context must be left in the task that entered it,
so each server lives in a holder task of the server's task group until the session closes or the client leaves.
"""

from __future__ import annotations

import sys
from typing import Any

import anyio
import anyio.abc

from freetoken_agent.acp.jsonrpc import INTERNAL_ERROR, RpcError
from freetoken_agent.acp.schema import McpServer


class McpHolder:
    """Keeps one session's MCP servers running; :meth:`stop` ends them."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self._stop = anyio.Event()

    async def start(self, group: anyio.abc.TaskGroup, servers: list[McpServer], cwd: str) -> list[Any]:
        """Start every stdio server and return their tools (named ``<server>_<tool>``)."""
        tools: list[Any] = []
        for server in servers:
            if server.command is None:  # http/sse: not advertised in mcpCapabilities
                print(f"freetoken acp: skipping MCP server {server.name!r}: only stdio servers are supported",
                      file=sys.stderr)
                continue
            tools += await self._start_one(group, server, cwd)
        return tools

    async def _start_one(self, group: anyio.abc.TaskGroup, server: McpServer, cwd: str) -> list[Any]:
        from freetoken_agent.tools import ToolError, mcp_stdio_tools

        ready = anyio.Event()
        outcome: dict[str, Any] = {}
        prefix = "".join(c if c.isalnum() or c in "_-" else "_" for c in server.name) + "_"
        env = {item.name: item.value for item in server.env} or None

        async def hold() -> None:
            try:
                async with mcp_stdio_tools([server.command or "", *server.args], env=env, cwd=cwd,
                                           prefix=prefix) as found:
                    outcome["tools"] = found
                    ready.set()
                    await self._stop.wait()
            except ToolError as exc:
                outcome["error"] = str(exc)
            finally:
                ready.set()

        group.start_soon(hold)
        await ready.wait()
        if "error" in outcome:
            raise RpcError(INTERNAL_ERROR, f"MCP server {server.name!r}: {outcome['error']}")
        return list(outcome.get("tools", []))

    def stop(self) -> None:
        """Stop the session's servers."""
        self._stop.set()
