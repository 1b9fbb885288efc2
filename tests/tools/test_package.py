"""The public names of freetoken_agent.tools resolve to the API objects, even after every submodule was imported."""

from __future__ import annotations

import importlib
import pkgutil
import types

import freetoken_agent.tools as tools_package


def test_exports_are_not_shadowed_by_submodules() -> None:
    for info in pkgutil.iter_modules(tools_package.__path__):
        if info.name != "mcp":  # optional dependency; its names are checked below without importing mcp itself
            importlib.import_module(f"freetoken_agent.tools.{info.name}")
    for name in tools_package.__all__:
        value = getattr(tools_package, name)
        assert not isinstance(value, types.ModuleType), f"freetoken_agent.tools.{name} is a module"
    from freetoken_agent.tools import Tool, tool

    @tool
    def ping() -> str:
        """Ping."""
        return "pong"

    assert isinstance(ping, Tool)


def test_coding_tool_metadata() -> None:
    from freetoken_agent.tools import coding_tools

    table = {t.name: (t.kind, t.writes) for t in coding_tools()}
    assert table == {
        "read_file": ("read", False),
        "write_file": ("edit", True),
        "edit_file": ("edit", True),
        "list_files": ("read", False),
        "glob": ("search", False),
        "search": ("search", False),
        "run_shell": ("execute", True),  # commands and test code can change anything: clients should ask first
        "run_tests": ("execute", True),
    }
    assert all(t.description and t.parameters["additionalProperties"] is False for t in coding_tools())
