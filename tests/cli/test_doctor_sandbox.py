"""``freetoken doctor`` reports the sandbox mechanisms, through the real entry point (one call: it is slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from freetoken_agent.tools.sandbox import probe


def test_doctor_shows_the_sandbox_mechanisms(tmp_path: Path) -> None:
    env = {**os.environ, "FREETOKEN_CACHE": str(tmp_path), "FREETOKEN_THREADS": "1",
           "FREETOKEN_SANDBOX_DISABLE": "namespaces"}
    done = subprocess.run([sys.executable, "-m", "freetoken_agent.cli", "doctor", "--seconds", "0.05", "--json"],
                          capture_output=True, text=True, timeout=240, env=env, check=False)
    assert done.returncode == 0, done.stderr
    sandbox = json.loads(done.stdout)["sandbox"]
    assert sandbox["landlock_abi"] == probe().landlock_abi and sandbox["namespaces"] is False
    assert sandbox["notes"] == ["namespaces disabled by FREETOKEN_SANDBOX_DISABLE"]
