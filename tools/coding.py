"""The standard coding tool set."""

from __future__ import annotations

from freetoken_agent.tools.definition import Tool
from freetoken_agent.tools.files import edit_file, read_file, write_file
from freetoken_agent.tools.search import glob, list_files, search
from freetoken_agent.tools.shell import run_shell, run_tests


def coding_tools() -> list[Tool]:
    """``read_file, write_file, edit_file, list_files, glob, search, run_shell, run_tests``, ready for a registry."""
    return [read_file, write_file, edit_file, list_files, glob, search, run_shell, run_tests]
