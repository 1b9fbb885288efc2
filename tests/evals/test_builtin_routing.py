"""The routing report, checked against routing recomputed independently with ``transformers``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from freetoken_agent.evals.builtin.data import phase_spans, render_session
from freetoken_agent.evals.perf.routing_report import (
    PHASES,
    format_report,
    jensen_shannon,
    main,
    measure,
    token_phases,
)
from freetoken_agent.runtime.builtin import builtin_model_dir
from tokenizers import Tokenizer

from .builtin_sessions import write_session


def _sessions(folder: Path) -> list[Path]:
    return [write_session(folder, f"p__p-{i}", turns=[
        ("THOUGHT: Let me read the module first.", f"cat src/mod{i}.py", f"def f(x):\n    return x * {i}\n"),
        ("THOUGHT: Run the failing test.", "python -m pytest tests -q", f"FAILED tests/test_mod.py::test_{i}\n1 failed")])
        for i in range(2)]


def test_jensen_shannon_known_values() -> None:
    assert jensen_shannon(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 6.0])) == pytest.approx(0.0, abs=1e-12)
    assert jensen_shannon(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 5.0])) == pytest.approx(1.0)
    # p = (1, 0), q = (1/2, 1/2): m = (3/4, 1/4); JSD = 1/2 log2(4/3) + 1/4 log2(2/3) + 1/4 log2(2)
    expected = 0.5 * math.log2(4 / 3) + 0.25 * math.log2(2 / 3) + 0.25
    assert jensen_shannon(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])) == pytest.approx(expected)


def test_token_phases_cover_exactly_the_phase_spans(tmp_path: Path) -> None:
    text = render_session(_sessions(tmp_path)[0])
    tok = Tokenizer.from_file(str(builtin_model_dir() / "tokenizer.json"))
    enc = tok.encode(text)
    labels = token_phases(text, enc.offsets)
    for phase in PHASES:
        from_tokens = "".join(text[a:b] for (a, b), lab in zip(enc.offsets, labels) if lab == phase)
        from_spans = "".join(text[a:b] for a, b, p in phase_spans(text) if p == phase)
        assert from_tokens == from_spans and from_spans


def test_report_matches_transformers_routing(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    sessions = _sessions(tmp_path)
    report = measure(builtin_model_dir(), sessions, window=256)
    hf = transformers.AutoModelForCausalLM.from_pretrained(builtin_model_dir(), dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(builtin_model_dir() / "tokenizer.json"))
    counts = {p: torch.zeros(report.layers, report.experts) for p in PHASES}
    reuse, pairs = torch.zeros(report.layers), 0
    for path in sessions:
        text = render_session(path)
        enc = tok.encode(text)
        labels = token_phases(text, enc.offsets)
        for start in range(0, len(enc.ids) - 1, 256):
            ids = enc.ids[start: start + 256]
            with torch.no_grad():
                router = hf(torch.tensor([ids]), output_router_logits=True).router_logits  # L × [T, E]
            for layer, logits in enumerate(router):
                chosen = logits.topk(report.top_k, dim=-1).indices  # [T, K]
                for t, lab in enumerate(labels[start: start + 256]):
                    if lab is not None:
                        counts[lab][layer, chosen[t]] += 1
                reuse[layer] += sum(len(set(chosen[t + 1].tolist()) & set(chosen[t].tolist()))
                                    for t in range(len(ids) - 1)) / report.top_k
            pairs += len(ids) - 1
    for phase in PHASES:
        assert report.tokens[phase] == int(counts[phase][0].sum()) // report.top_k > 0
        expected = counts[phase] / counts[phase].sum(-1, keepdim=True)
        assert torch.tensor(report.frequency[phase]).sub(expected).abs().max() < 0.02
    assert torch.tensor(report.locality).sub(reuse / pairs).abs().max() < 0.02
    for key, values in report.jsd.items():
        a, b = key.split("|")
        assert values[0] == pytest.approx(jensen_shannon(counts[a][0], counts[b][0]), abs=0.02)
    assert "JSD plan|code" in format_report(report)


def test_cli_writes_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    data = tmp_path / "data"
    data.mkdir()
    _sessions(data)
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["--data-dir", str(data), "--all-sessions", "--window", "256",
                 "--json", str(out_json), "--png", str(out_png)]) == 0
    assert "locality" in capsys.readouterr().out
    saved = json.loads(out_json.read_text())
    assert saved["experts"] == 16 and set(saved["frequency"]) == set(PHASES)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 10_000


def test_missing_data_folder_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="does not exist"):
        main(["--data-dir", str(tmp_path / "none")])
