"""Agent phases: ``plan`` (short reasoning), ``code`` (writing code or edits), ``tool`` (a tool runs, the model idles).

The runtime owns the enum (it never imports the SDK); the SDK re-exports it here. The agent loop switches phase
explicitly and tells the backend before each switch, so a local engine can stage the experts and KV a phase needs.
"""

from __future__ import annotations

from freetoken_agent.runtime.phase import Phase

__all__ = ["Phase"]
