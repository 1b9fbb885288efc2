"""The built-in model under a memory budget, shared by the phase-scheduling tests: its path, its byte counts, and
an isolated cache directory per test (profiles and expert files must not leak between tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from freetoken_agent.runtime.builtin import builtin_model_dir

MODEL = builtin_model_dir()
DENSE, EXPERTS = 13221888, 33030144  # the built-in model's dense and routed-expert bytes (float32)


def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$FREETOKEN_CACHE`` in the test's own folder, torch on one thread; returns the cache folder.
    Test modules install it with ``cache = pytest.fixture(autouse=True)(isolated_cache)``."""
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    return tmp_path / "cache"
