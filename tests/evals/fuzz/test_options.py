"""A fixed, seeded sample of the option fuzzer's variants matches transformers (the full sweep is a command:
``python -m freetoken_agent.evals.fuzz.options``); rejections by transformers are out of scope, our errors fail."""

from __future__ import annotations

import json
import time

import pytest
import torch

pytest.importorskip("transformers")

from freetoken_agent.evals.fuzz.options import Outcome, check, main, plan, table
from freetoken_agent.evals.fuzz.variants import Variant, sample, variants
from freetoken_agent.runtime.model.adapters import supported_architectures

SAMPLE = 64
SEED = 18


def _sample() -> list[Variant]:
    return sample(plan(supported_architectures()), SAMPLE, SEED)


def test_seeded_sample_matches_transformers() -> None:
    torch.set_num_threads(1)  # sized for one core: ~35 s
    todo = _sample()
    assert len({v.model_type for v in todo}) >= 20 and len({v.kind for v in todo}) >= 7
    start = time.perf_counter()
    outcomes = [check(v) for v in todo]
    failures = [f"{o.model_type}:{o.option}={o.value}: {o.reason}" for o in outcomes if o.status == "fail"]
    assert not failures, "\n".join(failures)
    passed = [o for o in outcomes if o.status == "pass"]
    assert len(passed) >= SAMPLE // 2, "most sampled variants must run in transformers, else the sample tests nothing"
    assert all(o.max_error is not None and o.max_error < 1e-2 for o in passed)
    assert time.perf_counter() - start < 300  # a loose bound (a busy machine): the sample is sized for ~35 s


def test_a_variant_transformers_rejects_is_out_of_scope() -> None:
    v = next(v for v in variants("mixtral", ("per_layer",)) if v.option == "num_experts_per_tok")
    outcome = check(v)
    assert outcome.status == "out_of_scope" and outcome.reason.startswith("transformers: ")


def test_an_engine_error_is_a_failure() -> None:
    v = Variant("llama", "act", "hidden_act", "relu", {"hidden_act": "relu"})
    outcome = check(v)  # transformers runs a dense Llama; the engine (MoE types only) refuses it by name
    assert outcome.status == "fail" and "UnsupportedArchitectureError" in outcome.reason and "llama" in outcome.reason


def test_table_counts_per_type_and_kind() -> None:
    outcomes = [Outcome("mixtral", "act", "hidden_act", "relu", "pass", "", 1e-6),
                Outcome("mixtral", "act", "hidden_act", "prelu", "fail", "ConfigError: no"),
                Outcome("mixtral", "per_layer", "num_experts_per_tok", "[2, 3, 2]", "out_of_scope", "transformers: x")]
    text = table(outcomes)
    row = next(line for line in text.splitlines() if line.startswith("mixtral"))
    assert "1/2" in row and "0/0 (+1)" in row and row.split()[-4:] == ["3", "1", "1", "1"]
    assert "mixtral:hidden_act=prelu: ConfigError: no" in text


def test_cli_prints_one_json_outcome_per_variant(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--types", "qwen3_moe", "--kinds", "pattern", "--match", "decoder_sparse_step", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and rows and all(r["status"] == "pass" and r["option"] == "decoder_sparse_step" for r in rows)
