"""The examples run as shipped (their scripted mode needs no model) and do what they say."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(("script", "expected"), [
    ("coding_agent.py", ["[code]", "edit_file(", "done: Fixed add()."]),
    ("custom_tool_agent.py", ["extension must start with '.'", '{"app.py": [1, 4]}', "done after 3 steps"]),
    ("remote_agent.py", ["done in 2 steps", "The notes say: remote agents work."]),
])
def test_example_runs(script: str, expected: list[str]) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for text in expected:
        assert text in proc.stdout
