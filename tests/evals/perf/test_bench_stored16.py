"""``bench_stored16``: the fp32 expert kernel over fp32 and bf16 copies of the same experts, at tiny shapes."""

from __future__ import annotations

import pytest

from freetoken_agent.evals.perf import bench_stored16
from freetoken_agent.runtime.kernels import build

pytestmark = pytest.mark.skipif(build.load() is None, reason="C kernels unavailable (no compiler)")


def test_measures_both_dtypes_with_the_same_bits(capsys: pytest.CaptureFixture[str]) -> None:
    res = bench_stored16.measure(layers=2, experts=4, hidden=32, inter=16, top_k=2, tokens=[1, 3], rounds=2, flush_mb=1)
    assert set(res) == {"1", "3"}
    for r in res.values():
        assert r["fp32_ms"] > 0 and r["bf16_ms"] > 0 and r["speedup"] > 0
    assert bench_stored16.main(["--layers", "1", "--experts", "4", "--hidden", "32", "--inter", "16", "--tokens",
                                "2", "--rounds", "1", "--flush-mb", "1"]) == 0
    assert "| 2 |" in capsys.readouterr().out


def test_bad_arguments_are_refused() -> None:
    for bad in (["--tokens", "x"], ["--tokens", "0"], ["--top-k", "20"]):
        with pytest.raises(SystemExit) as exc:
            bench_stored16.main(bad)
        assert exc.value.code == 2
