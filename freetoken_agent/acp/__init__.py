"""The Agent Client Protocol (ACP v1) server behind ``freetoken acp``: editors (Zed, JetBrains, Neovim and Emacs
plugins) launch the agent as a subprocess and speak JSON-RPC 2.0 over its stdin/stdout, one message per line.

Layers: ``stdio`` (reserved stdout, bounded line reader, ordered writer) → ``jsonrpc`` (dispatch, errors,
outgoing requests) → ``server`` (ACP methods) → ``session`` (one conversation, its turns, permissions, storage)
→ ``updates``/``presentation`` (agent events as ``session/update`` notifications).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from freetoken_agent.acp.server import AcpOptions, AcpServer
    from freetoken_agent.acp.stdio import reserve_stdout

_LAZY = {"AcpOptions": "freetoken_agent.acp.server", "AcpServer": "freetoken_agent.acp.server",
         "reserve_stdout": "freetoken_agent.acp.stdio"}

__all__ = ["AcpOptions", "AcpServer", "reserve_stdout"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'freetoken_agent.acp' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
