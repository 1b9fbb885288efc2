"""FreeToken Agent: run mixture-of-experts models on the machine you own and drive coding agents with them.

Public names are resolved lazily so that ``import freetoken_agent.runtime`` stays light and importing the SDK
touches no GPU, disk or network.
"""

from __future__ import annotations

from freetoken_agent.runtime.lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY: dict[str, str] = {
    "Engine": "freetoken_agent.runtime.engine",
    "Phase": "freetoken_agent.runtime.phase",
    "Agent": "freetoken_agent.agent",
    "Limits": "freetoken_agent.agent",
    "Sampling": "freetoken_agent.agent",
    "RunResult": "freetoken_agent.result",
    "Backend": "freetoken_agent.backends",
    "ScriptedBackend": "freetoken_agent.backends",
    "OpenAICompatible": "freetoken_agent.backends",
    "LocalEngine": "freetoken_agent.backends",
    "tool": "freetoken_agent.tools",
    "ToolRegistry": "freetoken_agent.tools",
    "Workspace": "freetoken_agent.tools",
    "coding_tools": "freetoken_agent.tools",
}


__getattr__, __dir__ = lazy_exports('freetoken_agent', _LAZY, globals())
