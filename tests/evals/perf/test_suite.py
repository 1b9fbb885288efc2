"""``freetoken bench suite``: the pairwise comparisons run end to end on a small shape; the CLI's wiring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from freetoken_agent.evals.perf import bench_gguf_decode, suite
from freetoken_agent.runtime.execution.capacity import model_size

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

SMALL = {**bench_gguf_decode.CONFIG, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 128}  # fmt: skip


def test_bytes_per_token_counts_dense_experts_and_kv() -> None:
    c = bench_gguf_decode.CONFIG
    d, layers = c["hidden_size"], c["num_hidden_layers"]
    attn = d * c["num_attention_heads"] * c["head_dim"] * 2 + d * c["num_key_value_heads"] * c["head_dim"] * 2
    per_layer = attn + d * c["num_experts"] + 2 * d + 2 * c["head_dim"]  # projections, router, norms, q/k norms
    dense = (layers * per_layer + d + c["vocab_size"] * d) * 4  # + final norm + lm_head, fp32; embedding not read
    experts = layers * c["num_experts_per_tok"] * 3 * d * c["moe_intermediate_size"] * 18 // 32
    kv = layers * c["num_key_value_heads"] * 2 * c["head_dim"] * 4 * 10
    assert suite.decode_bytes_per_token(c, 10) == dense + experts + kv
    assert model_size(c, "q4").experts_per_layer == 64


def test_suite_runs_pairwise_and_reports_ratios(tmp_path: Path) -> None:
    report = suite.run(quick=True, threads=1, root=tmp_path, q4_config=SMALL)
    q4 = report["rows"]["cpu_decode_q4"]
    assert len(q4["runs"]["ours"]) == len(q4["runs"]["llama.cpp"]) == 3  # alternating rounds, medians
    assert q4["ratio"] == pytest.approx(q4["ours_tok_s"] / q4["peer_tok_s"], rel=0.01)
    assert report["cpu_decode_ratio_vs_llamacpp"] == q4["ratio"]
    assert q4["greedy_prefix_agreement"] >= 1  # same weights: the first greedy token agrees
    fp32 = report["rows"]["cpu_decode_fp32"]
    assert fp32["greedy_identical"] and fp32["ratio"] > 0
    bw = report["rows"]["bandwidth"]
    frac = suite.decode_bytes_per_token(SMALL, 32 + 16) * q4["ours_tok_s"] / (bw["read_gbps"] * 1e9)
    assert report["bandwidth_fraction"] == pytest.approx(frac, rel=0.01) and 0 < frac
    assert (tmp_path / "gguf" / "qwen3_moe-d256" / "model-q4_0.gguf").is_file()
    table = suite.format_table(report)
    assert "| cpu_decode_q4 |" in table and "llama.cpp Q4_0" in table and "bandwidth fraction" in table
    out = suite.write_json(report, tmp_path / "r" / "suite.json")
    assert json.loads(out.read_text())["cpu_decode_ratio_vs_llamacpp"] == q4["ratio"]


def test_cli_wiring_keeps_kernels_and_rejects_bad_flags() -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "freetoken_agent.cli", "bench", *args], capture_output=True,
                              text=True, timeout=120, env=dict(os.environ), check=False)  # fmt: skip

    none = cli()
    assert none.returncode == 2 and "kernels, suite" in none.stderr and "--quick" in none.stderr
    bad = cli("suite", "--threads", "0")
    assert bad.returncode == 2 and "--threads must be at least 1" in bad.stderr and "Traceback" not in bad.stderr
    assert "suite" in cli("--help").stdout and "--working-set-mb" in cli("kernels", "--help").stdout
