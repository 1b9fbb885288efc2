"""Backends: where the agent's tokens come from.

``LocalEngine`` (the in-process runtime; phase hints reach the engine), ``OpenAICompatible`` (a remote
vLLM/SGLang/llama.cpp or ``freetoken serve`` server) and ``ScriptedBackend`` (prepared outputs, for tests and demos).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from freetoken_agent.backends.base import (
    Backend, BackendEvent, GenerateRequest, GenerationDone, SessionBackend, TextBackend, TextChunk,
)

if TYPE_CHECKING:
    from freetoken_agent.backends.local import LocalEngine
    from freetoken_agent.backends.openai_compat import OpenAICompatible
    from freetoken_agent.backends.scripted import ScriptedBackend

_LAZY = {
    "ScriptedBackend": "freetoken_agent.backends.scripted",
    "OpenAICompatible": "freetoken_agent.backends.openai_compat",
    "LocalEngine": "freetoken_agent.backends.local",
}

__all__ = ["Backend", "BackendEvent", "GenerateRequest", "GenerationDone", "LocalEngine", "OpenAICompatible",
           "ScriptedBackend", "SessionBackend", "TextBackend", "TextChunk"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'freetoken_agent.backends' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
