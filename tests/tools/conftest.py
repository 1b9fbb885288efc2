"""Shared fixtures for the tool tests: a real temp workspace and a context over it."""

from __future__ import annotations

from pathlib import Path

import pytest
from freetoken_agent.tools import ToolContext, ToolRegistry, Workspace, coding_tools


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "ws"
    folder.mkdir()
    return folder


@pytest.fixture
def ctx(root: Path) -> ToolContext:
    return ToolContext(workspace=Workspace(root), timeout_s=20.0)


@pytest.fixture
def registry() -> ToolRegistry:
    return ToolRegistry(coding_tools())
