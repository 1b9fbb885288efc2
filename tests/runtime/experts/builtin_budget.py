"""The built-in model under a memory budget, shared by the phase-scheduling tests: its path, its byte counts, and
an isolated cache directory per test (profiles and expert files must not leak between tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from freetoken_agent.runtime.builtin import builtin_model_dir
from freetoken_agent.runtime.checkpoint.reader import load_config
from freetoken_agent.runtime.model.adapters import spec_from_config
from freetoken_agent.runtime.model.workspace import step_bytes

MODEL = builtin_model_dir()
DENSE = 13221888 + step_bytes(spec_from_config(load_config(MODEL)))
"""The built-in model's dense weights (float32) and a step's working memory: what a budget holds besides experts."""
EXPERTS = 33030144  # its routed-expert bytes (float32)


def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$FREETOKEN_CACHE`` in the test's own folder, torch on one thread; returns the cache folder.
    Test modules install it with ``cache = pytest.fixture(autouse=True)(isolated_cache)``."""
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    return tmp_path / "cache"
