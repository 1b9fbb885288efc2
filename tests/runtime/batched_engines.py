"""Fixtures shared by the scheduler and speculative-decoding tests: one engine per family (GQA, MLA, hybrid) on a
small paged pool, with the batch-invariant kernels on (bit-level equality across row shapes needs them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from freetoken_agent.runtime.engine import Engine
from freetoken_agent.runtime.kernels import ops
from freetoken_agent.runtime.kv import KVConfig

pytest.importorskip("transformers")
from tests.runtime.arch_configs import save_checkpoint  # noqa: E402

FAMILIES = ["qwen3_moe", "deepseek_v3", "qwen3_next"]  # GQA, MLA, hybrid (Gated DeltaNet + attention)


@pytest.fixture(autouse=True)
def batch_invariant() -> Iterator[None]:
    """Bit-level equality across batch and row shapes needs the batch-invariant kernels (``--deterministic``)."""
    before = ops.deterministic()
    ops.set_deterministic(True)
    yield
    ops.set_deterministic(before)


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    folder = tmp_path_factory.mktemp(request.param)
    save_checkpoint(request.param, folder)
    eng = Engine.from_pretrained(folder)
    eng.kv_manager(KVConfig(page_size=4, device_pages=1024))
    yield eng
    eng.close()
