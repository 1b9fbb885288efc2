"""The agent phase the engine is told about. Owned by the runtime; the SDK re-exports it."""

from __future__ import annotations

from enum import Enum


class Phase(str, Enum):
    """What the next tokens are for: ``plan`` (short reasoning), ``code`` (long code/edits), ``tool`` (I/O pause)."""

    PLAN = "plan"
    CODE = "code"
    TOOL = "tool"
