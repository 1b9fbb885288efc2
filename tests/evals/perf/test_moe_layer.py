"""The moe-layer row: ours end to end at a tiny shape, an unavailable peer as a reason, the shared fp32 reference and
kt-kernel's group-int4 format, and kt-kernel itself where its interpreter is installed."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from freetoken_agent.evals.perf import harness, kt_peer, moe_layer
from freetoken_agent.runtime.kernels import build

kernels = pytest.mark.skipif(build.load() is None, reason="the C kernels do not build here")
TINY = ["--hidden", "64", "--intermediate", "32", "--experts", "8", "--top-k", "2", "--repeats", "1"]
# kt-kernel's smallest shapes: D and I multiples of 128 (its int4 methods; 64 for AMXInt8), max_len padded to 32
KT_TINY = ["--hidden", "128", "--intermediate", "128", "--experts", "8", "--top-k", "2", "--repeats", "1"]


def run(argv: list[str]) -> tuple[dict[str, Any], argparse.Namespace]:
    r = harness.get("moe-layer")
    args = harness.parse(r, argv, "freetoken bench moe-layer", False)
    return r.run(args), args


def timed(report: dict[str, Any], side: str) -> list[dict[str, Any]]:
    return [r for r in report["results"] if r["side"] == side and "ms" in r]


def test_reference_equals_a_loop_over_tokens_and_slots() -> None:
    t, k, e, d, i = 5, 2, 4, 16, 8
    x = torch.randn(t, d).to(torch.bfloat16)
    gate, up = torch.randn(e, i, d).to(torch.bfloat16), torch.randn(e, i, d).to(torch.bfloat16)
    down = torch.randn(e, d, i).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, k), dim=1)
    want = torch.zeros(t, d)
    for tok in range(t):
        xt = x[tok].float()
        for slot in range(k):
            ex = int(ids[tok, slot])
            h = torch.nn.functional.silu(gate[ex].float() @ xt) * (up[ex].float() @ xt)
            want[tok] += weights[tok, slot] * (down[ex].float() @ h)
    got = kt_peer.reference(x, ids, weights, gate, up, down)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_route_draws_distinct_experts_with_a_skewed_load() -> None:
    gen = torch.Generator().manual_seed(1)
    ids, weights = moe_layer.route(256, 16, 4, 1.0, gen)
    assert ids.shape == weights.shape == (256, 4) and ids.dtype == torch.int64
    assert all(len(set(row)) == 4 for row in ids.tolist()) and int(ids.min()) >= 0 and int(ids.max()) < 16
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(256))
    assert bool((weights[:, :-1] >= weights[:, 1:]).all())
    uniform, _ = moe_layer.route(256, 16, 4, 0.0, torch.Generator().manual_seed(1))
    skewed = moe_layer.load_stats(ids, 16)["busiest_over_mean"]
    assert skewed > moe_layer.load_stats(uniform, 16)["busiest_over_mean"] and skewed > 1.5


def test_kgroup_quantize_rounds_each_value_to_within_half_a_step() -> None:
    w = torch.randn(6, 96).to(torch.bfloat16)
    packed, scales = kt_peer.kgroup_quantize(w)
    assert packed.shape == (6, 48) and packed.dtype == torch.uint8
    assert scales.shape == (6, 3) and scales.dtype == torch.bfloat16
    back = kt_peer.kgroup_dequantize(packed, scales)
    step = scales.float().repeat_interleave(kt_peer.GROUP, dim=1)
    assert bool(((back - w.float()).abs() <= step / 2 * 1.02 + 1e-6).all())
    q = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(6, 96)
    assert int(q.min()) >= 1 and int(q.max()) <= 15  # symmetric: |q - 8| <= 7
    with pytest.raises(kt_peer.PeerError, match="multiple of 32"):
        kt_peer.kgroup_quantize(torch.randn(2, 40))


@kernels
def test_the_row_times_our_fused_step_per_format_and_isa_without_a_peer() -> None:
    report, args = run([*TINY, "--tokens", "1,5", "--peer", "none"])
    ours = timed(report, "ours")
    isas = report["ours"]["isas"]
    assert isas and {(r["M"], r["format"], r["isa"]) for r in ours} == {
        (m, f, i) for m in (1, 5) for f in ("q4", "q8") for i in isas}
    for r in ours:
        assert r["tok_s"] > 0 and r["ms"]["low"] <= r["ms"]["median"] <= r["ms"]["high"]
        assert 0 < r["error"] < (0.3 if r["format"] == "q4" else 0.05), r  # computed, and close to the fp32 layer
    assert report["peer"] == {"name": None, "available": False, "reason": "--peer none"}
    assert all(len(r) == 1 for r in report["ratios"])  # no peer, no ratios
    table = moe_layer.format_table(report, args)
    assert "peer unavailable: --peer none" in table and f"q4 {isas[0]}" in table
    head = moe_layer.headline(report)
    assert head["M"] == 5 and f"q8_{isas[-1]}_ms" in head


@kernels
def test_a_missing_peer_interpreter_is_reported_with_how_to_install(tmp_path: Path) -> None:
    missing = tmp_path / "venv" / "bin" / "python"
    report, args = run([*TINY, "--tokens", "2", "--formats", "q8", "--peer-python", str(missing)])
    peer = report["peer"]
    assert peer["available"] is False and str(missing) in peer["reason"]
    assert "pip install kt-kernel" in peer["install"]
    assert timed(report, "ours") and not timed(report, "kt-kernel")
    assert "peer unavailable" in moe_layer.format_table(report, args)


@kernels
@pytest.mark.skipif(importlib.util.find_spec("kt_kernel") is not None, reason="kt_kernel is importable here")
def test_an_interpreter_without_kt_kernel_is_a_reason_not_a_traceback() -> None:
    report, _ = run([*TINY, "--tokens", "2", "--formats", "q8", "--peer-python", sys.executable])
    assert report["peer"]["available"] is False
    assert report["peer"]["reason"].startswith("cannot import kt_kernel")


@kernels
@pytest.mark.skipif(not Path(moe_layer.PEER_PYTHON).is_file(),
                    reason=f"no kt-kernel interpreter at {moe_layer.PEER_PYTHON}")
def test_kt_kernel_runs_the_same_layer_close_to_the_reference() -> None:
    report, args = run([*KT_TINY, "--tokens", "4", "--formats", "q4", "--threads", "1"])
    peer = report["peer"]
    assert peer["available"], peer
    bound = {"AMXInt8": 0.05, "AMXInt4": 0.4, "AMXInt4_KGroup": 0.3}  # per-row int8, per-row int4, int4 per 32
    got = {r["path"]: r for r in report["results"] if r["side"] == "kt-kernel"}
    assert set(got) == set(kt_peer.METHODS)
    for method, r in got.items():
        if "failed" in r:
            assert peer["variant"] != "amx", r  # on an AMX build every method runs
            continue
        assert 0 < r["error"] < bound[method], r
    if "ms" in got["AMXInt4"]:
        assert "q4_vs_AMXInt4" in report["ratios"][0]


def test_our_isa_paths_start_at_avx512vnni_and_take_new_ones_by_themselves(monkeypatch: pytest.MonkeyPatch) -> None:
    from freetoken_agent.runtime.kernels import ops

    monkeypatch.setattr(ops, "available_isas", lambda: ["portable", "avx2", "avx512vnni", "amx"])
    assert moe_layer.our_isas() == ["avx512vnni", "amx"]
    monkeypatch.setattr(ops, "available_isas", lambda: ["portable", "avx2"])
    assert moe_layer.our_isas() == ["avx2"]  # no AVX-512: the best path there is
    with pytest.raises(harness.BenchError, match="not avx512vnni"):
        moe_layer.our_isas(["avx512vnni"])
