"""Shared fixtures for SDK tests: a tiny repository with one failing test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CALC = "def add(a, b):\n    return a - b\n"
TEST_CALC = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A workspace whose only test fails until ``calc.add`` is fixed."""
    root = tmp_path / "repo"
    root.mkdir()
    (root / "calc.py").write_text(CALC)
    (root / "test_calc.py").write_text(TEST_CALC)
    return root


def hermes_call(name: str, arguments: object, text: str = "") -> str:
    """A model output in the Hermes/Qwen format calling ``name``."""
    return f'{text}<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'
