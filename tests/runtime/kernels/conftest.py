"""Shared fixtures: the kernels build into a per-session temp cache, so tests never touch the user's cache."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    import os

    os.environ.setdefault("FREETOKEN_CACHE", str(tmp_path_factory.mktemp("ftcache")))


@pytest.fixture
def amx_exact():
    """AMX's exact mode for the test (int8 tiles everywhere; where the CPU has no AMX every mode is exact): for tests of
    the int8 numerics and of prefill = decode, which the default mode's bf16 prompt steps do not keep bit for bit."""
    from freetoken_agent.runtime.kernels import build, ops

    if build.load() is None:
        yield
        return
    before = ops.set_amx_mode("exact")
    try:
        yield
    finally:
        ops.set_amx_mode(before)
