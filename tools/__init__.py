"""Typed tool registry and sandboxed coding tools (``freetoken_agent.tools``). Never imports the runtime.

```python
from freetoken_agent.tools import ToolContext, ToolRegistry, Workspace, coding_tools, tool

@tool
def shout(text: str) -> str:
    \"\"\"Upper-case a text.

    Args:
        text: What to shout.
    \"\"\"
    return text.upper()

registry = ToolRegistry([*coding_tools(), shout])
result = await registry.call("read_file", '{"path": "README.md"}', ToolContext(Workspace(".")))
```
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from freetoken_agent.tools.coding import coding_tools
    from freetoken_agent.tools.context import ToolContext, ToolError, ToolResult
    from freetoken_agent.tools.definition import Tool, ToolKind, tool
    from freetoken_agent.tools.mcp import mcp_stdio_tools
    from freetoken_agent.tools.registry import ToolRegistry
    from freetoken_agent.tools.sandbox import ResourceLimits, SandboxMode, SandboxPolicy
    from freetoken_agent.tools.workspace import Workspace, WorkspaceError

_LAZY: dict[str, str] = {
    "tool": "freetoken_agent.tools.definition",
    "Tool": "freetoken_agent.tools.definition",
    "ToolKind": "freetoken_agent.tools.definition",
    "ToolRegistry": "freetoken_agent.tools.registry",
    "ToolContext": "freetoken_agent.tools.context",
    "ToolResult": "freetoken_agent.tools.context",
    "ToolError": "freetoken_agent.tools.context",
    "Workspace": "freetoken_agent.tools.workspace",
    "WorkspaceError": "freetoken_agent.tools.workspace",
    "coding_tools": "freetoken_agent.tools.coding",
    "mcp_stdio_tools": "freetoken_agent.tools.mcp",
    "SandboxPolicy": "freetoken_agent.tools.sandbox",
    "SandboxMode": "freetoken_agent.tools.sandbox",
    "ResourceLimits": "freetoken_agent.tools.sandbox",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'freetoken_agent.tools' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
