"""Shared fixtures: the kernels build into a per-session temp cache, so tests never touch the user's cache."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    import os

    os.environ.setdefault("FREETOKEN_CACHE", str(tmp_path_factory.mktemp("ftcache")))
