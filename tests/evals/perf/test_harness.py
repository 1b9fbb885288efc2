"""The benchmark harness: the row registry, records with machine facts, the history and its generated table, the CLI."""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from freetoken_agent.evals.perf import harness, history, machine

PERF = Path(harness.__file__).parent
CLI = [sys.executable, "-m", "freetoken_agent.cli", "bench"]
LIBRARIES = {"concurrent_load", "concurrent_model", "feeding", "ggml_peer", "llama_server", "phase_sim", "phase_trace",
             "phase_gpu", "phase_kv", "suite_llama", "harness", "history", "machine", "timing", "kt_peer"}
"""Modules of evals/perf that are parts of rows (workloads, peers, simulators), not benchmarks of their own."""
RUN_BY = {"bench_gguf_decode": ("decode", "long-context")}
"""Benchmark modules whose measurement another module's row runs (``bench_decode``'s rows call its ``measure``)."""


@pytest.fixture
def square_row() -> str:
    def options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--n", type=int, default=3)

    def run(args: argparse.Namespace) -> dict[str, object]:
        if args.n < 0:
            raise harness.BenchError(f"--n must be >= 0, got {args.n}")
        return {"n": args.n, "square": args.n * args.n, "detail": {"list": list(range(args.n))}}

    run.__module__ = "tests.evals.perf.test_harness"
    harness.row("test-square", "squares a number", options, format=lambda r, a: f"{r['n']}^2 = {r['square']}")(run)
    yield "test-square"
    del harness.ROWS["test-square"]


def test_every_benchmark_module_registers_a_row() -> None:
    rows = harness.load_rows()
    expected = {"kernels", "decode", "long-context", "prefill", "agent-replay", "over-budget", "suite", "serve",
                "kv-reuse", "residency", "kv-dtype", "phase-replay", "phase-live", "phase-kv", "speculative",
                "constrained", "overhead", "batch", "load-memory", "quantize-rate", "triton", "gpu-check", "routing",
                "moe-layer", "attn-builds", "amx-epilogue", "weight-builds", "resend"}
    assert expected <= set(rows)
    registering = {r.module.rsplit(".", 1)[-1] for r in rows.values()}
    for file in PERF.glob("*.py"):
        name = file.stem
        if name.startswith("_") or name in LIBRARIES:
            continue
        assert name in registering or set(RUN_BY.get(name, ())) <= set(rows) and name in RUN_BY, \
            f"evals/perf/{file.name} is a benchmark without a harness row"
    for r in rows.values():
        assert r.description and "\n" not in r.description, r.name
        harness.parser_for(r, "x", True).format_help()  # every row's flags build a parser


def test_a_library_module_is_imported_by_a_row_module() -> None:
    """What no row uses is deleted: every library module is imported by another module of evals/perf."""
    sources = {f.stem: f.read_text() for f in PERF.glob("*.py")}
    for name in LIBRARIES:
        users = [m for m, src in sources.items() if m != name and
                 any(isinstance(n, (ast.Import, ast.ImportFrom)) and name in ast.unparse(n) for n in ast.walk(ast.parse(src)))]
        assert users, f"evals/perf/{name}.py is imported by no other module"


def test_a_run_is_recorded_with_machine_facts_and_the_table_regenerated(square_row: str, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    hist = tmp_path / "results.jsonl"
    bandwidth = lambda: {"read_gbps": 12.5, "read_threads": 1}  # noqa: E731
    assert harness.cli(square_row, ["--n", "4", "--history", str(hist)], "freetoken bench test-square", True,
                       bandwidth) == 0
    assert capsys.readouterr().out.strip() == "4^2 = 16"
    assert harness.cli(square_row, ["--n", "5", "--json", "--history", str(hist)], "freetoken bench test-square",
                       True, bandwidth) == 0
    assert json.loads(capsys.readouterr().out)["square"] == 25
    recs = history.read(hist)
    assert [r["report"]["square"] for r in recs] == [16, 25]
    rec = recs[-1]
    assert rec["row"] == square_row and rec["command"] == "freetoken bench test-square --n 5 --json --history " + str(hist)
    assert rec["headline"] == {"n": 5, "square": 25} and rec["options"] == {"n": 5}
    m = rec["machine"]
    assert m["read_gbps"] == 12.5 and m["cores"] >= 1 and m["memory_bytes"] > 0 and len(m["load_avg"]) == 3
    assert m["cpu"] and isinstance(m["flags"], list) and m["key"]
    table = (tmp_path / "LATEST.md").read_text()
    assert table.startswith("<!-- generated") and "| test-square |" in table and "square 25" in table
    assert "square 16" not in table  # only the latest run of the row on this machine
    assert harness.cli(square_row, ["--n", "2", "--no-record", "--history", str(hist)], "x", True, bandwidth) == 0
    assert len(history.read(hist)) == 2


def test_latest_keeps_one_result_per_row_and_machine(tmp_path: Path) -> None:
    def rec(row: str, key: str, date: str, v: int) -> dict[str, object]:
        return {"row": row, "date": date, "command": f"freetoken bench {row}", "headline": {"v": v},
                "machine": {"key": key, "cpu": key, "cores": 2}}

    hist = tmp_path / "h.jsonl"
    for r in (rec("decode", "A", "2026-01-02T00:00:00Z", 2), rec("decode", "A", "2026-01-01T00:00:00Z", 1),
              rec("decode", "B", "2026-01-01T00:00:00Z", 3), rec("batch", "A", "2026-01-01T00:00:00Z", 4)):
        history.append(r, hist)
    latest = history.latest(history.read(hist))
    assert [(r["row"], r["machine"]["key"], r["headline"]["v"]) for r in latest] == [
        ("batch", "A", 4), ("decode", "A", 2), ("decode", "B", 3)]
    out = history.write_latest(hist)
    assert out == tmp_path / "LATEST.md" and out.read_text().count("| decode |") == 2
    hist.write_text(hist.read_text() + "not json\n")
    with pytest.raises(ValueError, match=r"h.jsonl:5: not a benchmark record"):
        history.read(hist)


def test_runs_with_freetoken_settings_are_tagged_and_kept_apart(square_row: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    hist = tmp_path / "results.jsonl"
    bandwidth = lambda: {"read_gbps": 1.0, "read_threads": 1}  # noqa: E731
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))  # a location, not a setting: no tag
    for env in (None, "avx512vnni"):
        if env:
            monkeypatch.setenv("FREETOKEN_ISA", env)
        else:
            monkeypatch.delenv("FREETOKEN_ISA", raising=False)
        assert harness.cli(square_row, ["--n", "3", "--history", str(hist)], "freetoken bench test-square", True,
                           bandwidth) == 0
    recs = history.read(hist)
    assert recs[0]["tags"].get("env", {}).get("FREETOKEN_ISA") is None
    assert recs[1]["tags"]["env"]["FREETOKEN_ISA"] == "avx512vnni"
    assert len(history.latest(recs)) == 2  # one latest result per setting, not one overwriting the other
    table = (tmp_path / "LATEST.md").read_text()
    assert "`FREETOKEN_ISA=avx512vnni freetoken bench test-square" in table


def test_bad_input_is_one_error(square_row: str) -> None:
    with pytest.raises(harness.BenchError, match="--n must be >= 0"):
        harness.cli(square_row, ["--n", "-1", "--no-record"], "x", True)
    with pytest.raises(harness.BenchError, match="no benchmark row 'nope'"):
        harness.get("nope")


def test_machine_facts_measure_read_bandwidth() -> None:
    f = machine.facts(8 << 20)
    assert f["read_gbps"] > 0 and f["read_threads"] in (1, machine.usable_cores())
    assert "read_gbps" not in machine.facts(None)


def test_cli_lists_rows_and_rejects_unknown_ones() -> None:
    listed = subprocess.run(CLI + ["list"], capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines()]
    assert {"kernels", "decode", "serve", "gpu-check"} <= set(names)
    for args, msg in (([], "freetoken bench list"), (["nope"], "no benchmark row 'nope'")):
        proc = subprocess.run(CLI + args, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and msg in proc.stderr and "Traceback" not in proc.stderr


def test_attn_builds_compares_two_builds_of_the_kernels(tmp_path: Path) -> None:
    """The attention A/B row runs two builds (here the same one twice) and reports every shape; a file that is no
    build of the kernels is one clear error."""
    from freetoken_agent.evals.perf import attn_builds
    from freetoken_agent.runtime.kernels import build, ops

    lib = build.load()
    if lib is None:
        pytest.skip(f"C kernels unavailable here: {build.status().reason}")
    import shutil

    # copies under other paths: each is loaded as its own library (its own pool and settings), as two builds are;
    # the engine's loaded library is never touched
    old, new = tmp_path / "old.so", tmp_path / "new.so"
    shutil.copyfile(build.build(), old)
    shutil.copyfile(build.build(), new)
    spin = ops.set_spin_us(ops.HANDOFF_SPIN_US)
    ops.set_spin_us(spin)
    report = harness.run_json_main(attn_builds.main, [str(old), str(new), "--threads", "1", "--repeats", "6"])
    assert ops.set_spin_us(spin) == spin  # the library in use kept its settings
    assert len(report["rows"]) == 2 * len(attn_builds.SHAPES)
    assert all(r["old_ms"] > 0 and r["new_ms"] > 0 for r in report["rows"])
    bad = tmp_path / "not.so"
    bad.write_bytes(b"nothing")
    with pytest.raises(SystemExit):
        attn_builds.main([str(bad), str(new)])


def test_weight_builds_compares_two_builds_of_the_decode_weight_kernels(tmp_path: Path) -> None:
    """The weight-kernel A/B row runs two builds (the same one twice) over a layer's projections and MoE step and
    reports the whole step, the MoE and the dense parts with their bytes; a file that is no build is a clear error."""
    from freetoken_agent.evals.perf import weight_builds
    from freetoken_agent.runtime.kernels import build

    if build.load() is None:
        pytest.skip(f"C kernels unavailable here: {build.status().reason}")
    import shutil

    old, new = tmp_path / "old.so", tmp_path / "new.so"
    shutil.copyfile(build.build(), old)
    shutil.copyfile(build.build(), new)
    report = harness.run_json_main(weight_builds.main, [str(old), str(new), "--threads", "1", "--rounds", "2",
                                                        "--layers", "1"])
    parts = {r["part"]: r for r in report["rows"]}
    assert set(parts) == {"all", "moe", "dense"}
    assert parts["all"]["gb"] == pytest.approx(parts["moe"]["gb"] + parts["dense"]["gb"], abs=2e-3)
    # one layer: 8 experts of 3 x 768 x 2048 Q4_0 values (0.5625 bytes each), q|k|v + o of 5.2M Q8_0 values
    assert parts["moe"]["gb"] == pytest.approx(8 * 3 * 768 * 2048 * 0.5625 / 1e9, abs=2e-3)
    assert all(r["old_gbps"] > 0 and r["new_gbps"] > 0 for r in report["rows"])
    bad = tmp_path / "not.so"
    bad.write_bytes(b"nothing")
    with pytest.raises(SystemExit):
        weight_builds.main([str(bad), str(new)])


def test_attn_builds_cold_reads_past_the_last_level_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--cold`` sizes its eviction read from the largest cache sysfs reports (64 MiB where none) and says so."""
    from freetoken_agent.evals.perf import attn_builds
    from freetoken_agent.runtime.kernels import build

    for index, size in enumerate(["48K", "2048K", "105M", "junk"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert attn_builds.last_level_cache_bytes(tmp_path) == 105 << 20
    assert attn_builds.last_level_cache_bytes(tmp_path / "none") == 64 << 20
    if build.load() is None:
        pytest.skip(f"C kernels unavailable here: {build.status().reason}")
    import shutil

    lib = tmp_path / "k.so"
    shutil.copyfile(build.build(), lib)
    sizes: list[int] = []
    real_ones = attn_builds.torch.ones
    monkeypatch.setattr(attn_builds, "last_level_cache_bytes", lambda: 1 << 20)
    monkeypatch.setattr(attn_builds, "SHAPES", attn_builds.SHAPES[4:5])  # 32 keys: quick
    monkeypatch.setattr(attn_builds.torch, "ones", lambda n, *a, **k: sizes.append(n) or real_ones(n, *a, **k))
    report = harness.run_json_main(attn_builds.main, [str(lib), str(lib), "--threads", "1", "--repeats", "6", "--cold"])
    assert report["cold"] is True and sizes == [2 * (1 << 20) // 4]  # twice the cache, in floats
    assert all(r["old_ms"] > 0 and r["new_ms"] > 0 for r in report["rows"])


def test_long_rows_report_what_they_keep_of_the_short_rate() -> None:
    from freetoken_agent.evals.perf import bench_decode

    def run(model: str, threads: int, prompt: int, ours: float) -> dict[str, Any]:
        return {"model": model, "params": 7.5e9, "dense": "q8", "threads": threads, "prompt_len": prompt,
                "ours_tok_s": ours, "peer_tok_s": 10.0, "ratio": ours / 10.0}

    runs = [run("m", 2, 32, 40.0), run("m", 2, 4096, 30.0), run("m", 1, 8192, 9.0), run("m", 1, 64, 18.0),
            run("other", 2, 8192, 5.0)]
    bench_decode.keep_rates(runs)
    assert runs[1]["of_short"] == 0.75 and runs[1]["short_prompt"] == 32
    assert runs[2]["of_short"] == 0.5 and runs[2]["short_prompt"] == 64  # same thread count only
    assert all("of_short" not in r for r in (runs[0], runs[3], runs[4]))  # the shortest, or alone
    text = bench_decode.format_report({"peer": "llama.cpp", "tokens": 16, "rounds": 3, "runs": runs})
    assert "ours / ours after the shortest prompt" in text and "| 4096 | 30.00 | 10.00 | 3.00x | 0.75 |" in text


def test_decode_report_prints_each_rounds_stream_and_kept_share() -> None:
    from freetoken_agent.evals.perf import bench_decode, bench_gguf_decode

    run = {"model": "m", "params": 7.5e9, "dense": "q8", "threads": 2, "prompt_len": 8192, "ours_tok_s": 22.5,
           "peer_tok_s": 10.0, "ratio": 2.25, "rates": {"ours": [22.0, 23.0]},
           "stream": bench_gguf_decode.stream_share(1e9, [22.0, 23.0], [44.0, 23.0]),
           "paired_short": {"prompt_len": 32, "rates": [40.0, 46.0], "kept": [0.55, 0.5], "kept_median": 0.52}}
    assert run["stream"]["share"] == [0.5, 1.0] and run["stream"]["share_median"] == 0.75
    text = bench_decode.format_report({"peer": "llama.cpp", "tokens": 16, "rounds": 2, "runs": [run]})
    assert "| 2 | 8192 | 1.000 GB | 22.0, 23.0 | 44.0, 23.0 | 0.50, 1.00 | 0.75 |" in text
    assert "| 2 | 8192 | 22.0, 23.0 | 40.0, 46.0 | 0.55, 0.50 | 0.52 |" in text
