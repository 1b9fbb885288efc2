"""Tools served by an MCP server over stdio (optional ``mcp`` package: ``pip install "freetoken-agent[mcp]"``).

```python
async with mcp_stdio_tools(["python", "server.py"], prefix="notes_") as tools:
    registry = ToolRegistry([*coding_tools(), *tools])
    ...  # the server runs until the block ends
```

MCP objects are read through their wire form (``model_dump(by_alias=True)``: ``inputSchema``, ``isError``,
``readOnlyHint``), the names the protocol specifies, so this does not depend on the SDK's Python field names.
"""

from __future__ import annotations

import re
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from freetoken_agent.tools.context import ToolError, ToolResult
from freetoken_agent.tools.definition import Tool

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup  # installed with anyio on Python 3.10

_INVALID_NAME_CHARS = re.compile(r"[^A-Za-z0-9_-]")


def _require_mcp() -> Any:
    try:
        import mcp
        import mcp.client.stdio
    except ImportError:
        raise ToolError('MCP support needs the "mcp" package: pip install "freetoken-agent[mcp]"') from None
    return mcp


def render_content(blocks: list[dict[str, Any]]) -> str:
    """MCP content blocks as text: text as is, other kinds as a one-line placeholder the model can understand."""
    parts: list[str] = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} content, {block.get('mimeType', 'unknown type')}]")
        elif kind == "resource":
            resource = block.get("resource", {})
            parts.append(str(resource.get("text", f"[resource {resource.get('uri', '')}]")))
        elif kind == "resource_link":
            parts.append(f"[resource link {block.get('uri', '')}]")
        else:
            parts.append(f"[{kind} content]")
    return "\n".join(parts)


def _make_tool(session: Any, spec: dict[str, Any], prefix: str, timeout_s: float | None) -> Tool:
    remote_name: str = spec["name"]
    annotations = spec.get("annotations") or {}
    read_only = bool(annotations.get("readOnlyHint", False))

    async def call(arguments: dict[str, Any]) -> ToolResult:
        result = await session.call_tool(remote_name, arguments, read_timeout_seconds=timeout_s)
        wire = result.model_dump(mode="json", by_alias=True, exclude_none=True)
        content = render_content(wire.get("content", []))
        data = wire.get("structuredContent")
        if not content and data is not None:
            content = str(data)
        return ToolResult(content=content or "(no output)", is_error=bool(wire.get("isError")), data=data)

    schema = dict(spec.get("inputSchema") or {"type": "object"})
    schema.pop("$schema", None)  # validated as draft 2020-12 like our own tools
    return Tool.from_schema(
        prefix + _INVALID_NAME_CHARS.sub("_", remote_name),
        spec.get("description") or annotations.get("title") or remote_name,
        schema,
        call,
        writes=not read_only,  # MCP's default for a tool without hints is "may modify"
        kind="read" if read_only else "other",
    )


@asynccontextmanager
async def mcp_stdio_tools(
    command: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    prefix: str = "",
    timeout_s: float | None = 120.0,
) -> AsyncIterator[list[Tool]]:
    """Start the MCP server ``command`` over stdio, yield its tools, and stop the server when the block ends.

    Tool names get ``prefix`` and have characters outside ``[A-Za-z0-9_-]`` replaced by ``_``. Read-only tools
    (``readOnlyHint``) have ``writes=False`` and kind ``read``; all others are marked as writing.
    ``timeout_s`` bounds each call; a server error or timeout reaches the model as an error result.
    """
    if not command:
        raise ToolError("MCP server command is empty")
    mcp = _require_mcp()
    params = mcp.StdioServerParameters(command=command[0], args=list(command[1:]), env=env, cwd=cwd)
    started = False
    try:
        async with AsyncExitStack() as stack:
            read, write = await stack.enter_async_context(mcp.client.stdio.stdio_client(params))
            session = await stack.enter_async_context(mcp.ClientSession(read, write))
            await session.initialize()
            specs: list[dict[str, Any]] = []
            cursor: str | None = None
            while True:
                request = mcp.types.PaginatedRequestParams(cursor=cursor) if cursor else None
                page = await session.list_tools(params=request)
                wire = page.model_dump(mode="json", by_alias=True, exclude_none=True)
                specs += wire.get("tools", [])
                cursor = wire.get("nextCursor")
                if not cursor:
                    break
            tools = [_make_tool(session, spec, prefix, timeout_s) for spec in specs]
            started = True
            yield tools
    except Exception as exc:
        if started:
            raise
        leaf = _first_leaf(exc)
        raise ToolError(f"MCP server {' '.join(command)!r} did not start: {type(leaf).__name__}: {leaf}") from exc


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
