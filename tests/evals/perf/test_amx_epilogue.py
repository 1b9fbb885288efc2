"""``amx_epilogue``: the exact AMX mode's inner loop timed whole and in parts on an AMX machine; elsewhere a skip
with its reason (the dispatch test of the AMX path itself lives in tests/runtime/kernels/test_amx.py)."""

from __future__ import annotations

from freetoken_agent.evals.perf import amx_epilogue
from freetoken_agent.runtime.kernels import ops


def test_the_exact_modes_inner_loop_is_timed_whole_and_in_parts_or_skipped_with_a_reason() -> None:
    r = amx_epilogue.measure(iters=50)
    if "amx" not in ops.available_isas():
        assert "AMX" in r["skipped"]
        assert amx_epilogue.format_table(r).startswith("amx_epilogue: skipped:")
        return
    assert set(r["modes"]) == {"full", "no-readback", "no-store", "tiles", "epilogue"}
    assert all(v["ns"] > 0 and v["cycles"] > 0 for v in r["modes"].values()) and r["clock_ghz"] > 0
    table = amx_epilogue.format_table(r)
    assert "| full |" in table and "| epilogue |" in table
    assert amx_epilogue.main(["--iters", "20", "--json"]) == 0
