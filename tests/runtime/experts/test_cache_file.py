"""The expert cache file round-trips every layout byte for byte, and is rewritten when stale or corrupt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from freetoken_agent.runtime.checkpoint.experts import ExpertTensors
from freetoken_agent.runtime.experts.cache_file import (
    PAGE,
    ExpertCacheFile,
    open_or_write,
)
from freetoken_agent.runtime.experts.layout import ExpertLayout


def _expert(layer: int, e: int, d: int = 64, i: int = 48) -> ExpertTensors:
    g = torch.Generator().manual_seed(layer * 100 + e)
    return ExpertTensors(torch.randn(2 * i, d, generator=g), torch.randn(d, i, generator=g),
                         torch.randn(2 * i, generator=g), torch.randn(d, generator=g))


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "q8_0", "q4_0"])
def test_round_trip(tmp_path: Path, fmt: str) -> None:
    layout = ExpertLayout(fmt, 64, 48, bias=True, packed=fmt.startswith("q"))
    f, written = open_or_write(tmp_path / "x.ftx", layout, [1, 3], 5, _expert)
    assert written and f.offset(3, 4) % PAGE == 0
    pool = torch.zeros(2, layout.stride, dtype=torch.uint8)
    for (layer, e) in [(3, 4), (1, 0)]:
        f.read_into(layer, e, pool[0])
        assert torch.equal(pool[0, : layout.blob_bytes], layout.encode(_expert(layer, e)))
    views = layout.views(pool)
    f.read_into(1, 2, pool[1])
    t = _expert(1, 2)
    if fmt in ("float32", "bfloat16"):
        dtype = torch.float32 if fmt == "float32" else torch.bfloat16
        assert torch.equal(views.gate_up[1], t.gate_up.to(dtype)) and torch.equal(views.down[1], t.down.to(dtype))
    assert torch.equal(views.down_bias[1].float(), t.down_bias.to(views.down_bias.dtype).float())
    _, written = open_or_write(tmp_path / "x.ftx", layout, [1, 3], 5, _expert)
    assert not written
    other = ExpertLayout("float16", 64, 48, bias=True)
    _, written = open_or_write(tmp_path / "x.ftx", other, [1, 3], 5, _expert)
    assert written  # a different layout rewrites the file


def test_corrupt_file_is_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "bad.ftx"
    path.write_bytes(b"garbage" * 10)
    layout = ExpertLayout("float32", 64, 48)
    f, written = open_or_write(path, layout, [0], 2, _expert)
    assert written and isinstance(f, ExpertCacheFile)
